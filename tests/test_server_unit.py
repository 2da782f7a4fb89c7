"""Server and AsyncEngine behaviour that needs no model: a scripted fake engine behind a real uvicorn.

The fake generates one character per step ("a", "b", "c", ...) and can be told
to die, so loop death, exact metric counts and overload are deterministic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import httpx
import openai
import pytest

from threefold.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from threefold.engine.llm_engine import EngineStats
from threefold.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from threefold.errors import ContextLengthError, ThreefoldError
from threefold.sample.params import SamplingParams

from server_harness import ServerThread
from server_helpers import metrics, wait_for


class CharTokenizer:
    """One token per character (ids are code points below 256)."""

    vocab_size = 256
    hf = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)


class FakeEngine:
    """LLMEngine's interface, scripted: `max_running` run at once, one token each per step."""

    model_name = "fake"
    max_model_len = 64
    generation_defaults: ClassVar[dict] = {}
    eos_token_ids: ClassVar[list[int]] = []
    vocab_size = 256

    def __init__(self, max_running: int = 8, step_delay_s: float = 0.01) -> None:
        self.tokenizer = CharTokenizer()
        self.max_running = max_running
        self.step_delay_s = step_delay_s
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.aborted: list[str] = []
        self.die = threading.Event()

    def add_request(self, request_id, prompt, params: SamplingParams, priority=0, arrival_time=None,
                    output_kind=RequestOutputKind.DELTA, request_class="online") -> None:
        assert output_kind is RequestOutputKind.DELTA  # what the async engine asks for
        max_tokens = params.max_tokens or self.max_model_len - len(prompt)
        if len(prompt) + max_tokens > self.max_model_len:
            raise ContextLengthError(f"This model's maximum context length is {self.max_model_len} tokens.",
                                     param="max_tokens")
        self.waiting.append(_FakeRequest(request_id, list(prompt), max_tokens, arrival_time or time.time()))

    def step(self) -> list[RequestOutput]:
        if self.die.is_set():
            raise RuntimeError("injected engine failure")
        time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        outputs = []
        for req in list(self.running):
            req.token_ids.append(ord("a") + len(req.token_ids) % 26)
            done = len(req.token_ids) >= req.max_tokens
            if done:
                self.running.remove(req)
            completion = CompletionOutput(0, chr(req.token_ids[-1]), req.token_ids[-1:], None, None,
                                          finish_reason="length" if done else None)  # a delta
            outputs.append(RequestOutput(req.request_id, None, req.prompt_ids, None, [completion], done,
                                         metrics=RequestMetrics(req.arrival_time)))
        return outputs

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            self.waiting = [r for r in self.waiting if r.request_id != rid]
            self.running = [r for r in self.running if r.request_id != rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), len(self.running) / 10, 0, 0, 0)





def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_metrics_count_tokens_and_latencies_exactly() -> None:
    with ServerThread(FakeEngine()) as server:
        result = _client(server.url).completions.create(model="fake", prompt="abcd", max_tokens=3)
        assert result.choices[0].text == "abc"
        assert result.usage.prompt_tokens == 4 and result.usage.completion_tokens == 3
        m = metrics(server.url)
    assert m["vllm:prompt_tokens_total"] == 4
    assert m["vllm:generation_tokens_total"] == 3
    assert m["vllm:request_success_total{finished_reason=length}"] == 1
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:inter_token_latency_seconds_count"] == 2  # 3 tokens, 2 gaps
    assert m["vllm:e2e_request_latency_seconds_count"] == 1
    assert m["vllm:e2e_request_latency_seconds_bucket{le=0.3}"] == 1  # vLLM's first request-latency bucket
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


def test_dead_engine_loop_fails_requests_and_health() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    with ServerThread(engine) as server:
        client = _client(server.url)
        assert httpx.get(f"{server.url}/health").status_code == 200
        stream = client.completions.create(model="fake", prompt="x", max_tokens=50, stream=True)
        first = next(iter(stream))
        assert first.choices[0].text == "a"
        engine.die.set()
        with pytest.raises(openai.APIError, match="engine loop died"):
            for _ in stream:
                pass
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "injected engine failure" in health.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="fake", prompt="x", max_tokens=2)
        assert err.value.status_code == 503


def test_overload_rejects_with_retry_after() -> None:
    engine = FakeEngine(max_running=1, step_delay_s=0.05)
    with ServerThread(engine, max_queued_requests=1) as server:
        client = _client(server.url)
        running = client.completions.create(model="fake", prompt="r", max_tokens=60, stream=True)
        next(iter(running))
        waiting = client.completions.create(model="fake", prompt="w", max_tokens=60, stream=True)
        wait_for(lambda: server.state.engine.num_waiting == 1)
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert time.monotonic() - started < 1.0
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert "overloaded" in response.json()["error"]["message"]
        running.close()
        waiting.close()
        wait_for(lambda: not engine.has_unfinished_requests())
        assert len(engine.aborted) == 2


def test_closed_stream_aborts_its_engine_request() -> None:
    engine = FakeEngine(step_delay_s=0.02)
    with ServerThread(engine) as server:
        stream = _client(server.url).completions.create(model="fake", prompt="x", max_tokens=60, stream=True)
        next(iter(stream))
        stream.close()
        wait_for(lambda: not engine.has_unfinished_requests())
        assert len(engine.aborted) == 1
        wait_for(lambda: metrics(server.url)["vllm:num_requests_running"] == 0)
        assert metrics(server.url)["vllm:request_success_total{finished_reason=abort}"] == 1


def test_engine_rejection_is_a_400_and_leaks_nothing() -> None:
    engine = FakeEngine()
    with ServerThread(engine) as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 100})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "max_tokens"
        assert not engine.has_unfinished_requests() and server.state.engine.num_waiting == 0


def test_request_stream_merges_deltas_a_slow_consumer_missed() -> None:
    async def scenario() -> list[str]:
        stream = RequestStream("r", asyncio.get_running_loop())
        for text, done in (("a", False), ("b", False), ("c", True)):
            completion = CompletionOutput(0, text, [0] * len(text), None, None, "length" if done else None)
            stream.put(RequestOutput("r", None, [1], None, [completion], done))
        await asyncio.sleep(0)  # let call_soon_threadsafe deliver
        return [o.outputs[0].text async for o in stream]

    assert asyncio.run(scenario()) == ["abc"]


def test_async_engine_reports_its_death_to_new_callers() -> None:
    engine = FakeEngine()
    engine.die.set()
    async_engine = AsyncEngine(engine).start()

    async def scenario() -> None:
        stream = await async_engine.add_request("r", [1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("s", [1], SamplingParams(max_tokens=1))

    asyncio.run(scenario())
    assert not async_engine.is_healthy
    assert isinstance(EngineDeadError("x"), ThreefoldError) and EngineDeadError("x").status_code == 503


def test_replicas_racing_for_the_default_batch_dir_all_serve(tmp_path) -> None:
    """`threefold cluster` starts replicas together: the default batch dir goes to one of them and the
    others serve without a Batch API; a batch dir the user named stays an error."""
    from threefold.server.serving_batch import _lock_dir

    holder = _lock_dir(tmp_path)  # another server holds the dir
    try:
        with ServerThread(FakeEngine(), batch_dir=str(tmp_path), batch_dir_is_default=True) as server:
            assert server.state.batch is None
            assert _client(server.url).completions.create(model="fake", prompt="ab", max_tokens=1).choices
        with pytest.raises(ThreefoldError, match="in use by another server"):
            ServerThread(FakeEngine(), batch_dir=str(tmp_path))
    finally:
        holder.close()
