"""The Batch API on the real SmolLM2-135M, driven with the official `openai` client.

One in-process server with a batch dir for the module. Batch outputs must
equal the same requests sent online (greedy, float32). The restart test runs
the server as a subprocess and SIGKILLs it mid-batch.
"""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time

import httpx
import openai
import pytest

from threefold.cli import main as threefold_main
from threefold.engine.llm_engine import EngineArgs, LLMEngine

from server_harness import ServerProcess, ServerThread
from server_helpers import metrics, wait_for

MODEL = "smollm2-135m"
ENGINE_ARGS = EngineArgs(model=MODEL, dtype="float32", max_model_len=1024, kv_cache_memory=128 << 20)
GREEDY = {"temperature": 0.0, "max_tokens": 8}
CHAT_BODIES = {"chat-a": {"messages": [{"role": "user", "content": "Name a colour."}], **GREEDY},
               "chat-b": {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], **GREEDY}}
COMPLETION_BODIES = {"cmpl-a": {"prompt": "The capital of France is", **GREEDY},
                     "cmpl-b": {"model": MODEL, "prompt": "1, 2, 3,", "n": 2, **GREEDY}}


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    engine = LLMEngine.from_args(ENGINE_ARGS)
    with ServerThread(engine, batch_dir=str(tmp_path_factory.mktemp("batches"))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def upload(client: openai.OpenAI, data: bytes, purpose: str = "batch"):
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)  # type: ignore[arg-type]


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(t) for t in client.files.content(file_id).text.splitlines()] if file_id else []


def same_answer(batch_body: dict, online_body: dict) -> None:
    """Equal but for what differs per call (id, created, and the prefix cache's hits)."""
    for key in ("object", "model", "choices"):
        assert batch_body[key] == online_body[key], key
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch_body["usage"][key] == online_body["usage"][key], key


def test_batches_equal_online_requests(client: openai.OpenAI, server: ServerThread) -> None:
    chat_file = upload(client, jsonl(*(line(k, "/v1/chat/completions", b) for k, b in CHAT_BODIES.items()),
                                     '{"custom_id": "broken", "method": "POST", "url": ',
                                     line("chat-a", "/v1/chat/completions", CHAT_BODIES["chat-a"]),
                                     line("wrong-url", "/v1/completions", COMPLETION_BODIES["cmpl-a"]),
                                     line("no-model", "/v1/chat/completions", {**CHAT_BODIES["chat-a"],
                                                                               "model": "gpt-9"}),
                                     line("bad-value", "/v1/chat/completions", {**CHAT_BODIES["chat-a"],
                                                                                "temperature": -1})))
    assert chat_file.purpose == "batch" and chat_file.bytes > 0
    cmpl_file = upload(client, jsonl(*(line(k, "/v1/completions", b) for k, b in COMPLETION_BODIES.items())))
    chat = client.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"job": "colours"})
    cmpl = client.batches.create(input_file_id=cmpl_file.id, endpoint="/v1/completions", completion_window="24h")
    assert chat.status == "validating" and chat.metadata == {"job": "colours"}

    chat, cmpl = wait_done(client, chat.id), wait_done(client, cmpl.id)
    assert chat.status == cmpl.status == "completed"
    assert (chat.request_counts.total, chat.request_counts.completed, chat.request_counts.failed) == (7, 2, 5)
    assert (cmpl.request_counts.total, cmpl.request_counts.completed, cmpl.request_counts.failed) == (2, 2, 0)
    assert cmpl.error_file_id is None and chat.completed_at >= chat.in_progress_at >= chat.created_at

    outputs = read_lines(client, chat.output_file_id) + read_lines(client, cmpl.output_file_id)
    assert [o["custom_id"] for o in outputs] == ["chat-a", "chat-b", "cmpl-a", "cmpl-b"]
    for output in outputs:
        assert set(output) == {"id", "custom_id", "response", "error"} and output["error"] is None
        response = output["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        url, body = (("/v1/chat/completions", CHAT_BODIES) if output["custom_id"].startswith("chat")
                     else ("/v1/completions", COMPLETION_BODIES))
        online = httpx.post(f"{server.url}{url}", json=body[output["custom_id"]], timeout=60).json()
        same_answer(response["body"], online)

    errors = {e["custom_id"]: e for e in read_lines(client, chat.error_file_id)}
    assert list(errors) == [None, "chat-a", "wrong-url", "no-model", "bad-value"]  # input order
    for custom_id, code in ((None, "invalid_json"), ("chat-a", "duplicate_custom_id"),
                            ("wrong-url", "invalid_url"), ("no-model", "model_not_found")):
        assert errors[custom_id]["response"] is None and errors[custom_id]["error"]["code"] == code
    rejected = errors["bad-value"]["response"]  # ran, and the handler answered 400 as it does online
    assert rejected["status_code"] == 400 and "temperature" in rejected["body"]["error"]["message"]

    m = metrics(server.url)
    assert m["threefold:batch_lines_total{outcome=completed}"] >= 4
    assert m["threefold:batch_lines_total{outcome=failed}"] >= 5
    assert m["threefold:batch_queue_lines"] == 0 == m["threefold:batch_inflight_lines"]


def test_list_cancel_and_delete(client: openai.OpenAI, server: ServerThread) -> None:
    # One short line finishes first; the long ones are still running when the cancel comes.
    short = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0.0}
    long = {**short, "max_tokens": 400, "ignore_eos": True}
    data = jsonl(*(line(f"line-{i}", "/v1/completions", long if i else short) for i in range(40)))
    batch = client.batches.create(input_file_id=upload(client, data).id, endpoint="/v1/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    cancelled = wait_done(client, batch.id)
    assert cancelled.status == "cancelled"
    done = read_lines(client, cancelled.output_file_id)
    assert 1 <= len(done) == cancelled.request_counts.completed < 40  # finished lines stay in the output
    assert len({o["custom_id"] for o in done}) == len(done)
    wait_for(lambda: metrics(server.url)["vllm:num_requests_running"] == 0, 20)  # nothing left in the engine

    first_page = client.batches.list(limit=1)
    paged = [b.id for b in client.batches.list(limit=1)]  # iterating follows `after`, page by page
    assert first_page.data[0].id == paged[0] == batch.id and len(set(paged)) == len(paged)
    assert first_page.has_more == (len(paged) > 1)
    assert batch.input_file_id in [f.id for f in client.files.list().data]
    assert client.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError, match="No such file"):
        client.files.retrieve(batch.input_file_id)


def test_bad_input_gets_openai_errors(client: openai.OpenAI, server: ServerThread) -> None:
    good = upload(client, jsonl(line("x", "/v1/completions", COMPLETION_BODIES["cmpl-a"])))
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        upload(client, b"{}\n", purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="empty"):
        upload(client, b"")
    with pytest.raises(openai.NotFoundError, match="No such file: 'file-nope'"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window '1h'"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/embeddings'"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="No such batch"):
        client.batches.retrieve("batch_nope")
    finished = wait_done(client, client.batches.create(input_file_id=good.id, endpoint="/v1/completions",
                                                       completion_window="24h").id)
    with pytest.raises(openai.BadRequestError, match="already completed") as caught:
        client.batches.cancel(finished.id)
    assert caught.value.body["param"] == "batch_id"  # type: ignore[index]
    not_jsonl = client.batches.create(input_file_id=upload(client, b"\n\n  \n").id, endpoint="/v1/completions",
                                      completion_window="24h")
    failed = wait_done(client, not_jsonl.id)
    assert failed.status == "failed" and "no lines" in failed.errors.data[0].message


def test_batch_run_cli(tmp_path, server: ServerThread) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(line("one", "/v1/completions", COMPLETION_BODIES["cmpl-a"]),
                             '{"custom_id": "two", "method": "POST"',
                             line("three", "/v1/chat/completions", CHAT_BODIES["chat-a"])))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    code = threefold_main(["batch", "run", "-i", str(source), "-o", str(out), "--error-file", str(err),
                           "--model", MODEL, "--dtype", "float32", "--max-model-len", "1024",
                           "--kv-cache-memory", "64MiB"])
    assert code == 0
    outputs = [json.loads(t) for t in out.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["one", "three"]
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    online = httpx.post(f"{server.url}/v1/completions", json=COMPLETION_BODIES["cmpl-a"], timeout=60).json()
    same_answer(outputs[0]["response"]["body"], online)
    errors = [json.loads(t) for t in err.read_text().splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"
    assert threefold_main(["batch", "run", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2


def test_sigkill_mid_batch_then_restart_completes_every_line_once(tmp_path) -> None:
    batch_dir = tmp_path / "batches"
    args = ["--model", MODEL, "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
            "--batch-dir", str(batch_dir), "--batch-max-inflight-tokens", "1"]  # one line at a time
    body = {"prompt": "Write a story:", "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    data = jsonl(*(line(f"id-{i}", "/v1/completions", body) for i in range(5)))
    with ServerProcess(args, tmp_path / "first.log") as first:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="unused", max_retries=0, timeout=60)
        batch = client.batches.create(input_file_id=upload(client, data).id, endpoint="/v1/completions",
                                      completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120, 0.02)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
    before = finished_lines(batch_dir, batch.id)
    assert 2 <= len(before) < 5

    # The second start runs in this process (a subprocess start costs ~13 s here): same code path, same dir.
    with ServerThread(LLMEngine.from_args(ENGINE_ARGS), batch_dir=str(batch_dir)) as second:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = wait_done(client, batch.id)
        outputs = read_lines(client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 5 and done.error_file_id is None
    assert sorted(o["custom_id"] for o in outputs) == [f"id-{i}" for i in range(5)]
    # Lines finished before the kill were not run again: the same engine request produced them.
    again = {o["custom_id"]: o["response"]["request_id"] for o in outputs}
    assert all(again[custom_id] == request_id for custom_id, request_id in before.items())
    assert len({o["response"]["body"]["choices"][0]["text"] for o in outputs}) == 1  # greedy: all equal


def finished_lines(batch_dir, batch_id: str) -> dict[str, str]:
    """custom_id -> request_id of the lines the store holds as done (read straight from SQLite)."""
    with sqlite3.connect(batch_dir / "batch.db") as db:
        rows = db.execute("SELECT custom_id, result FROM lines WHERE batch_id = ? AND done = 1",
                          (batch_id,)).fetchall()
    return {custom_id: json.loads(result)["response"]["request_id"] for custom_id, result in rows}
