"""The engine (paged KV, chunked prefill, batching) on every architecture variant vs transformers.

Tiny random HF checkpoints (see model_fixtures): the model-level parity test checks
the forward; this checks the whole serving path, including Mistral's sliding window
over a context longer than the window.
"""

from __future__ import annotations

import json

import pytest
import torch

from threefold.engine.llm import LLM
from threefold.sample.params import SamplingParams

from model_fixtures import hf_reference_greedy, make_tiny_checkpoint

NUM_TOKENS = 12
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77, 3, 8, 600, 21, 13, 400, 2500, 31, 7, 99, 123, 456, 789],
           [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def checkpoint(tmp_path, variant: str, sliding_window: int | None = None):
    path = make_tiny_checkpoint(tmp_path / variant, "mistral" if sliding_window else variant)
    if sliding_window:
        config = json.loads((path / "config.json").read_text())
        config["sliding_window"] = sliding_window
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("variant,window", [
    ("llama", None), ("llama3_rope_scaling", None), ("qwen2", None), ("qwen3", None), ("untied", None),
    ("sharded", None), ("mistral", None), ("mistral_window", 8)])
def test_engine_greedy_matches_transformers(tmp_path, variant, window):
    from transformers import AutoModelForCausalLM

    path = checkpoint(tmp_path, variant, window)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if window:
        assert hf.config.sliding_window == window
    llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=7, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids, logprobs = hf_reference_greedy(hf, prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == ids
        ours = [pos[t].logprob for t, pos in zip(completion.token_ids, completion.logprobs, strict=True)]
        assert ours == pytest.approx(logprobs, abs=1e-4)
