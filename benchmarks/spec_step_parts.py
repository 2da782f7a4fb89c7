"""Where a speculating step's time goes: the concurrency cell of spec_decode.py (ShareGPT, a closed loop
of --concurrency requests, refilled), each runner step timed in process CPU time (one torch thread, so a
busy machine does not blur it), then a least-squares fit over the decode and verify steps:

    seconds = fixed + per_request * requests + per_draft_row * draft rows + per_verify_step * [any draft]

for the forward, the verify and the whole runner step (`ModelRunner.execute`).

    tfrun python benchmarks/spec_step_parts.py --num-prompts 64 --config ngram
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch
from spec_decode import run, sharegpt_prompts  # benchmarks/ is on sys.path: this script's own folder

import threefold.spec.runner as spec_runner
import threefold.worker.model_runner as model_runner
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.model.loader import load_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--config", choices=["ngram", "off"], default="ngram")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    parts: dict[str, float] = {}

    def timed(owner, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.process_time() - start
        setattr(owner, name, wrapper)

    loaded = load_model("smollm2-135m", dtype="auto")
    timed(type(loaded.model), "forward")
    timed(spec_runner.SpecRunner, "_verify")
    timed(spec_runner.SpecRunner, "propose")
    steps = []
    execute = model_runner.ModelRunner.execute

    def step(self, sched):
        parts.clear()
        start = time.process_time()
        out = execute(self, sched)
        parts["execute"] = time.process_time() - start
        drafts = sum(len(d) for d in sched.scheduled_spec_token_ids.values())
        steps.append((dict(parts), len(sched.num_scheduled_tokens), sum(sched.num_scheduled_tokens.values()), drafts))
        return out

    model_runner.ModelRunner.execute = step  # type: ignore[method-assign]
    prompts = sharegpt_prompts(loaded.tokenizer, ns.num_prompts)
    engine = LLMEngine(loaded, EngineArgs(dtype="auto", kv_cache_memory=1 << 30, max_model_len=2048,
                                          enable_prefix_caching=False,
                                          speculative_config=NGRAM if ns.config == "ngram" else None))
    run(engine, prompts[:4], 4, 8)
    steps.clear()
    result = run(engine, prompts, ns.concurrency, 64)
    # decodes and verifies only (a prompt chunk's step is another shape); no step over 0.2 s (a stray stall)
    fit = [s for s in steps if s[2] == s[1] + s[3] and s[1] >= 4 and s[0]["execute"] < 0.2]
    x = np.array([[1, reqs, drafts, drafts > 0] for _, reqs, _, drafts in fit], dtype=float)
    print(f"{ns.config}: {result['tok_s']:.1f} tok/s (1 thread), {len(steps)} steps, {len(fit)} fitted, "
          f"{sum(s[3] for s in steps)} draft rows")
    print("| part | fixed ms | per request ms | per draft row ms | per verify step ms |")
    print("|---|---|---|---|---|")
    for part in ("forward", "_verify", "propose", "execute"):
        coef = np.linalg.lstsq(x, np.array([s[0].get(part, 0.0) * 1e3 for s in fit]), rcond=None)[0]
        print(f"| {part} | " + " | ".join(f"{c:.2f}" for c in coef) + " |")


if __name__ == "__main__":
    main()
