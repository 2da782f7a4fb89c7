"""Write-through cost with no reuse: offline throughput with KV offload tiers on (L2 + L3) against off.

    flock /tmp/threefold-bench.lock python benchmarks/kv_offload_overhead.py [--prompts 16 --len 512 --reps 3]

Every prompt is unique random tokens, so no block is ever loaded back: what is measured is only the
per-step gather of newly full blocks and the async writes. Off and on runs interleave over one loaded model.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.kvstore import OffloadConfig
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    ns = parser.parse_args()
    loaded = load_model("smollm2-135m", max_model_len=2048)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as disk:
        for rep in range(ns.reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                offload = OffloadConfig(cpu_bytes=1 << 30, disk_dir=disk) if mode == "on" else None
                llm = LLM.from_engine(LLMEngine(loaded, EngineArgs(max_model_len=2048, kv_cache_memory=256 << 20,
                                                                   kv_offload=offload)))
                prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(ns.len)]}
                           for _ in range(ns.prompts)]
                start = time.perf_counter()
                llm.generate(prompts, params)
                times[mode].append(time.perf_counter() - start)
                llm.close()
    tokens = ns.prompts * (ns.len + ns.max_tokens)
    best = {mode: min(ts) for mode, ts in times.items()}
    for mode, ts in times.items():
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{mode:>3}: {tokens / best[mode]:8.1f} tok/s (best of {ns.reps}; runs {runs} s)")
    print(f"overhead: {100 * (best['on'] / best['off'] - 1):+.2f}%  ({ns.prompts} prompts x {ns.len} tokens, "
          f"{ns.max_tokens} out, no reuse; L2 1GiB + L3 tmp dir)")


if __name__ == "__main__":
    main()
