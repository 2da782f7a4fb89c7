"""The Batch API's engine-agnostic core: the SQLite store, line validation, the runner's bookkeeping.

The runner is driven here by a plain coroutine in place of the server's
handlers (its documented contract: execute(url, body) -> Execution); the
real handlers and engine are exercised in test_batch_api.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from threefold.batch.runner import BatchRunner, Execution, Retry, RunnerConfig
from threefold.batch.store import BatchStore, NotFoundError
from threefold.batch.validate import BatchLimits, check_batch_request, check_upload, parse_lines
from threefold.errors import ThreefoldError

URL = "/v1/completions"


def request_line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": {"prompt": custom_id, **body}})


def make_batch(store: BatchStore, *lines: str):
    file = store.add_file(("\n".join(lines) + "\n").encode(), "in.jsonl", "batch")
    return store.create_batch(file["id"], URL, {"k": "v"})


def runner_for(store: BatchStore, execute, **config) -> BatchRunner:
    return BatchRunner(store, execute, lambda url, body: body.get("max_tokens", 1), lambda model: model in (None, "m"),
                       RunnerConfig(poll_s=0.01, **config))


async def echo(url: str, body: dict) -> Execution:
    await asyncio.sleep(0.001)
    return Execution(200, f"req-{body['prompt']}", {"echo": body})


def test_store_survives_reopen_and_records_each_line_once(tmp_path) -> None:
    store = BatchStore(tmp_path)
    batch = make_batch(store, request_line("a"), request_line("b"), request_line("c"))
    lines, errors = parse_lines(store.file_content(batch.input_file_id), URL, lambda m: True, BatchLimits())
    assert store.start_batch(batch.id, lines, errors).status == "in_progress"
    assert store.record_result(batch.id, 1, True, {"custom_id": "b"})
    assert not store.record_result(batch.id, 1, False, {"custom_id": "b", "again": True})  # already done
    store.close()

    reopened = BatchStore(tmp_path)  # as after a crash: only unfinished lines are pending
    assert [line.custom_id for line in reopened.pending_lines(batch.id)] == ["a", "c"]
    assert list(reopened.results(batch.id)) == [(True, {"custom_id": "b"})]
    again = reopened.get_batch(batch.id)
    assert again.request_counts == {"total": 3, "completed": 1, "failed": 0} and again.metadata == {"k": "v"}
    assert reopened.active_batch_ids() == [batch.id] and reopened.num_pending() == 2
    with pytest.raises(NotFoundError, match="No such batch"):
        reopened.get_batch("batch_x")
    assert reopened.delete_file(batch.input_file_id)["deleted"]
    with pytest.raises(NotFoundError, match="No such file"):
        reopened.file_content(batch.input_file_id)


def test_bad_lines_become_error_lines_and_bad_requests_raise() -> None:
    data = "\n".join([request_line("ok"), "{not json", json.dumps([1]), request_line("ok"),
                      json.dumps({"method": "POST", "url": URL, "body": {}}),
                      json.dumps({"custom_id": "get", "method": "GET", "url": URL, "body": {}}),
                      json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
                      request_line("who", model="gpt-9"), request_line("stream", stream=True), ""]).encode()
    lines, errors = parse_lines(data, URL, lambda model: model is None, BatchLimits())
    assert len(lines) == 9 and lines[0].request is not None and 0 not in errors
    codes = {index: (e["custom_id"], e["error"]["code"]) for index, e in errors.items()}
    assert codes == {1: (None, "invalid_json"), 2: (None, "invalid_request"), 3: ("ok", "duplicate_custom_id"),
                     4: (None, "missing_required_parameter"), 5: ("get", "invalid_method"),
                     6: ("chat", "invalid_url"), 7: ("who", "model_not_found"), 8: ("stream", "invalid_request")}
    assert all(e["response"] is None and e["id"].startswith("batch_req_") for e in errors.values())
    with pytest.raises(ThreefoldError, match="3 lines, over the limit of 2"):
        parse_lines(b"{}\n\n{}\n{}\n", URL, lambda m: True, BatchLimits(max_lines=2))
    with pytest.raises(ThreefoldError, match="purpose 'batch'"):
        check_upload("fine-tune", 10, BatchLimits())
    with pytest.raises(ThreefoldError, match="over the 5-byte limit"):
        check_upload("batch", 6, BatchLimits(max_file_bytes=5))
    with pytest.raises(ThreefoldError, match="completion_window '48h'"):
        check_batch_request(URL, "48h", "batch")
    with pytest.raises(ThreefoldError, match="endpoint '/v1/embeddings'"):
        check_batch_request("/v1/embeddings", "24h", "batch")


def test_runner_bounds_tokens_in_flight_and_retries(tmp_path) -> None:
    store = BatchStore(tmp_path)
    batch = make_batch(store, *(request_line(f"id-{i}", max_tokens=40) for i in range(6)), "{broken")
    live, peak, refused = set(), [0], {"id-2"}

    async def execute(url: str, body: dict) -> Execution:
        live.add(body["prompt"])
        peak[0] = max(peak[0], len(live))
        await asyncio.sleep(0.005)
        live.discard(body["prompt"])
        if body["prompt"] in refused:
            refused.remove(body["prompt"])  # the first answer is "not now": the line stays pending, runs again
            raise Retry("busy")
        return Execution(200, "req", {"ok": True})

    runner = runner_for(store, execute, max_inflight_tokens=100)  # 40 tokens a line: two at a time
    done = asyncio.run(runner.process(batch.id))
    assert done.status == "completed" and peak[0] == 2 and not refused
    assert done.request_counts == {"total": 7, "completed": 6, "failed": 1}
    output = [json.loads(t) for t in store.file_content(done.output_file_id).decode().splitlines()]
    assert [o["custom_id"] for o in output] == [f"id-{i}" for i in range(6)]
    assert output[0]["response"] == {"status_code": 200, "request_id": "req", "body": {"ok": True}}
    errors = store.file_content(done.error_file_id).decode().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["error"]["code"] == "invalid_json"
    assert runner.num_inflight_lines == 0 == runner.num_inflight_tokens


def test_cancel_keeps_finished_lines_and_runs_no_more(tmp_path) -> None:
    store = BatchStore(tmp_path)
    batch = make_batch(store, *(request_line(f"id-{i}") for i in range(20)))
    started = []

    async def execute(url: str, body: dict) -> Execution:
        started.append(body)
        if len(started) == 3:
            store.cancel_batch(batch.id)
        return Execution(200, "req", {})

    done = asyncio.run(runner_for(store, execute, max_inflight_lines=1).process(batch.id))
    assert done.status == "cancelled" and done.timestamps["cancelling_at"] and done.timestamps["cancelled_at"]
    assert done.request_counts["completed"] == len(started) == 3  # the line that asked to cancel finished
    assert len(store.file_content(done.output_file_id).decode().splitlines()) == 3
    assert store.cancel_batch(batch.id).status == "cancelled"  # cancelling again changes nothing
    store.set_status(batch.id, "completed")
    with pytest.raises(ThreefoldError, match="already completed"):
        store.cancel_batch(batch.id)
