"""The order effect check: engines built one after another in one process (as spec_decode.py builds
them), the concurrency cell run on each in turn, every other round in reverse; per cell its tok/s,
the mean wall time of its decode-only and verify steps, and steps per request.

    tfquiet python benchmarks/spec_order.py --engines off,ngram,off2 --num-prompts 96 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from spec_decode import run, sharegpt_prompts  # benchmarks/ is on sys.path: this script's own folder

import threefold.worker.model_runner as model_runner
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.model.loader import load_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def mean_ms(values: list[float]) -> float:
    return statistics.mean(values) * 1e3 if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="off,ngram,off2", help="names; those starting with ngram speculate")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    ns = parser.parse_args()
    steps: list[tuple[float, int, int, int]] = []  # (seconds, requests, tokens, draft rows)
    per_request: dict[str, int] = {}
    execute = model_runner.ModelRunner.execute

    def step(self, sched):
        start = time.perf_counter()
        out = execute(self, sched)
        drafts = sum(len(d) for d in sched.scheduled_spec_token_ids.values())
        steps.append((time.perf_counter() - start, len(sched.num_scheduled_tokens),
                      sum(sched.num_scheduled_tokens.values()), drafts))
        for rid in sched.num_scheduled_tokens:
            per_request[rid] = per_request.get(rid, 0) + 1
        return out

    model_runner.ModelRunner.execute = step  # type: ignore[method-assign]
    loaded = load_model("smollm2-135m", dtype="auto")
    prompts = sharegpt_prompts(loaded.tokenizer, ns.num_prompts)
    engines = {}
    for name in ns.engines.split(","):
        engines[name] = LLMEngine(loaded, EngineArgs(
            dtype="auto", kv_cache_memory=1 << 30, max_model_len=2048, enable_prefix_caching=False,
            speculative_config=NGRAM if name.startswith("ngram") else None))
        run(engines[name], prompts[:4], 4, 8)
    for round_index in range(ns.rounds):
        for name in list(engines) if round_index % 2 == 0 else list(engines)[::-1]:
            steps.clear()
            per_request.clear()
            result = run(engines[name], prompts, ns.concurrency, 64)
            decodes = [s for s in steps if s[2] == s[1] and s[1] >= 24]
            verifies = [s for s in steps if s[3] and s[2] == s[1] + s[3]]
            print(f"round {round_index} {name}: {result['tok_s']:.1f} tok/s, {len(steps)} steps; decode-only "
                  f"{len(decodes)} x {mean_ms([s[0] for s in decodes]):.1f} ms; verify {len(verifies)} x "
                  f"{mean_ms([s[0] for s in verifies]):.1f} ms ({sum(s[3] for s in verifies)} draft rows); "
                  f"steps per request {statistics.mean(per_request.values()):.2f}, "
                  f"tokens per request {result['tokens'] / len(per_request):.1f}", flush=True)


if __name__ == "__main__":
    main()
