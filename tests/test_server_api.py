"""The OpenAI-compatible API on the real SmolLM2-135M, driven with the official `openai` client.

One in-process server (uvicorn thread) for the module; float32 for determinism,
small max_tokens for speed. Failure cases assert status code and message.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.sample.params import SamplingParams
from threefold.server import serving_completions

from server_harness import ServerThread
from server_helpers import metrics, wait_for

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 2048
# A 512-token budget: the long prompt of test_disconnect_before_first_token_aborts takes
# several prefill steps, so the disconnect lands before its first token.
ENGINE_ARGS = EngineArgs(model=MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 << 20,
                         max_num_batched_tokens=512)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_args(ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(engine: LLMEngine):
    with ServerThread(engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)





def idle(url: str) -> bool:
    m = metrics(url)
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


def post(server: ServerThread, path: str, body: dict | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def assert_error(response: httpx.Response, status: int, param: str | None, *fragments: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


# ---- the happy paths -------------------------------------------------------


def test_models_version_health(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and "Paris" in choice.text
    assert whole.usage.prompt_tokens == 5 and whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == 13
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_gives_two_indexed_choices(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=["Once upon", "Hello"], n=2, max_tokens=4,
                                           temperature=1.0, seed=7)
    assert sorted(c.index for c in completion.choices) == [0, 1, 2, 3]
    assert completion.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=7, stream=True)
    texts = {0: "", 1: ""}
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts.values())


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    reference = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = reference[reference.index("Paris") + 2:reference.index("Paris") + 4]  # "ri", inside a token
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                           stream=stream)
        choices = [c.choices[0] for c in result] if stream else result.choices
        text = "".join(c.text for c in choices)
        assert text == reference[:reference.index(stop)]
        assert choices[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=10,
                                         temperature=1.0, top_p=0.95, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy picks the top token
        assert top[token] == pytest.approx(logprob, abs=1e-6)
    assert logprobs.text_offset == [0] + [sum(map(len, logprobs.tokens[:i])) for i in range(1, 4)]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())


def test_usage_reports_prefix_cache_hits(client: openai.OpenAI) -> None:
    prompt = " ".join(f"item{i}" for i in range(40))  # well over two 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_prompt_forms_and_echo_with_zero_max_tokens(engine: LLMEngine, client: openai.OpenAI) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == PROMPT and echoed.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None


def test_echo_logprobs_equal_offline_prompt_logprobs(engine: LLMEngine, client: openai.OpenAI) -> None:
    """What lm-eval's local-completions sends (token ids, echo, logprobs=1, max_tokens=1)."""
    ids = engine.tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks.")
    served = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                       logprobs=1).choices[0].logprobs
    # The offline API over the same weights (a second engine; the server's stays untouched).
    offline = LLM.from_engine(LLMEngine(engine.loaded, ENGINE_ARGS)).generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    assert len(served.token_logprobs) == len(ids) + 1 and served.token_logprobs[0] is None
    assert offline[0] is None
    expected = [offline[i][ids[i]].logprob for i in range(1, len(ids))]
    assert served.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)


def test_tokenize_detokenize_and_tokenizer_info(server: ServerThread, engine: LLMEngine) -> None:
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert tokens["tokens"] == engine.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN and len(tokens["token_strs"]) == tokens["count"]
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] and "{%" in info["chat_template"]


def test_unknown_fields_are_ignored(server: ServerThread) -> None:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                "user": "u", "logit_bias": {}, "some_future_field": [1, 2]})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


# ---- failures ----------------------------------------------------------------


def test_context_overflow_is_400_with_vllms_wording(server: ServerThread) -> None:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN})
    assert_error(response, 400, "max_tokens", f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                 f"However, you requested {MAX_MODEL_LEN + 5} tokens (5 in the messages, {MAX_MODEL_LEN} in the "
                 f"completion).")
    too_long = [1] * (MAX_MODEL_LEN + 1)
    assert_error(post(server, "/v1/completions", {"prompt": too_long}), 400, "messages",
                 f"maximum context length is {MAX_MODEL_LEN} tokens")


@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", -1.0, "temperature must be non-negative"),
    ("top_p", 2.0, "top_p must be in (0, 1]"),
    ("n", 0, "n must be at least 1"),
    ("max_tokens", -3, "max_tokens must be at least 1"),
    ("temperature", "hot", "valid number"),
    ("stop_token_ids", "x", "valid list"),
    ("logprobs", 50, "logprobs must be in [0, 20]"),
])
def test_invalid_parameter_is_400_naming_it(server: ServerThread, field: str, value, fragment: str) -> None:
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", field: value})
    assert_error(response, 400, field, fragment)


def test_other_bad_requests(server: ServerThread) -> None:
    assert_error(post(server, "/v1/completions", b'{"prompt": "Hi", '), 400, None, "Malformed JSON")
    assert_error(post(server, "/v1/completions", {"prompt": "Hi", "suffix": "!"}), 400, "suffix", "not supported")
    assert_error(post(server, "/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}),
                 400, "stream_options", "stream=True")
    assert_error(post(server, "/v1/completions", {"prompt": [10**6]}), 400, "prompt", "out of vocabulary")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2}), 400, "top_logprobs", "logprobs")
    assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}), 404, "model",
                 "The model `gpt-4` does not exist.")


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-2)


# ---- disconnects and per-request failures -------------------------------------


def _aborts(server: ServerThread) -> float:
    return metrics(server.url).get("vllm:request_success_total{finished_reason=abort}", 0.0)


def test_disconnect_mid_stream_aborts(server: ServerThread, client: openai.OpenAI) -> None:
    before = _aborts(server)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert metrics(server.url)["vllm:num_requests_running"] == 1
    stream.close()
    wait_for(lambda: idle(server.url))
    assert _aborts(server) == before + 1


def test_disconnect_before_first_token_aborts(server: ServerThread, engine: LLMEngine) -> None:
    before, generated = _aborts(server), metrics(server.url)["vllm:generation_tokens_total"]
    prompt = engine.tokenizer.encode(" lorem ipsum dolor" * 400)[:1800]  # a long, chunked prefill
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: server.state.engine.stats.num_running + server.state.engine.stats.num_waiting > 0, 10)
    wait_for(lambda: idle(server.url))
    assert _aborts(server) == before + 1
    assert metrics(server.url)["vllm:generation_tokens_total"] == generated  # aborted during its prefill
    assert metrics(server.url)["vllm:kv_cache_usage_perc"] == 0.0


def test_disconnect_of_non_streaming_request_aborts(server: ServerThread) -> None:
    before = _aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=1.5,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True})
    wait_for(lambda: idle(server.url))
    assert _aborts(server) == before + 1


def test_a_failing_request_fails_alone(server: ServerThread, client: openai.OpenAI, engine: LLMEngine,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    poison = engine.tokenizer.encode("poisoned request")
    real_apply = engine.processor.apply
    real_delta = serving_completions._delta_choice

    def apply(state, completion, out):
        if state.prompt_token_ids == poison:
            raise RuntimeError("injected output failure")
        return real_apply(state, completion, out)

    def delta(state, plan, prompt_index, output, completion, cursor):
        if output.prompt_token_ids == poison[:-1]:
            raise RuntimeError("injected formatting failure")
        return real_delta(state, plan, prompt_index, output, completion, cursor)

    monkeypatch.setattr(engine.processor, "apply", apply)
    monkeypatch.setattr(serving_completions, "_delta_choice", delta)

    async def scenario() -> tuple:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        healthy = aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        failing = aclient.completions.create(model=MODEL, prompt=poison, max_tokens=6, temperature=0)

        async def failing_stream():
            async for _ in await aclient.completions.create(model=MODEL, prompt=poison[:-1], max_tokens=500,
                                                            stream=True, extra_body={"ignore_eos": True}):
                pass

        return await asyncio.gather(healthy, failing, failing_stream(), return_exceptions=True)

    healthy, failing, streamed = asyncio.run(scenario())
    assert healthy.choices[0].finish_reason == "length" and "Paris" in healthy.choices[0].text
    assert isinstance(failing, openai.InternalServerError) and "injected output failure" in str(failing)
    assert isinstance(streamed, openai.APIError) and "injected formatting failure" in str(streamed)
    wait_for(lambda: idle(server.url))  # both failed requests were aborted: their blocks are free
    assert metrics(server.url)["vllm:kv_cache_usage_perc"] == 0.0
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


# ---- load --------------------------------------------------------------------


def test_64_concurrent_streams(server: ServerThread, client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn"]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in prompts}
    before = metrics(server.url)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        text, finish, used = "", None, None
        async for chunk in await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                            stream=True, stream_options={"include_usage": True},
                                                            extra_body={"ignore_eos": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def scenario() -> tuple[list, float]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        peak = 0.0
        done = False

        async def watch() -> None:
            nonlocal peak
            async with httpx.AsyncClient() as http:
                while not done:
                    for family in text_string_to_metric_families((await http.get(f"{server.url}/metrics")).text):
                        if family.name == "vllm:num_requests_running":
                            peak = max(peak, family.samples[0].value)
                    await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(64)))
        done = True
        await watcher
        return results, peak

    results, peak = asyncio.run(scenario())
    for i, (text, finish, used) in enumerate(results):
        assert text == expected[prompts[i % 4]] and finish == "length" and used == 8
    assert peak > 1, "the engine never batched concurrent requests"
    wait_for(lambda: idle(server.url), 5)
    after = metrics(server.url)
    assert after["vllm:kv_cache_usage_perc"] == 0.0  # cached prefix blocks count as free, as in vLLM
    assert after["vllm:request_success_total{finished_reason=length}"] - \
        before["vllm:request_success_total{finished_reason=length}"] == 64
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 64 * 8
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 64
    assert after["vllm:prefix_cache_queries_total"] > 0
