"""Microbenchmarks of threefold.kernels against torch, on SmolLM2-135M's shapes.

    flock /tmp/threefold-bench.lock python benchmarks/kernels_micro.py [--target native] [--only linear]

linear: one pass over all 30 layers' weights (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), so the weights stream from DRAM as in decode, not one matrix hot in
cache; then the lm_head (49152x576) alone. For M = 1..16 rows: torch F.linear fp32 (MKL),
torch bf16 (oneDNN), and linear_small fp32, bf16 and mixed (fp32 x, bf16 w).
argmax: [M, 49152] logits. attention: paged decode at a few context lengths. tree: one layer's
attention for candidate-tree verifies (12-node trees, EAGLE-2's size in benchmarks/spec_decode.py)
through the worker's two paths: the kernel's masked decode group vs the torch path's per-tree SDPA.
Prints the CPU and its class with every run; times are medians (ms).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from threefold.cpu import cpu_info
from threefold.kernels import build_kernels

_NO_TREE = torch.empty(0, dtype=torch.long)  # paged_decode_attention's tree mask: none

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    return [(torch.randn(s, generator=gen) * 0.05).to(dtype) for s in shapes]


def bench_linear(kernels, reps: int) -> None:
    w32 = model_weights(torch.float32)
    w16 = [w.to(torch.bfloat16) for w in w32]
    head32 = torch.randn(VOCAB, HIDDEN) * 0.05
    head16 = head32.to(torch.bfloat16)
    mb16 = sum(w.numel() for w in w16) * 2 / 2**20
    print(f"\nlinear, 30 layers ({mb16:.0f} MiB bf16 / {2 * mb16:.0f} MiB fp32), ms per pass; lm_head separately")
    print(f"{'M':>3} | {'F.linear fp32':>13} {'F.linear bf16':>13} | {'ks fp32':>8} {'ks bf16':>8} {'ks mixed':>8}"
          f" | mixed/F32 | head: {'F32':>6} {'mixed':>6}")

    def torch_pass(ws, x):
        return lambda: [F.linear(x[:, : w.shape[1]], w) for w in ws]

    def kernel_pass(ws, x, out_dtype):
        outs = {w.shape[0]: torch.empty(x.shape[0], w.shape[0], dtype=out_dtype) for w in ws}
        return lambda: [kernels.linear_small(outs[w.shape[0]], x[:, : w.shape[1]], w, None) for w in ws]

    for m in (1, 2, 4, 8, 16):
        x32 = torch.randn(m, INTER)
        x16 = x32.to(torch.bfloat16)
        t = {
            "f32": median_ms(torch_pass(w32, x32), reps),
            "f16": median_ms(torch_pass(w16, x16), reps),
            "k32": median_ms(kernel_pass(w32, x32, torch.float32), reps),
            "k16": median_ms(kernel_pass(w16, x16, torch.bfloat16), reps),
            "kmix": median_ms(kernel_pass(w16, x32, torch.float32), reps),
            "h32": median_ms(torch_pass([head32], x32), reps),
            "hmix": median_ms(kernel_pass([head16], x32, torch.float32), reps),
        }
        print(f"{m:>3} | {t['f32']:>13.2f} {t['f16']:>13.2f} | {t['k32']:>8.2f} {t['k16']:>8.2f} {t['kmix']:>8.2f}"
              f" | {t['f32'] / t['kmix']:>8.2f}x | {t['h32']:>11.2f} {t['hmix']:>6.2f}")


def bench_argmax(kernels, reps: int) -> None:
    print("\nargmax [M, 49152], ms")
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 8, 64):
            logits = torch.randn(m, VOCAB).to(dtype)
            ours = median_ms(functools.partial(kernels.argmax_rows, logits), reps * 5)
            theirs = median_ms(functools.partial(logits.argmax, -1), reps * 5)
            print(f"  {dtype!s:>14} M={m:<3} kernel {ours:.3f}  torch {theirs:.3f}  ({theirs / ours:.1f}x)")


def bench_attention(kernels, reps: int) -> None:
    heads, kv_heads, head_dim, block_size, batch = 9, 3, 64, 16, 8
    print(f"\npaged decode attention, SmolLM2 heads ({heads}/{kv_heads}x{head_dim}), batch {batch}, ms and KV GB/s")
    for dtype in (torch.float32, torch.bfloat16):
        for context in (256, 1024, 4096):
            width = context // block_size
            num_blocks = batch * width + 1
            cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
            tables = (torch.randperm(num_blocks - 1)[: batch * width].view(batch, width) + 1).contiguous()
            lens = torch.full((batch,), context, dtype=torch.long)
            q = torch.randn(batch, heads, head_dim).to(dtype)
            out = torch.empty_like(q)
            ms = median_ms(lambda out=out, q=q, cache=cache, tables=tables, lens=lens: kernels.paged_decode_attention(
                out, q, cache[0], cache[1], tables, lens, head_dim ** -0.5, 0, _NO_TREE, _NO_TREE), reps)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
            print(f"  {dtype!s:>14} context {context:>5}: {ms:7.3f} ms  {kv_bytes / ms / 1e6:6.1f} GB/s")


def bench_tree(kernels, reps: int) -> None:
    from threefold.kv.paged import PagedKVCache
    from threefold.kv.registry import make_codec
    from threefold.sample.params import SamplingParams
    from threefold.worker.attention import PagedAttention
    from threefold.worker.batch import CachedRequestState, build_batch
    from threefold.worker.block_table import BlockTable

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    parents = [-1, -1, -1, -1, 0, 0, 1, 4, 4, 5, 7, 6]  # 12 nodes, depth 4: 4 roots' children, then narrowing
    print(f"\ntree verify attention, one layer, SmolLM2 heads, {len(parents)}-node trees: ms kernel / torch")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 8):
            for context in (256, 1024):
                table = BlockTable(block_size)
                blocks = -(-(context + len(parents) + 1) // block_size)
                states = [CachedRequestState(str(i), list(range(context + 1)), context + 1, SamplingParams(),
                                             table.add_row(list(range(1 + i * blocks, 1 + (i + 1) * blocks))),
                                             context, None) for i in range(batch)]
                scheduled = {s.request_id: len(parents) + 1 for s in states}
                drafts = {s.request_id: [7] * len(parents) for s in states}
                trees = {s.request_id: parents for s in states}
                cache = PagedKVCache(make_codec("auto", kv_heads, head_dim, dtype), 1, batch * blocks + 1, block_size,
                                     torch.device("cpu"))
                rows = batch * (len(parents) + 1)
                q = torch.randn(rows, heads, head_dim).to(dtype)
                k, v = (torch.randn(rows, kv_heads, head_dim).to(dtype) for _ in range(2))
                times = []
                for native in (True, False):
                    step = build_batch(states, scheduled, drafts, table, torch.device("cpu"), native_decode=native,
                                       trees=trees)
                    attention = PagedAttention(cache, step.attn, head_dim ** -0.5, dtype, kernels if native else None)
                    times.append(median_ms(functools.partial(attention, 0, q, k, v), reps))
                print(f"  {dtype!s:>14} batch {batch} context {context:>5}: {times[0]:7.3f} / {times[1]:7.3f}"
                      f"  ({times[1] / times[0]:.1f}x)")


def bench_elementwise(kernels, reps: int) -> None:
    print("\nelementwise at M rows, ms: kernel / torch eager")
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 16):
            gate_up = torch.randn(m, 2 * INTER).to(dtype)
            act = torch.empty(m, INTER, dtype=dtype)
            silu_k = median_ms(functools.partial(kernels.silu_and_mul, act, gate_up), reps * 5)
            silu_t = median_ms(lambda gate_up=gate_up: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], reps * 5)
            x, res = (torch.randn(m, HIDDEN).to(dtype) for _ in range(2))
            w = torch.rand(HIDDEN).to(dtype)
            norm_k = median_ms(functools.partial(kernels.add_rms_norm, x, res, w, 1e-5, True), reps * 5)
            norm_t = median_ms(lambda x=x, res=res, w=w: F.rms_norm(x + res, (HIDDEN,), w, 1e-5), reps * 5)
            print(f"  {dtype!s:>14} M={m:<3} silu_and_mul {silu_k:.4f} / {silu_t:.4f}"
                  f"   add_rms_norm {norm_k:.4f} / {norm_t:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="native", help="kernel build: native, x86-64-v3, x86-64-v2")
    parser.add_argument("--only", choices=["linear", "argmax", "attention", "tree", "elementwise"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    kernels = build_kernels(args.target)
    print(f"CPU: {cpu_info().describe()} | kernel build {args.target} ({kernels.build_isa()})")
    benches = {"linear": bench_linear, "argmax": bench_argmax, "attention": bench_attention, "tree": bench_tree,
               "elementwise": bench_elementwise}
    for name, bench in benches.items():
        if args.only in (None, name):
            bench(kernels, args.reps)


if __name__ == "__main__":
    main()
