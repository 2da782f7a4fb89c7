"""Train Medusa heads or an EAGLE head for a target, self-distilled from the target.

    python -m threefold.spec.train --method eagle --model smollm2-135m --out heads/smollm2-eagle
    (also `threefold train-draft ...`)

Data: ShareGPT's *train* split (bench/sharegpt.py: benchmarks draw only from
the test split), each conversation rendered with the target's chat template
and cut to `seq_len` tokens. The target runs once over every sequence; its
final hidden states f_t and its own greedy next tokens y_t = argmax p(.|x_<=t)
are the training signal, so the heads learn to predict what the target will
say (self-distillation), not what the ShareGPT author said:

- Medusa head i at t: cross-entropy of lm_head(head_i(f_t)) against y_{t+i+1}.
- EAGLE at t: smooth-L1 of f_hat_{t+1} against f_{t+1}, plus 0.1 x cross-entropy of
  lm_head(f_hat_{t+1}) against y_{t+1} (EAGLE's regression + classification loss).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from threefold.errors import ThreefoldError
from threefold.spec.heads import HEAD_METHODS, EagleHead, HeadsConfig, MedusaHeads, build_heads, save_heads

EAGLE_CLASSIFICATION_WEIGHT = 0.1


@dataclass
class Sequence:
    token_ids: Tensor
    """[T] long."""
    features: Tensor
    """[T, hidden] the target's final hidden states."""
    labels: Tensor
    """[T] long: the target's greedy next token at each position."""


@dataclass
class TrainResult:
    config: HeadsConfig
    heads: torch.nn.Module
    losses: list[float]
    """One per step."""
    accuracy: list[float]
    """Top-1 agreement with the target on the last steps' rows, per head (EAGLE: 1)."""


def causal_attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """An AttentionFn for ONE sequence at positions 0..T-1: plain causal SDPA with GQA."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                         v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)  # [T, heads, head_dim]


def sharegpt_token_sequences(tokenizer, num_tokens: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted ShareGPT train-split conversations, each cut to seq_len, until num_tokens."""
    from threefold.bench.sharegpt import dialogue, open_sharegpt

    sequences, total = [], 0
    for record in open_sharegpt().iter_records("train", seed):
        messages = [m for user, reply in dialogue(record)
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
        if not messages:
            continue
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False) \
            if tokenizer.has_chat_template else "\n".join(m["content"] for m in messages)
        ids = tokenizer.encode(text, add_special_tokens=False)[:seq_len]
        if len(ids) < 8:
            continue
        sequences.append(ids[: num_tokens - total])
        total += len(sequences[-1])
        if total >= num_tokens:
            break
    return sequences


@torch.no_grad()  # not inference_mode: its tensors could not be saved for the heads' backward
def target_sequences(model, token_sequences: list[list[int]]) -> list[Sequence]:
    """Run the (fp32) target once per sequence: its features and greedy next tokens."""
    out = []
    for ids in token_sequences:
        tokens = torch.tensor(ids)
        features = model(tokens, torch.arange(len(ids)), causal_attention)  # [T, hidden]
        labels = model.compute_logits(features).argmax(-1)
        out.append(Sequence(tokens, features.clone(), labels))
    return out


def medusa_loss(heads: MedusaHeads, lm_head: Tensor, seq: Sequence) -> tuple[Tensor, list[float]]:
    """Sum over heads of CE(lm_head(head_i(f_t)), y_{t+i+1}); and each head's top-1 accuracy."""
    outputs = heads(seq.features)  # [num_heads, T, hidden]
    loss, accuracy = seq.features.new_zeros(()), []
    for i in range(heads.num_heads):
        rows = seq.features.shape[0] - i - 1
        if rows <= 0:
            break
        logits = F.linear(outputs[i, :rows], lm_head)
        labels = seq.labels[i + 1 : i + 1 + rows]
        loss = loss + F.cross_entropy(logits, labels)
        accuracy.append(float((logits.argmax(-1) == labels).float().mean()))
    return loss, accuracy


def eagle_loss(head: EagleHead, embed: Tensor, lm_head: Tensor, seq: Sequence) -> tuple[Tensor, list[float]]:
    """Pairs (f_t, x_{t+1}) at x_{t+1}'s position regress f_{t+1}; 0.1 x CE against y_{t+1}."""
    rows = seq.features.shape[0] - 1
    positions = torch.arange(1, rows + 1)
    predicted = head(seq.features[:rows], F.embedding(seq.token_ids[1:], embed), positions, causal_attention)
    regression = F.smooth_l1_loss(predicted, seq.features[1:])
    logits = F.linear(predicted, lm_head)
    classification = F.cross_entropy(logits, seq.labels[1:])
    accuracy = float((logits.argmax(-1) == seq.labels[1:]).float().mean())
    return regression + EAGLE_CLASSIFICATION_WEIGHT * classification, [accuracy]


def train(method: str, loaded, out_dir: Path | None, num_tokens: int = 200_000, seq_len: int = 512,
          steps: int = 2000, lr: float = 1e-3, num_heads: int = 4, seed: int = 0,
          token_sequences: list[list[int]] | None = None, log_every: int = 50,
          save_dtype: str = "float32", command: str | None = None) -> TrainResult:
    """Train heads for `loaded` (a LoadedModel in float32); save them to out_dir if given."""
    if method not in HEAD_METHODS:
        raise ThreefoldError(f"train-draft trains {' or '.join(HEAD_METHODS)} heads, not {method!r}.", param="method")
    if loaded.config.dtype != torch.float32:
        raise ThreefoldError("train heads against the float32 target (load it with dtype='float32').", param="dtype")
    start = time.time()
    torch.manual_seed(seed)
    model = loaded.model
    token_sequences = token_sequences or sharegpt_token_sequences(loaded.tokenizer, num_tokens, seq_len, seed)
    data = target_sequences(model, token_sequences)
    config = HeadsConfig(method, loaded.config.hidden_size, loaded.config.vocab_size, loaded.name,
                         num_heads if method == "medusa" else 1, save_dtype)
    heads = build_heads(config, loaded.config).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _warmup_cosine(s, steps))
    lm_head, embed = model.lm_head.weight, model.embed_tokens.weight
    losses, accuracies = [], []
    for step, seq in zip(range(steps), itertools.cycle(data)):
        if isinstance(heads, MedusaHeads):
            loss, accuracy = medusa_loss(heads, lm_head, seq)
        else:
            assert isinstance(heads, EagleHead)
            loss, accuracy = eagle_loss(heads, embed, lm_head, seq)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        accuracies.append(accuracy)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {losses[-1]:.4f} top-1 {[round(a, 3) for a in accuracy]}", flush=True)
    tail = accuracies[-max(1, len(data)):]
    mean_accuracy = [sum(a[i] for a in tail if i < len(a)) / len(tail) for i in range(len(tail[0]))]
    config.recipe = {"data": "ShareGPT V3 train split, chat template", "sequences": len(data),
                     "tokens": sum(len(s) for s in token_sequences), "seq_len": seq_len, "steps": steps, "lr": lr,
                     "seed": seed, "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                     "train_top1": [round(a, 4) for a in mean_accuracy],
                     "wall_seconds": round(time.time() - start, 1), "command": command}
    heads.eval().requires_grad_(False)
    if out_dir is not None:
        save_heads(Path(out_dir), config, heads)
    return TrainResult(config, heads, losses, mean_accuracy)


def _warmup_cosine(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=HEAD_METHODS)
    parser.add_argument("--model", default="smollm2-135m", help="the target: registry name, GGUF file or HF dir")
    parser.add_argument("--out", required=True, help="directory for model.safetensors + config.json")
    parser.add_argument("--num-tokens", type=int, default=200_000, help="ShareGPT train tokens to distil on")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-heads", type=int, default=4, help="medusa: heads (drafts per step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="stored weights' dtype (bfloat16 halves the files)")


def run(args: argparse.Namespace) -> TrainResult:
    from threefold.model.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    result = train(args.method, loaded, Path(args.out), args.num_tokens, args.seq_len, args.steps, args.lr,
                   args.num_heads, args.seed, save_dtype=args.save_dtype, command=" ".join(sys.argv))
    print(f"saved {args.method} heads to {args.out}: {result.config.recipe}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="threefold train-draft", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
