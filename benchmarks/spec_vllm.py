"""vLLM CPU's speculative decoding on the prompts of a spec_decode.py run: batch 1, greedy, off vs on.

Runs under the vLLM peer venv (stdlib + vllm only), in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0:
no engine-core children to outlive it), one configuration after another, each over the same prompt
ids, `rounds` times after a short warm-up:

    ~/.cache/threefold/peers/vllm/bin/python benchmarks/spec_vllm.py SPEC.json

SPEC.json: {"model": HF dir, "dtype": "bfloat16", "prompt_ids": [[...], ...], "max_tokens": N,
"rounds": R, "configs": {"vllm": null, "vllm-draft": {"method": "draft_model", "model": HF dir,
"num_speculative_tokens": k}}}. `spec_decode.py --vllm` writes it and reads the printed
`RESULT {...}` lines (one per configuration and round, spec_decode.py's fields).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def spec_counters(llm) -> dict[str, list[float]]:
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted, accepted per position."""
    out: dict[str, list[float]] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            values = getattr(metric, "values", None)
            out[metric.name] = [float(v) for v in values] if values is not None else [float(metric.value)]
    return out


def run(llm, params, prompt_ids: list[list[int]]) -> dict:
    before = spec_counters(llm)
    num_tokens, start = 0, time.perf_counter()
    for ids in prompt_ids:  # batch 1: one request at a time
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        num_tokens += len(out[0].outputs[0].token_ids)
    wall = time.perf_counter() - start
    after = spec_counters(llm)
    delta = {name: [a - b for a, b in zip(values, before.get(name, [0.0] * len(values)), strict=False)]
             for name, values in after.items()}
    drafts = sum(delta.get("vllm:spec_decode_num_drafts", [0.0]))
    accepted = sum(delta.get("vllm:spec_decode_num_accepted_tokens", [0.0]))
    per_pos = delta.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    return {"tok_s": num_tokens / wall, "tokens": num_tokens, "wall_s": wall, "steps": None,
            "emitting_steps_per_request": None, "tokens_per_request": num_tokens / len(prompt_ids),
            "accept_len": 1 + accepted / drafts if drafts else None, "drafts": int(drafts),
            "draft_tokens": int(sum(delta.get("vllm:spec_decode_num_draft_tokens", [0.0]))),
            "per_pos": [round(p / drafts, 3) for p in per_pos] if drafts else [],
            "itl_p50_ms": None, "itl_p99_ms": None}


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    for name, config in spec["configs"].items():
        start = time.perf_counter()
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0, enable_prefix_caching=False,
                  disable_log_stats=False, speculative_config=config)
        print(f"{name}: built in {time.perf_counter() - start:.1f} s", flush=True)
        llm.generate([{"prompt_token_ids": spec["prompt_ids"][0]}], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)  # warm-up
        for round_index in range(spec["rounds"]):
            result = {**run(llm, params, spec["prompt_ids"]), "config": name, "round": round_index}
            print("RESULT " + json.dumps(result), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
