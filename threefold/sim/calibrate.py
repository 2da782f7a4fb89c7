"""`threefold bench calibrate`: time the real engine's steps over a grid of shapes, fit EngineModel.

Prefill-only steps (one fresh prompt of P tokens, up to the step budget's 2,048) give the token
profile; the same token counts split over 2 fresh prompts in one step give the price of a
prompt's attention over itself (the difference between the two); decode steps (D running
requests of context C) give the context price; prefill steps of P new tokens after a cached
prefix of C tokens give the price of a chunk's attention over context it did not compute.
Every prompt starts with its own tokens, so only the prefix points hit the prefix cache. Run it
on an idle machine, one pinned core: `taskset -c 0 threefold bench calibrate --out FILE`.
"""

from __future__ import annotations

import argparse
import itertools
import time

from threefold.config import DEFAULT_MODEL
from threefold.sim.engine_model import EngineModel, StepPoint

PREFILL_TOKENS = (1, 16, 128, 512, 1024, 1536, 2048)
"""From one token (the fixed cost of a step, which a lone decode pays: 27 ms here against 40 ms for
16 tokens) up to the step budget: past 1,024 tokens attention makes a prompt's step grow faster than
linearly (2,048 tokens took 2.55x the 1,024-token step, where linear extrapolation predicts 2.1x)."""
SPLIT_SHAPES = ((2, 1024), (2, 2048))
"""(prompts, total tokens) in one step, each prompt total / prompts tokens: the attention price."""
DECODE_SHAPES = ((1, 256), (8, 512), (32, 256))
"""(running requests, context tokens each)."""
PREFIX_SHAPES = ((64, 512), (64, 1024), (256, 1024))
"""(new prompt tokens, cached prefix tokens before them)."""


def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV bytes per replica (engine default if unset): sets the prefix cache's size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True, help="engine model JSON to write")


def calibrate_main(ns: argparse.Namespace) -> int:
    from threefold.cpu import cpu_class
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=ns.model, kv_cache_memory=ns.kv_cache_memory))
    ids = itertools.count()
    points = (_prefill_points(engine, ids, ns.repeats) + _split_points(engine, ids, ns.repeats)
              + _decode_points(engine, ids, ns.repeats) + _prefix_points(engine, ids, ns.repeats))
    args = engine.args
    info = engine.core.cache_info
    model = EngineModel.fit(points, block_size=info["block_size"], num_blocks=info["num_blocks"],
                            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            model=ns.model, cpu=cpu_class())
    model.save(ns.out)
    print(f"wrote {ns.out}: per-token prefill {model.prefill_seconds_per_token() * 1e3:.3f} ms, "
          f"context {model.per_context_s * 1e9:.1f} ns/token, prefill over a cached prefix "
          f"{model.per_prefill_context_s * 1e9:.2f} ns/(token x context), attention inside a chunk "
          f"{model.prefill_attention_s * 1e9:.2f} ns/pair, {model.num_blocks} KV blocks [{model.cpu}]")
    return 0


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(7 * seed + 13 * i) % 20000 + 100 for i in range(num_tokens)]


def _add(engine, ids, num_tokens: int, max_tokens: int, prompt: list[int] | None = None) -> str:
    from threefold.sample.params import SamplingParams

    number = next(ids)
    prompt = prompt if prompt is not None else _prompt(number, num_tokens)
    engine.add_request(f"cal{number}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                              temperature=0.0))
    return f"cal{number}"


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


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


def _split_points(engine, ids, repeats: int) -> list[StepPoint]:
    points = []
    for prompts, tokens in SPLIT_SHAPES:
        for _ in range(repeats):
            added = {_add(engine, ids, tokens // prompts, 1) for _ in range(prompts)}
            start = time.perf_counter()
            done = {out.request_id for out in engine.step()}
            points.append(StepPoint(tokens, 0, 0, time.perf_counter() - start, prompts))
            if done != added:  # each prompt's first token comes from this one step, or the shape is wrong
                raise RuntimeError(f"{prompts} prompts of {tokens // prompts} tokens did not share one step")
            _drain(engine)
        print(f"  prefill {prompts} x {tokens // prompts:5d} tokens in one step: "
              f"{min(p.seconds for p in points[-repeats:]) * 1e3:.1f} ms", flush=True)
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



def _prefix_points(engine, ids, repeats: int) -> list[StepPoint]:
    points = []
    for new, cached in PREFIX_SHAPES:
        for repeat in range(repeats):
            prefix = _prompt(100_000 + 7 * cached + repeat, cached)  # a prefix of its own: cold, then cached
            _add(engine, ids, cached, 1, prefix)
            _drain(engine)
            _add(engine, ids, cached + new, 1, prefix + _prompt(200_000 + new + repeat, new))
            points.append(StepPoint(new, 0, cached, _timed_step(engine)))
            _drain(engine)
        print(f"  prefill {new:5d} after {cached:5d} cached: {min(p.seconds for p in points[-repeats:]) * 1e3:.1f} ms",
              flush=True)
    return points
