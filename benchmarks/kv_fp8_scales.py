"""How the fp8 KV codec's scales were chosen, and why fp8 fails on Qwen2.5-Coder-1.5B's first layer:
per layer, the attention KL divergence (nats, mean over query heads and rows) that quantizing only the
keys adds, for each scale choice, on real post-RoPE queries and keys of the model (HumanEval prompts
concatenated, one causal forward in the engine's dtype, attention in fp32; no cache: this isolates the keys' format).

    python benchmarks/kv_fp8_scales.py --model qwen2.5-coder-1.5b --tokens 768

Formats (keys [tokens, kv_heads, head_dim]):
- int8/token-head: threefold's int8 (s = amax over the row / 127);
- e4m3/token-head: threefold's fp8 (s = amax over the row / 448);
- e4m3/head: one scale per layer and kv head from the amax over all tokens (vLLM's calibrated per-head
  scales at their best: calibrated on the very prompt scored);
- e4m3/unscaled: scale 1 (vLLM's default k_scale), saturating at 448;
- e5m2/token-head.
fp8's error is relative to each value (3 mantissa bits: up to 1/16 of it), so a key channel that holds
most of the dot product (Qwen's large k_proj biases) keeps a large absolute error whatever the scale;
int8's error is uniform (amax / 254) and hurts the small channels instead. Not a timing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from threefold.bench.cost_quality import humaneval_problems
from threefold.bench.report import cpu_record
from threefold.kv.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from threefold.model.loader import load_model

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_with_scale(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(fp8).max
    return (x / scale).clamp(-fmax, fmax).to(fp8).float() * scale


FORMATS = {
    "int8/token-head": lambda k: dequantize_int8(*quantize_int8(k)),
    "e4m3/token-head": lambda k: dequantize_fp8(*quantize_fp8(k, E4M3), E4M3),
    "e4m3/head": lambda k: fp8_with_scale(k, k.abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-12) / 448, E4M3),
    "e4m3/unscaled": lambda k: fp8_with_scale(k, torch.ones(()), E4M3),
    "e5m2/token-head": lambda k: dequantize_fp8(*quantize_fp8(k, E5M2), E5M2),
}


class Recorder:
    """An AttentionFn: exact causal attention (fp32), keeping each layer's post-RoPE q and k."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.layers.append((q.float(), k.float()))
        group = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.float().repeat_interleave(group, 1).transpose(0, 1),
            v.float().repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).to(q.dtype)


def attention_kl(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> float:
    """Mean KL(p || p_hat) of causal attention rows; q [T, H, D], k [T, KVH, D]."""
    group, tokens = q.shape[1] // k.shape[1], q.shape[0]
    hidden = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)

    def log_probs(keys: torch.Tensor) -> torch.Tensor:
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, T, D]
        logits = q.transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5
        return logits.masked_fill(hidden, float("-inf")).log_softmax(-1)

    exact, approx = log_probs(k), log_probs(k_hat)
    return float((exact.exp() * (exact - approx)).masked_fill(hidden, 0).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="auto", max_model_len=max(2048, args.tokens))
    text = "\n".join(p["prompt"] for p in humaneval_problems().values())
    ids = loaded.tokenizer.encode(text)[: args.tokens]
    recorder = Recorder()
    with torch.inference_mode():
        loaded.model(torch.tensor(ids), torch.arange(len(ids)), recorder)
        kl = {name: [attention_kl(q, k, fmt(k)) for q, k in recorder.layers] for name, fmt in FORMATS.items()}
    peaks = [float((k.abs().amax(-1) / k.abs().median(-1).values).mean()) for _, k in recorder.layers]
    print(f"{args.model}, {len(ids)} tokens: attention KL (nats) from quantizing only the keys\n")
    print("| format | layer 0 | sum of layers | sum of layers 1.. | worst layer 1.. |\n|---|---|---|---|---|")
    for name, values in kl.items():
        rest = values[1:]
        print(f"| {name} | {values[0]:.4f} | {sum(values):.4f} | {sum(rest):.4f} | "
              f"{max(rest):.4f} (layer {1 + rest.index(max(rest))}) |")
    print(f"\nkey peak / median magnitude, per row: layer 0 {peaks[0]:.0f}, layers 1.. median "
          f"{sorted(peaks[1:])[len(peaks) // 2 - 1]:.0f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "tokens": len(ids), "cpu": cpu_record(),
                                        "layer_kl": kl, "key_peak_over_median": peaks}, indent=1))


if __name__ == "__main__":
    main()
