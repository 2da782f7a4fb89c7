"""`python -m threefold.server.cli` as a real subprocess: API key, served names, overload, SIGTERM drain.

One server for the module, started with one running sequence at a time and a
queue limit of one so overload is easy to reach; the SIGTERM test ends it, so
it runs last.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerProcess
from server_helpers import wait_for

KEY = "sk-test-123"
NAMES = ("tiny-chat", "smollm2")
ARGS = ["--model", "smollm2-135m", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
        "--max-num-seqs", "1", "--max-queued-requests", "1", "--shutdown-timeout", "4",
        "--api-key", KEY, "--served-model-name", *NAMES]
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with ServerProcess(ARGS, tmp_path_factory.mktemp("serve") / "server.log") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def gauge(server: ServerProcess, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        if family.name == name:
            return family.samples[0].value
    raise KeyError(name)





def test_api_key_is_required_on_v1(server: ServerProcess, client: openai.OpenAI) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert "API key" in response.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_served_model_names(client: openai.OpenAI) -> None:
    result = client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert result.model == "tiny-chat"
    with pytest.raises(openai.NotFoundError, match="smollm2-135m"):
        client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)


def test_overload_gets_503_with_retry_after(server: ServerProcess, client: openai.OpenAI) -> None:
    running = client.completions.create(model=NAMES[0], prompt="One", stream=True, **LONG)
    next(iter(running))
    waiting = client.completions.create(model=NAMES[0], prompt="Two", stream=True, **LONG)
    wait_for(lambda: gauge(server, "vllm:num_requests_waiting") == 1)
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": NAMES[0], "prompt": "Three", "max_tokens": 2})
    assert time.monotonic() - started < 2.0
    assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
    assert "overloaded" in response.json()["error"]["message"]
    running.close()
    waiting.close()
    wait_for(lambda: gauge(server, "vllm:num_requests_running") == 0 == gauge(server, "vllm:num_requests_waiting"))


def test_sigterm_drains_then_exits_zero(server: ServerProcess, client: openai.OpenAI) -> None:
    short = client.completions.create(model=NAMES[0], prompt="Short", max_tokens=8, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    short_chunks = iter(short)
    first = next(short_chunks)
    long = client.completions.create(model=NAMES[0], prompt="Long", stream=True, **LONG)  # waits behind `short`
    results: dict[str, list] = {}

    def consume(name: str, chunks) -> None:
        results[name] = list(chunks)

    readers = [threading.Thread(target=consume, args=("short", short_chunks)),
               threading.Thread(target=consume, args=("long", iter(long)))]
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 5)
    refused = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": NAMES[0], "prompt": "Late", "max_tokens": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(60)

    # The in-flight request that could finish did, in full.
    short_text = [first] + results["short"]
    assert [c.choices[0].finish_reason for c in short_text if c.choices][-1] == "length"
    assert short_text[-1].usage.completion_tokens == 8
    # The one still running at --shutdown-timeout was aborted, and its stream ended cleanly.
    assert results["long"][-1].choices[0].finish_reason == "abort"
    assert server.process.wait(30) == 0
    assert 3.5 < time.monotonic() - signalled < 25
    assert "draining" in server.log()
