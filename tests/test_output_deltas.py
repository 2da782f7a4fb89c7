"""Output kinds on the real default model: streamed deltas concatenate to the whole output,
and penalties kept incrementally by the runner match a plain-torch reference."""

from __future__ import annotations

import torch

from model_fixtures import DenseCacheAttention
from prompts import PROMPTS
from threefold.engine.outputs import RequestOutputKind, merge_deltas
from threefold.sample.params import SamplingParams


def _run(engine, requests: dict[str, tuple[str, SamplingParams, RequestOutputKind]]) -> dict[str, list]:
    """Every output of every request, step by step."""
    for request_id, (prompt, params, kind) in requests.items():
        engine.add_request(request_id, prompt, params, output_kind=kind)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def _whole(output) -> list[tuple]:
    return [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
            for c in output.outputs]


def test_deltas_concatenate_to_the_cumulative_and_final_outputs(make_llm):
    llm = make_llm(max_num_batched_tokens=64)
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."], logprobs=0),  # held-back text
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=16, presence_penalty=0.5),
    ]
    for i, params in enumerate(cases):
        prompt = PROMPTS[i]
        outputs = _run(llm.engine, {kind.name: (prompt, params, kind) for kind in RequestOutputKind})
        deltas, cumulative, final = outputs["DELTA"], outputs["CUMULATIVE"], outputs["FINAL_ONLY"]
        assert len(final) == 1 and final[0].finished and len(deltas) > 2
        assert not any(d.finished for d in deltas[:-1]) and deltas[-1].finished
        merged = merge_deltas(deltas)
        assert _whole(merged) == _whole(cumulative[-1]) == _whole(final[0])
        assert merged.prompt_logprobs == cumulative[-1].prompt_logprobs
        assert sum(d.prompt_logprobs is not None for d in deltas) == (params.prompt_logprobs is not None)
        # Each delta holds only what is new: its token ids are the next slice of the whole.
        assert [t for d in deltas for t in d.outputs[0].token_ids] == final[0].outputs[0].token_ids
        offline = llm.generate([prompt], params)[0]  # alone: logprobs may differ in the last bits
        assert [w[:2] + w[4:] for w in _whole(offline)] == [w[:2] + w[4:] for w in _whole(final[0])]


def _penalised(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The penalties from their definitions, token by token (a plain loop over distinct tokens)."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            value = logits[token]
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        count = output.count(token)
        logits[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return logits


@torch.inference_mode()
def _reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    attention, output = DenseCacheAttention(), []
    new = torch.tensor(prompt)
    for _ in range(params.max_tokens):
        positions = torch.arange(len(prompt) + len(output) - len(new), len(prompt) + len(output))
        logits = model.compute_logits(model(new, positions, attention)[-1:])[0].float()
        token = int(_penalised(logits, prompt, output, params).argmax())
        output.append(token)
        new = torch.tensor([token])
    return output


def test_incremental_penalties_match_the_reference_under_preemption(make_llm, smollm2_fp32):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3)
    tokenizer = smollm2_fp32.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = [_reference_greedy(smollm2_fp32.model, p, params) for p in prompts]
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K+V, 30 layers, 16 tokens, 3 kv heads, dim 64, fp32
    llm = make_llm(kv_cache_memory=10 * block_bytes, max_model_len=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.get_stats().num_preemptions > 0  # counts survived a recompute
    assert [o.outputs[0].token_ids for o in outputs] == expected
