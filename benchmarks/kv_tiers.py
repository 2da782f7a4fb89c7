"""Later-turn TTFT by KV tier: multi-turn sessions with long contexts, more users than L1 holds.

    flock /tmp/threefold-bench.lock python benchmarks/kv_tiers.py [--users 4 --context 2048]

Each user has its own long context (random tokens); turn 1 computes it, then every other user's turn
evicts it from the pool, and turn 2 (context + reply + a short new message) is timed: its TTFT is
what recompute costs (L1 only) or what loading from the tier costs. Requests run one at a time, so
TTFT is the request's own prefill. Modes: L1 only, + L2 (host memory), + L3 (disk only: L2 off),
+ L4 (Redis only; a redis-server on a free loopback port, started here).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.kvstore import OffloadConfig
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_fixture import RedisServer


def ttft(output) -> float:
    return output.metrics.first_token_time - output.metrics.arrival_time


def run_mode(loaded, offload: OffloadConfig | None, ns) -> tuple[list[float], dict[str, int]]:
    pool_tokens = ns.context * 3 // 2  # one user's context fits, two do not
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4 if loaded.config.dtype.itemsize == 4 else 30 * 2 * 16 * 3 * 64 * 2
    args = EngineArgs(max_model_len=ns.context + 128, kv_cache_memory=(pool_tokens // 16 + 2) * block_bytes,
                      kv_offload=offload)
    llm = LLM.from_engine(LLMEngine(loaded, args))
    rng = random.Random(0)
    contexts = [[rng.randrange(100, 40000) for _ in range(ns.context)] for _ in range(ns.users)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for ctx in contexts:  # turn 1
        ctx.extend(llm.generate([{"prompt_token_ids": ctx}], params)[0].outputs[0].token_ids)
        ctx.extend(range(1000, 1032))
    times, by_tier = [], {}
    for ctx in contexts:  # turn 2: each context was evicted by the users after it
        out = llm.generate([{"prompt_token_ids": ctx}], SamplingParams(max_tokens=1, temperature=0))[0]
        times.append(ttft(out))
        for tier, n in (out.cached_tokens_by_tier or {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    llm.close()
    return times, by_tier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    ns = parser.parse_args()
    loaded = load_model("smollm2-135m", max_model_len=ns.context + 128)
    work = Path(tempfile.mkdtemp())
    redis = RedisServer(work) if shutil.which("redis-server") else None
    modes: dict[str, OffloadConfig | None] = {"L1 only": None, "+L2 (cpu)": OffloadConfig(cpu_bytes=4 << 30),
                                              "+L3 (disk)": OffloadConfig(disk_dir=str(work / "disk"))}
    if redis is not None:
        redis.start()
        modes["+L4 (redis)"] = OffloadConfig(redis_url=redis.url)
    try:
        rows = {name: run_mode(loaded, offload, ns) for name, offload in modes.items()}
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(rows["L1 only"][0])
    total = ns.users * (ns.context + 8 + 32)
    print(f"| tiers | turn-2 TTFT p50 (s) | max (s) | speedup p50 | prompt tokens by source ({total} total) |")
    print("|---|---|---|---|---|")
    for name, (times, by_tier) in rows.items():
        p50 = statistics.median(times)
        print(f"| {name} | {p50:.3f} | {max(times):.3f} | {base / p50:.1f}x | {by_tier or '-'} |")
    print(f"({ns.users} users x {ns.context}-token contexts, pool holds ~1.5 contexts, SmolLM2-135M, "
          f"dtype {loaded.config.dtype})")


if __name__ == "__main__":
    main()
