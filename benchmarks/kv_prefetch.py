"""What a request loading a long prefix from a slow tier costs the requests already running.

    flock /tmp/threefold-bench.lock python benchmarks/kv_prefetch.py [--context 2048 --reps 3 --tier redis]

A request B is decoding; request P arrives whose `--context`-token prefix is only in the tier (Redis on
a free loopback port, started here, or a disk directory). Timed from P's arrival to its first token:
P's TTFT and every engine step in between, which B waits through. Two engines, interleaved rep by rep:

- "inline": the tier is read inside the admitting step (what the engine did before prefetching;
  reproduced by marking every tier as in-process for this engine only);
- "prefetch": the reads run on background threads (WAITING_FOR_KV) while the steps go on, batched (one
  Redis MGET per 32 blocks);
- "prefetch, one read per block": the same, one round trip per block (the engine before batching).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.kvstore import OffloadConfig
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_fixture import RedisServer


def build(loaded, offload: OffloadConfig, context: int, inline: bool, read_chunk: int | None = None) -> LLM:
    block_bytes = loaded.config.num_layers * 2 * 16 * loaded.config.num_kv_heads * loaded.config.head_dim \
        * loaded.config.dtype.itemsize
    args = EngineArgs(max_model_len=context + 256, kv_cache_memory=((2 * context + 512) // 16 + 2) * block_bytes,
                      kv_offload=offload)
    llm = LLM.from_engine(LLMEngine(loaded, args))
    store = llm.engine.core.offload.store
    if inline:
        store.reads_inline = lambda tier: True  # the old behaviour, this engine only
    if read_chunk is not None:
        store.read_chunk = read_chunk
    return llm


def one_rep(llm: LLM, prefix: list[int], rep: int) -> tuple[float, list[float], dict[str, int]]:
    """(P's TTFT, the step times B waited through, P's cached tokens by tier)."""
    engine, rng = llm.engine, random.Random(rep)
    engine.core.kv.reset_prefix_cache()  # P's prefix is only in the tier now
    engine.add_request(f"b{rep}", [rng.randrange(100, 40000) for _ in range(64)],
                       SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()  # B is decoding
    start = time.perf_counter()
    engine.add_request(f"p{rep}", prefix, SamplingParams(max_tokens=1, temperature=0))
    steps: list[float] = []
    while True:
        began = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - began)
        done = [o for o in outputs if o.request_id == f"p{rep}" and o.finished]
        if done:
            ttft = time.perf_counter() - start
            engine.abort_request([f"b{rep}"])
            return ttft, steps, dict(done[0].cached_tokens_by_tier or {})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tier", choices=("redis", "disk"), default="redis")
    ns = parser.parse_args()
    loaded = load_model("smollm2-135m", max_model_len=ns.context + 256)
    work = Path(tempfile.mkdtemp())
    redis = RedisServer(work) if ns.tier == "redis" else None
    try:
        if redis is not None:
            redis.start()
        offload = (OffloadConfig(redis_url=redis.url) if redis is not None
                   else OffloadConfig(disk_dir=str(work / "disk")))
        engines = {"inline": build(loaded, offload, ns.context, True),
                   "prefetch, one read per block": build(loaded, offload, ns.context, False, read_chunk=1),
                   "prefetch": build(loaded, offload, ns.context, False)}
        prefix = [random.Random(0).randrange(100, 40000) for _ in range(ns.context)]
        warm = engines["prefetch"]
        warm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1, temperature=0))
        assert warm.engine.core.offload.store.flush(60)  # the prefix is in the tier for both engines
        rows: dict[str, list[tuple[float, list[float], dict[str, int]]]] = {name: [] for name in engines}
        for rep in range(ns.reps + 1):  # rep 0 warms both engines' step-cost models; not reported
            for name, llm in engines.items():
                result = one_rep(llm, prefix, rep)
                if rep:
                    rows[name].append(result)
        for llm in engines.values():
            llm.close()
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(rows, ns)


def report(rows, ns) -> None:
    print(f"{ns.context}-token prefix in {ns.tier}, {ns.reps} reps (median of reps; max = worst step B waited)")
    print("| reads | P's TTFT (s) | steps until P's first token | B's longest step (s) | B's median step (s) "
          "| P's cached tokens by tier |")
    print("|---|---|---|---|---|---|")
    for name, results in rows.items():
        ttft = statistics.median(r[0] for r in results)
        num_steps = statistics.median(len(r[1]) for r in results)
        longest = statistics.median(max(r[1]) for r in results)
        typical = statistics.median(statistics.median(r[1]) for r in results)
        print(f"| {name} | {ttft:.3f} | {num_steps:g} | {longest:.3f} | {typical:.3f} | {results[-1][2]} |")


if __name__ == "__main__":
    main()
