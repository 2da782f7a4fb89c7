"""`threefold bench calibrate`: time the real engine's steps over a grid of shapes, fit EngineModel.

Prefill-only steps (one fresh prompt of P tokens) give the token profile;
decode steps (D running requests of context C) give the context price. Prefix
caching is off while measuring, so every prompt token is computed. Run it
under the benchmark lock: `flock /tmp/threefold-bench.lock threefold bench calibrate --out FILE`.
"""

from __future__ import annotations

import argparse
import itertools
import time

from threefold.config import DEFAULT_MODEL
from threefold.sim.engine_model import EngineModel, StepPoint

PREFILL_TOKENS = (16, 128, 512, 1024)
DECODE_SHAPES = ((1, 256), (8, 512), (32, 256))
"""(running requests, context tokens each)."""


def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV bytes per replica (engine default if unset): sets the prefix cache's size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True, help="engine model JSON to write")


def calibrate_main(ns: argparse.Namespace) -> int:
    from threefold.cpu import cpu_class
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=ns.model, kv_cache_memory=ns.kv_cache_memory,
                                            enable_prefix_caching=False))
    ids = itertools.count()
    points = _prefill_points(engine, ids, ns.repeats) + _decode_points(engine, ids, ns.repeats)
    args = engine.args
    info = engine.core.cache_info
    model = EngineModel.fit(points, block_size=info["block_size"], num_blocks=info["num_blocks"],
                            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            model=ns.model, cpu=cpu_class())
    model.save(ns.out)
    print(f"wrote {ns.out}: per-token prefill {model.prefill_seconds_per_token() * 1e3:.3f} ms, "
          f"context {model.per_context_s * 1e9:.1f} ns/token, {model.num_blocks} KV blocks [{model.cpu}]")
    return 0


def _add(engine, ids, num_tokens: int, max_tokens: int) -> str:
    from threefold.sample.params import SamplingParams

    request_id = f"cal{next(ids)}"
    prompt = [(7 * int(request_id[3:]) + 13 * i) % 20000 + 100 for i in range(num_tokens)]
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    return request_id


def _timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _prefill_points(engine, ids, repeats: int) -> list[StepPoint]:
    _add(engine, ids, 64, 1)  # warm-up (first calls build caches)
    while engine.has_unfinished_requests():
        engine.step()
    points = []
    for tokens in PREFILL_TOKENS:
        for _ in range(repeats):
            _add(engine, ids, tokens, 1)
            points.append(StepPoint(tokens, 0, 0, _timed_step(engine)))
            while engine.has_unfinished_requests():
                engine.step()
        print(f"  prefill {tokens:5d} tokens: {min(p.seconds for p in points[-repeats:]) * 1e3:.1f} ms", flush=True)
    return points


def _decode_points(engine, ids, repeats: int) -> list[StepPoint]:
    points: list[StepPoint] = []
    for count, context in DECODE_SHAPES:
        pending = {_add(engine, ids, context, repeats + 2) for _ in range(count)}
        while pending:  # prefill (chunked over steps when it exceeds the token budget) to first tokens
            pending -= {out.request_id for out in engine.step()}
        points.extend(StepPoint(0, count, count * (context + 1 + step), _timed_step(engine)) for step in range(repeats))
        while engine.has_unfinished_requests():
            engine.step()
        print(f"  decode {count:3d} x {context:5d} context: {min(p.seconds for p in points[-repeats:]) * 1e3:.1f} ms",
              flush=True)
    return points

