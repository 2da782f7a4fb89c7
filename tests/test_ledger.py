"""The savings ledger: arithmetic on hand-built entries, then one real server (SmolLM2, int8 KV, ngram
speculation, prefix caching) whose per-request entries, /v1/ledger totals and /metrics are checked
against the engine's own counts, the codec's bytes and the OpenAI client."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from threefold.errors import ThreefoldError
from threefold.ledger import CostBasis, Ledger, make_entry, parse_window
from threefold.server.config import ServerConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
REPEATING = "one two three four, one two three four, one two three four, one two three four, one two"


def linear(n: float) -> float:
    return 0.01 + 0.001 * n  # seconds: a fixed step cost plus a per-token one


def basis(*techniques: str) -> CostBasis:
    return CostBasis(linear, kv_bytes_per_token=100.0, dtype_bytes_per_token=400.0, kv_cache_dtype="int8",
                     techniques=techniques)


def test_entry_arithmetic():
    entry = make_entry(basis("prefix_cache", "speculation", "kv_codec"), prompt_tokens=40, output_tokens=10,
                       cached_tokens=32, draft_tokens=8, accepted_tokens=4)
    assert (entry.prompt_tokens_computed, entry.output_tokens_from_drafts, entry.draft_tokens_rejected) == (8, 4, 4)
    assert entry.kv_bytes == 50 * 100.0 and entry.kv_bytes_at_dtype == 50 * 400.0
    steps = 10 - 4  # target forwards; each carried 8 / 6 drafts on average
    assert entry.compute_s == pytest.approx(linear(8) + steps * linear(1 + 8 / 6))
    assert entry.saved_s["prefix_cache"] == pytest.approx(linear(40) - linear(8))
    assert entry.saved_s["speculation"] == pytest.approx(4 * linear(1) - steps * (linear(1 + 8 / 6) - linear(1)))
    assert "kv_tier:disk" not in entry.saved_s and entry.prompt_tokens_by_tier is None
    assert "tiers" not in entry.to_dict()["prompt_tokens"]


def test_tiers_and_absent_techniques():
    entry = make_entry(basis(), 64, 1, cached_tokens=16, draft_tokens=0, accepted_tokens=0,
                       tier_tokens={"cpu": 32})
    assert entry.prompt_tokens_computed == 16
    assert set(entry.saved_s) == {"kv_tier:cpu"}  # prefix caching off here: absent, not zero
    assert entry.saved_s["kv_tier:cpu"] == pytest.approx(linear(64) - linear(32))  # on top of computed + L1
    ledger = Ledger(basis())
    assert ledger.techniques == ()
    ledger.add(dataclasses.replace(entry, finished_time=1000.0))
    assert ledger.techniques == ("kv_tier:cpu",)
    assert ledger.totals(60, now=1010.0)["by_technique"]["kv_tier:cpu"]["prompt_tokens"] == 32


def test_ledger_window_money_and_bad_input():
    ledger = Ledger(basis("prefix_cache"), cost_per_hour=3.6, capacity=3)
    for t in range(4):  # the first falls out of the ring buffer
        ledger.add(make_entry(ledger.basis, 20, 10, 16, 0, 0, finished_time=100.0 + t))
    totals = ledger.totals(2.5, now=103.0)
    assert totals["num_requests"] == 3 and totals["tokens"]["output"] == 30
    per_m = totals["cost_per_million_tokens"]["output_tokens"]
    assert per_m == pytest.approx(3.6 / 3600 * totals["compute_s"] * 1e6 / 30)
    row = totals["by_technique"]["prefix_cache"]
    assert row["cost_per_million_tokens_without"]["output_tokens"] > per_m
    with pytest.raises(ThreefoldError, match="unknown technique 'speculation'"):
        ledger.totals(10, "speculation")
    for bad in ("abc", "-1", "0", "nan", "1e9"):
        with pytest.raises(ThreefoldError, match="window"):
            parse_window(bad)
    for price in (-1.0, float("inf")):
        with pytest.raises(ThreefoldError, match="cost_per_hour"):
            ServerConfig(served_model_names=("m",), cost_per_hour=price)


def test_cli_rejects_a_malformed_price(capsys):
    import argparse

    from threefold.server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--cost-per-hour", "0.50"]).cost_per_hour == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--cost-per-hour", "fifty cents"])
    assert "expected a price per hour" in capsys.readouterr().err


# ---- one real server ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    from server_harness import ServerThread

    engine = LLMEngine(smollm2_fp32, EngineArgs(dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
                                                kv_cache_dtype="int8", speculative_config=NGRAM))
    with ServerThread(engine, cost_per_hour=0.5) as server:
        yield server


def set_usage_ledger(server, on: bool) -> None:
    server.state.config = dataclasses.replace(server.state.config, usage_ledger=on)


def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ledger_totals(server, **params) -> dict:
    response = httpx.get(f"{server.url}/v1/ledger", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_usage_extension_is_opt_in_and_parses(server):
    model = server.state.config.model_name
    set_usage_ledger(server, False)
    plain = client(server).completions.create(model=model, prompt="Hello", max_tokens=4)
    assert plain.usage.model_extra == {}  # nothing beyond OpenAI's usage fields by default
    set_usage_ledger(server, True)
    try:
        completion = client(server).completions.create(model=model, prompt=["Hello", "Bye"], max_tokens=4)
        chat = client(server).chat.completions.create(model=model, max_tokens=4,
                                                      messages=[{"role": "user", "content": "Hi"}])
        chunks = list(client(server).chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}], stream=True,
            stream_options={"include_usage": True}))
    finally:
        set_usage_ledger(server, False)
    assert completion.usage.model_extra["threefold_ledger"]["output_tokens"]["total"] == 8
    assert completion.usage.model_extra["threefold_ledger"]["prompt_tokens"]["total"] == \
        completion.usage.prompt_tokens
    streamed = chunks[-1].usage.model_extra["threefold_ledger"]
    # The stream repeats the chat's prompt: same totals (its prefix may now come from the cache).
    assert streamed["prompt_tokens"]["total"] == chat.usage.model_extra["threefold_ledger"]["prompt_tokens"]["total"]
    assert streamed["prompt_tokens"]["prefix_cache"] == chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_repeat_speculation_bytes_and_totals(server):
    from threefold.kv.capacity import capacity_rows

    from server_helpers import metrics, wait_for

    model = server.state.config.model_name
    set_usage_ledger(server, True)
    before_total = ledger_totals(server)
    try:
        first = client(server).completions.create(model=model, prompt=REPEATING, max_tokens=16, temperature=0)
        accepted_before = metrics(server.url)["vllm:spec_decode_num_accepted_tokens_total"]
        second = client(server).completions.create(model=model, prompt=REPEATING, max_tokens=16, temperature=0)
        accepted = metrics(server.url)["vllm:spec_decode_num_accepted_tokens_total"] - accepted_before
    finally:
        set_usage_ledger(server, False)
    entries = [r.usage.model_extra["threefold_ledger"] for r in (first, second)]
    prompt_len = first.usage.prompt_tokens
    # The repeat hits every full block of the prompt but the one holding its last token (recomputed for logits).
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // 16 * 16 > 0
    assert entries[1]["prompt_tokens"]["prefix_cache"] == second.usage.prompt_tokens_details.cached_tokens
    assert entries[1]["prompt_tokens"]["computed"] == prompt_len - entries[1]["prompt_tokens"]["prefix_cache"]
    # Accepted drafts: the decoder's own count for this request (it ran alone).
    assert entries[1]["output_tokens"]["from_accepted_drafts"] == accepted > 0
    assert entries[1]["time"]["saved_s"]["prefix_cache"] > 0
    # Bytes: the codec's real bytes per token, int8 against the model dtype, from `threefold info`'s table.
    runner = server.state.engine.engine.core.runner
    rows = {r["kv_cache_dtype"]: r["bytes_per_token"] for r in capacity_rows(runner.config, 1 << 20, 16,
                                                                           ("auto", "int8"))}
    tokens = prompt_len + 16
    assert entries[1]["kv"] == {"bytes": tokens * rows["int8"], "bytes_at_model_dtype": tokens * rows["auto"]}
    # /v1/ledger: these two entries are exactly what the totals grew by.
    wait_for(lambda: ledger_totals(server)["num_requests"] == before_total["num_requests"] + 2)
    after = ledger_totals(server)
    for key, field in (("prompt_prefix_cache", ("prompt_tokens", "prefix_cache")),
                       ("output_from_accepted_drafts", ("output_tokens", "from_accepted_drafts")),
                       ("drafts_rejected", ("output_tokens", "drafts_rejected"))):
        grown = after["tokens"][key] - before_total["tokens"][key]
        assert grown == sum(e[field[0]][field[1]] for e in entries)
    assert after["compute_s"] - before_total["compute_s"] == pytest.approx(
        sum(e["time"]["compute_s"] for e in entries))
    assert set(after["by_technique"]) == {"prefix_cache", "speculation", "kv_codec"}
    assert after["cost_per_million_tokens"]["output_tokens"] > 0
    m = metrics(server.url)
    assert m["threefold:ledger_requests_total"] == after["num_requests"]
    assert m["threefold:ledger_prompt_tokens_total{source=prefix_cache}"] == after["tokens"]["prompt_prefix_cache"]


@pytest.mark.parametrize("query, message", [("window=abc", "window must be a number"),
                                            ("window=-5", "window must be in"),
                                            ("technique=magic", "unknown technique 'magic'")])
def test_ledger_bad_input_is_a_400(server, query, message):
    response = httpx.get(f"{server.url}/v1/ledger?{query}")
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
