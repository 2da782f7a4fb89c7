"""What a speculating step costs, from the engine's step log: the concurrency cell of spec_decode.py
(a closed loop of --concurrency requests, refilled), speculation off and n-gram, each step sorted by what
it carried (decodes only, rows after context: draft verifies or a prompt's later chunk, a prompt's first
chunk, or both) with its mean seconds.

    python benchmarks/spec_step_cost.py --concurrency 32 --num-prompts 128 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from spec_decode import run, sharegpt_prompts  # benchmarks/ is on sys.path: this script's own folder

from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.engine.step_log import LoggedStep, read_step_log
from threefold.model.loader import load_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def kind(step: LoggedStep) -> str:
    """A prompt chunk starts a sequence (nothing computed before); more than one row after context is a verify."""
    prompt = any(n > 1 and before == 0 for n, before in step.shape)
    verify = any(n > 1 and before > 0 for n, before in step.shape)
    return {(False, False): "decodes", (False, True): "verify", (True, False): "prompt", (True, True): "prompt+verify"}[
        (prompt, verify)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ngram-first", action="store_true", help="run n-gram before off (the order matters)")
    ns = parser.parse_args()
    loaded = load_model("smollm2-135m", dtype="auto")
    prompts = sharegpt_prompts(loaded.tokenizer, ns.num_prompts)
    folder = Path(tempfile.mkdtemp(prefix="spec-steps-"))
    print("| config | out tok/s | steps | kind | steps of it | mean ms | decodes | draft rows |")
    print("|---|---|---|---|---|---|---|---|")
    configs = [("off", None), ("ngram", NGRAM)]
    for name, config in configs[::-1] if ns.ngram_first else configs:
        log = folder / f"{name}.jsonl"
        args = EngineArgs(dtype="auto", kv_cache_memory=1 << 30, max_model_len=2048, enable_prefix_caching=False,
                          speculative_config=config, step_log=str(log))
        engine = LLMEngine(loaded, args)
        run(engine, prompts[:4], 4, 8)  # first-call costs outside the cell
        began = time.time()
        result = run(engine, prompts, ns.concurrency, ns.max_tokens)
        steps = read_step_log(log, since=began)
        by_kind: dict[str, list[LoggedStep]] = {}
        for step in steps:
            by_kind.setdefault(kind(step), []).append(step)
        for label, group in sorted(by_kind.items()):
            decodes = statistics.mean(sum(n == 1 for n, _ in s.shape) for s in group)
            drafts = statistics.mean(sum(n - 1 for n, before in s.shape if n > 1 and before > 0) for s in group)
            print(f"| {name} | {result['tok_s']:.1f} | {len(steps)} | {label} | {len(group)} | "
                  f"{statistics.mean(s.seconds for s in group) * 1e3:.1f} | {decodes:.1f} | {drafts:.1f} |", flush=True)


if __name__ == "__main__":
    main()
