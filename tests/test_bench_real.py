"""`bench serve` against a real `threefold serve` on loopback, and `bench quality` on the real model."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch

from threefold.bench.quality import evaluate_quality, heldout_sequences
from threefold.bench.serve import add_serve_args, run_serve
from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine

from server_harness import ServerThread


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    engine = LLMEngine(smollm2_fp32, EngineArgs(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048))
    with ServerThread(engine) as running:
        yield running


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--base-url", url, "--model", "smollm2-135m", "--num-prompts", "6",
                              "--max-output-len", "12", "--no-progress", "--num-warmups", "0",
                              "--slo-ttft", "30", "--slo-tpot", "5", *extra])


@pytest.mark.parametrize("dataset", ["sharegpt", "sharegpt-sessions"])
def test_bench_serve_numbers_are_consistent(server, dataset):
    extra = ["--dataset", dataset, "--max-concurrency", "3"]
    if dataset == "sharegpt-sessions":
        extra += ["--think-time", "0"]
    doc = asyncio.run(run_serve(bench_args(server.url, *extra)))
    summary, rows = doc["summary"], doc["requests"]
    assert rows and all(r["error"] is None for r in rows), rows
    json.dumps(doc)  # the saved form must serialize
    for r in rows:
        assert 0 < r["ttft"] <= r["e2e"]
        # Token counts come from the server's usage; every streamed chunk carries at least one token.
        assert 1 <= r["num_chunks"] <= r["output_tokens"] <= 12
        if dataset == "sharegpt":
            assert r["prompt_tokens"] == r["prompt_len"]  # usage agrees with the client's own tokenizer
    for name in ("ttft", "tpot", "itl", "e2e"):
        dist = summary[name]
        assert dist["p50"] <= dist["p90"] <= dist["p99"], (name, dist)
    assert summary["goodput"] <= summary["request_throughput"]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert summary["completed"] == len(rows)
    if dataset == "sharegpt-sessions":
        # Later turns resend the conversation: the prefix cache must serve part of it.
        assert summary["cached_token_ratio"] > 0


def test_quality_of_reference_against_itself_and_a_perturbed_one(smollm2_fp32):
    def llm(dtype: str) -> LLM:
        return LLM.from_engine(LLMEngine(smollm2_fp32, EngineArgs(dtype=dtype, kv_cache_memory=64 << 20,
                                                                  max_model_len=512, max_num_batched_tokens=24)))
    reference = llm("float32")
    sequences = heldout_sequences(reference.get_tokenizer(), num=2, seq_len=48, seed=0)
    same = evaluate_quality(llm("float32"), reference, sequences)
    assert same.kl_mean == pytest.approx(0.0, abs=1e-6)
    assert same.top1_agreement == 1.0
    assert same.ppl == pytest.approx(same.reference_ppl)
    again = evaluate_quality(llm("float32"), reference, sequences)
    assert again == same  # deterministic
    noisy = evaluate_quality(_PerturbedScorer(llm("float32")), reference, sequences)
    assert noisy.kl_mean > 1e-3
    assert noisy.top1_agreement < 1.0


class _PerturbedScorer:
    """The reference configuration with noise added to its KV cache after every write."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        cache = llm.engine.core.runner.kv_cache
        original = cache.write

        def noisy_write(layer_idx, slots, k, v):
            gen = torch.Generator().manual_seed(layer_idx)
            original(layer_idx, slots, k + 0.5 * torch.randn(k.shape, generator=gen), v)
        cache.write = noisy_write

    def score_distributions(self, token_id_lists):
        return self.llm.score_distributions(token_id_lists)
