"""The serving sweep's c=32 burst, in process: where its time-to-first-token goes.

The same 32 ShareGPT prompts as `threefold bench sweep --concurrencies 8,32 --num-prompts 32
--max-output-len 128` sends at c=32 (seed 1000, the sweep's second point), all added at once to one
engine with serve's prefill cap, stepped to the end. Prints the TTFT p50 and last first token, and
writes the engine's step log (`--step-log`: each step's seconds and rows); `--profile` prints torch's
operator table for the steps up to the last first token.

    python benchmarks/serve_burst.py --max-prefill-tokens 512
    python benchmarks/serve_burst.py --max-prefill-tokens 2048 --profile
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from threefold.bench.datasets import LengthLimits, load_sharegpt
from threefold.cpu import cpu_info
from threefold.engine.llm import LLM
from threefold.sample.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-prefill-tokens", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1000, help="the sweep's seed for its second point")
    parser.add_argument("--step-log", default="results/serve_burst_steps.jsonl")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    Path(args.step_log).parent.mkdir(parents=True, exist_ok=True)
    llm = LLM(model=args.model, max_model_len=2048, max_prefill_tokens=args.max_prefill_tokens,
              step_log=args.step_log)
    requests = load_sharegpt(args.num_prompts, llm.get_tokenizer(), LengthLimits(max_output_len=128), seed=args.seed)
    llm.generate([r.prompt for r in requests[:2]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    engine = llm.engine
    print(f"{cpu_info()}; prompt tokens {sum(r.prompt_len for r in requests)}, "
          f"output tokens {sum(r.max_tokens for r in requests)}")
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"burst{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    if profiler is not None:
        profiler.__enter__()
    while engine.has_unfinished_requests() and not (profiler is not None and len(first) == len(requests)):
        for output in engine.step():
            if output.request_id not in first and output.outputs[0].token_ids:
                first[output.request_id] = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    ttft = sorted(first.values())
    print(f"max_prefill_tokens {args.max_prefill_tokens}: TTFT p50 {ttft[len(ttft) // 2] * 1000:.0f} ms, "
          f"last first token {ttft[-1] * 1000:.0f} ms, run {time.perf_counter() - start:.2f} s; "
          f"steps in {args.step_log}")


if __name__ == "__main__":
    main()
