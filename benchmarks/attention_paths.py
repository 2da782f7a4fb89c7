"""How far apart the decode-attention paths' outputs are in bf16: AMX tiles, AVX-512, torch SDPA.

    .venv/bin/python benchmarks/attention_paths.py --max-tokens 96

The AMX path rounds the softmax weights P to bf16 for its second matmul (as
FlashAttention does); the AVX-512 kernel keeps P in fp32; SDPA gathers the blocks
and runs torch's own kernel. In bf16 any change of summation order moves a greedy
run eventually, so the question is whether AMX moves it more than the other two
move each other. For each pair: how many of the prompts' greedy sequences are
identical, where the others first diverge, and the |logprob| difference of the
chosen tokens before that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from threefold import LLM, SamplingParams
from threefold.config import DEFAULT_MODEL
from threefold.kernels import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.prompts import PROMPTS  # the engine tests' 16 varied prompts


def compare(name: str, ours: list, theirs: list) -> None:
    identical, diverge, diffs = 0, [], []
    for a, b in zip(ours, theirs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        identical += n == len(ta)
        diverge.append(n)
        diffs += [abs(a.outputs[0].logprobs[i][ta[i]].logprob - b.outputs[0].logprobs[i][tb[i]].logprob)
                  for i in range(n)]
    print(f"{name}: identical {identical}/{len(ours)}; first divergence {sorted(diverge)}; "
          f"|d logprob| before it: mean {sum(diffs) / len(diffs):.3f}, max {max(diffs):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.set_amx(True):
        raise SystemExit("needs the native kernels built on a CPU with AMX tiles")
    llm = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    runner = llm.engine.core.runner
    amx = llm.generate(PROMPTS, params)
    kernels.set_amx(False)
    vector = llm.generate(PROMPTS, params)
    kernels.set_amx(True)
    runner.kernels = None  # the plain-torch decode path: gather + SDPA
    sdpa = llm.generate(PROMPTS, params)
    runner.kernels = kernels
    compare("AMX vs AVX-512", amx, vector)
    compare("AVX-512 vs SDPA", vector, sdpa)
    compare("AMX vs SDPA", amx, sdpa)


if __name__ == "__main__":
    main()
