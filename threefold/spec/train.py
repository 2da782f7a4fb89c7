"""Train Medusa heads or an EAGLE head for a target, self-distilled from the target.

    python -m threefold.spec.train --method eagle --model smollm2-135m --out heads/smollm2-eagle
    (also `threefold train-draft ...`)

Data: ShareGPT's *train* split (bench/sharegpt.py: benchmarks draw only from
the test split), in one of two forms (--data):

- `self` (EAGLE's and Medusa-2's recipe): the target, in the engine (greedy, batched),
  answers the first user turn of --num-prompts conversations; a sequence is the chat
  prompt + the target's own answer, and the loss covers the answer's rows only (what the
  heads are asked to draft in the engine). A few sequences are held out for validation.
- `sharegpt`: the conversations as written (user and author turns), cut to `seq_len`
  tokens, every row in the loss.

The target runs once over every sequence (batched; the result is cached on disk for
`self`, so EAGLE and Medusa share one generation); its final hidden states f_t and its
own greedy next tokens y_t = argmax p(.|x_<=t) are the training signal, so the heads
learn to predict what the target will say (self-distillation):

- Medusa head i at t: cross-entropy of lm_head(head_i(f_t)) against y_{t+i+1}.
- EAGLE at t: smooth-L1 of f_hat_{t+1} against f_{t+1}, plus 0.1 x cross-entropy of
  lm_head(f_hat_{t+1}) against y_{t+1} (EAGLE's regression + classification loss). With
  --depth D > 1 the head also runs on its own outputs, as it drafts a chain, and each
  depth d adds the same loss against f_{t+d} and y_{t+d} (EAGLE-3's training-time test).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from threefold.cpu import has_native_bf16
from threefold.errors import ThreefoldError
from threefold.spec.draft_vocab import rank_tokens
from threefold.spec.heads import (
    HEAD_METHODS,
    EagleHead,
    HeadsConfig,
    MedusaHeads,
    build_heads,
    load_heads,
    save_heads,
)

EAGLE_CLASSIFICATION_WEIGHT = 0.1
DATA_MODES = ("self", "sharegpt")
FORWARD_TOKENS = 4096
"""Padded tokens per batched target forward (features and labels)."""
LOGIT_ROWS = 512
"""Rows per LM-head call when taking the target's argmax (a 49k-wide float row is 200 KB)."""
DRAFT_VOCAB_SIZE = 8192
"""The heads' default draft vocabulary (speculative_config's draft_vocab_size overrides it)."""
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384)


@dataclass
class Sequence:
    token_ids: Tensor
    """[T] long."""
    features: Tensor
    """[T, hidden] the target's final hidden states (its dtype: bf16 from a bf16 target)."""
    labels: Tensor
    """[T] long: the target's greedy next token at each position."""
    answer_start: int = 0
    """Index of the first token the target wrote itself (0: the whole sequence counts). Losses
    cover the rows that draft from there on: feature rows t >= answer_start - 1."""

    @property
    def first_row(self) -> int:
        return max(self.answer_start - 1, 0)


@dataclass
class TrainResult:
    config: HeadsConfig
    heads: torch.nn.Module
    losses: list[float]
    """One per step."""
    accuracy: list[float]
    """Top-1 agreement with the target on the last steps' rows, per head (EAGLE: 1)."""
    val_accuracy: list[float] | None = None
    """The same on the held-out sequences (None without any)."""


def causal_attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """An AttentionFn for ONE sequence at positions 0..T-1: plain causal SDPA with GQA."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                         v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)  # [T, heads, head_dim]


def batched_causal_attention(length: int):
    """An AttentionFn for B right-padded sequences of `length` rows each, flattened to [B * length]:
    causal within each sequence (a real row never sees its sequence's padding, which comes after it)."""
    def attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads = q.shape[1]
        out = F.scaled_dot_product_attention(_per_sequence(q, length, heads), _per_sequence(k, length, heads),
                                             _per_sequence(v, length, heads), is_causal=True)
        return _flattened(out)
    return attention


def _per_sequence(x: Tensor, length: int, heads: int) -> Tensor:
    """[B * length, kv_heads, head_dim] rows -> [B, heads, length, head_dim], GQA's KV heads repeated."""
    return x.view(-1, length, x.shape[1], x.shape[2]).repeat_interleave(heads // x.shape[1], 2).transpose(1, 2)


def _flattened(out: Tensor) -> Tensor:
    """[B, heads, length, head_dim] -> [B * length, heads, head_dim]."""
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


def _conversation_messages(record) -> list[dict]:
    from threefold.bench.sharegpt import dialogue

    return [m for user, reply in dialogue(record)
            for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]


def sharegpt_token_sequences(tokenizer, num_tokens: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted ShareGPT train-split conversations, each cut to seq_len, until num_tokens."""
    from threefold.bench.sharegpt import open_sharegpt

    sequences, total = [], 0
    for record in open_sharegpt().iter_records("train", seed):
        messages = _conversation_messages(record)
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


def sharegpt_chat_prompts(tokenizer, split: str, num: int, seed: int = 0, max_chars: int = 2000) -> list[str]:
    """First user turns of `split`'s conversations under the chat template, as the benchmarks
    build them (benchmarks/spec_decode.py: the test split, seed 0, under 2000 characters)."""
    from threefold.bench.sharegpt import dialogue, open_sharegpt

    prompts = []
    for record in open_sharegpt().iter_records(split, seed):
        turns = dialogue(record)
        if turns and len(turns[0][0]) < max_chars:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": turns[0][0]}]))
            if len(prompts) == num:
                break
    return prompts


def self_generated_sequences(loaded, prompts: list[str], max_new_tokens: int,
                             chunk: int = 256) -> list[tuple[list[int], int]]:
    """The target's own greedy answers, from the engine, `chunk` prompts at a time (a progress line
    each): (prompt ids + answer ids, answer start) per prompt."""
    from threefold.engine.llm import LLM
    from threefold.engine.llm_engine import EngineArgs, LLMEngine
    from threefold.sample.params import SamplingParams

    dtype = "float32" if loaded.config.dtype == torch.float32 else "auto"
    llm = LLM.from_engine(LLMEngine(loaded, EngineArgs(dtype=dtype, kv_cache_memory=1 << 30, max_model_len=2048,
                                                       max_num_seqs=128, enable_prefix_caching=False)))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    out, start, answered = [], time.time(), 0
    for first in range(0, len(prompts), chunk):
        for o in llm.generate(prompts[first : first + chunk], params):
            out.append((list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)))
            answered += len(o.outputs[0].token_ids)
        print(f"generated {len(out)}/{len(prompts)} answers, {answered} tokens "
              f"({answered / (time.time() - start):.0f} tok/s)", flush=True)
    return out


@torch.no_grad()  # not inference_mode: its tensors could not be saved for the heads' backward
def target_sequences(model, token_sequences: list[list[int]], answer_starts: list[int] | None = None,
                     forward_tokens: int = FORWARD_TOKENS) -> list[Sequence]:
    """Run the target once over every sequence, several right-padded sequences a forward: its
    features (in its own dtype) and greedy next tokens."""
    starts = answer_starts or [0] * len(token_sequences)
    out: list[Sequence | None] = [None] * len(token_sequences)
    order = sorted(range(len(token_sequences)), key=lambda i: len(token_sequences[i]))
    while order:
        length = len(token_sequences[order[-1]])
        batch = [order.pop() for _ in range(min(len(order), max(1, forward_tokens // length)))]
        tokens = torch.zeros(len(batch), length, dtype=torch.long)
        for row, i in enumerate(batch):
            tokens[row, : len(token_sequences[i])] = torch.tensor(token_sequences[i])
        features = model(tokens.view(-1), torch.arange(length).repeat(len(batch)), batched_causal_attention(length))
        labels = torch.cat([model.compute_logits(chunk, float32=False).argmax(-1)
                            for chunk in features.split(LOGIT_ROWS)]).view(len(batch), length)
        features = features.view(len(batch), length, -1)
        for row, i in enumerate(batch):
            n = len(token_sequences[i])
            out[i] = Sequence(tokens[row, :n].clone(), features[row, :n].clone(), labels[row, :n].clone(), starts[i])
    return [s for s in out if s is not None]


def self_distillation_data(loaded, num_prompts: int, max_new_tokens: int, seed: int = 0,
                           cache: Path | None = None) -> tuple[list[Sequence], dict]:
    """Prompts from ShareGPT's train split, answered by `loaded` (the target, in the engine), then its
    features over prompt + answer. With `cache`, read from there if it exists, else written there."""
    if cache is not None and cache.is_file():
        return load_sequences(cache)
    start = time.time()
    prompts = sharegpt_chat_prompts(loaded.tokenizer, "train", num_prompts, seed)
    generated = self_generated_sequences(loaded, prompts, max_new_tokens)
    generate_seconds = time.time() - start
    data = target_sequences(loaded.model, [ids for ids, _ in generated], [a for _, a in generated])
    info = {"data": "self", "target": loaded.name, "target_dtype": str(loaded.config.dtype).removeprefix("torch."),
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "seed": seed,
            "generate_seconds": round(generate_seconds, 1),
            "feature_seconds": round(time.time() - start - generate_seconds, 1)}
    if cache is not None:
        save_sequences(cache, data, info)
    return data, info


def save_sequences(path: Path, data: list[Sequence], info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(s.token_ids) for s in data])
    tensors = {"token_ids": torch.cat([s.token_ids for s in data]).int(), "lengths": lengths,
               "answer_starts": torch.tensor([s.answer_start for s in data]),
               "features": torch.cat([s.features for s in data]).contiguous(),
               "labels": torch.cat([s.labels for s in data]).int()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"info": json.dumps(info)})
    tmp.replace(path)


def load_sequences(path: Path) -> tuple[list[Sequence], dict]:
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        info = json.loads(f.metadata()["info"])
    lengths = tensors["lengths"].tolist()
    split = lambda name: tensors[name].split(lengths)  # noqa: E731
    data = [Sequence(ids.long(), features, labels.long(), int(start))
            for ids, features, labels, start in zip(split("token_ids"), split("features"), split("labels"),
                                                   tensors["answer_starts"].tolist(), strict=True)]
    return data, info


@dataclass
class Batch:
    """B sequences right-padded to T rows; the heads run over all B x T rows flattened."""

    tokens: Tensor
    """[B, T] long."""
    features: Tensor
    """[B, T, hidden] float32."""
    labels: Tensor
    """[B, T] long."""
    lengths: Tensor
    """[B]"""
    first_rows: Tensor
    """[B]"""

    @classmethod
    def of(cls, sequences: list[Sequence]) -> Batch:
        length = max(len(s.token_ids) for s in sequences)
        tokens = torch.zeros(len(sequences), length, dtype=torch.long)
        labels = torch.zeros_like(tokens)
        features = torch.zeros(len(sequences), length, sequences[0].features.shape[-1])
        for row, s in enumerate(sequences):
            n = len(s.token_ids)
            tokens[row, :n], labels[row, :n], features[row, :n] = s.token_ids, s.labels, s.features
        return cls(tokens, features, labels, torch.tensor([len(s.token_ids) for s in sequences]),
                   torch.tensor([s.first_row for s in sequences]))

    def rows(self, offset: int) -> Tensor:
        """[B, T] bool: feature rows t counted for a label `offset` positions on (t + offset < length)."""
        t = torch.arange(self.tokens.shape[1])[None]
        return (t >= self.first_rows[:, None]) & (t + offset < self.lengths[:, None])


Hits = list[tuple[int, int]]
"""Per head: (rows whose top-1 matched the target, rows)."""


def medusa_loss(heads: MedusaHeads, lm_head: Tensor, batch: Batch) -> tuple[Tensor, Hits]:
    """Sum over heads of CE(lm_head(head_i(f_t)), y_{t+i+1}) over the counted rows; each head's hits."""
    size, length, hidden = batch.features.shape
    outputs = heads(batch.features.view(-1, hidden)).view(heads.num_heads, size, length, hidden)
    loss, hits = batch.features.new_zeros(()), []
    for i in range(heads.num_heads):
        rows = batch.rows(i + 1)
        if not rows.any():
            break
        shifted = torch.zeros_like(batch.labels)
        shifted[:, : length - i - 1] = batch.labels[:, i + 1 :]
        logits = F.linear(outputs[i][rows], lm_head).float()
        labels = shifted[rows]
        loss = loss + F.cross_entropy(logits, labels)
        hits.append((int((logits.argmax(-1) == labels).sum()), len(labels)))
    return loss, hits


class _TrainTimeAttention:
    """AttentionFn over the head's passes so far, for B right-padded sequences of `length` rows each
    (flattened to [B * length]), keeping each pass's keys and values: pass 1 is causal over its own
    rows; pass d > 1's row t sees pass 1's rows 0..t (the real pairs) and row t of passes 2..d (its
    drafted ancestors and itself), as a drafted chain node does in EagleProposer._expand."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads, length = q.shape[1], self.length
        self.keys.append(_per_sequence(k, length, heads))
        self.values.append(_per_sequence(v, length, heads))
        queries = _per_sequence(q, length, heads)
        if len(self.keys) == 1:
            return _flattened(F.scaled_dot_product_attention(queries, self.keys[0], self.values[0], is_causal=True))
        own = torch.eye(length, dtype=torch.bool)
        mask = torch.cat([torch.ones(length, length, dtype=torch.bool).tril(), *[own] * (len(self.keys) - 1)], 1)
        return _flattened(F.scaled_dot_product_attention(queries, torch.cat(self.keys, 2), torch.cat(self.values, 2),
                                                         attn_mask=mask))


def _ahead(x: Tensor, offset: int, rows: int) -> Tensor:
    """x[:, offset : offset + rows], zero-padded where that runs past the end."""
    out = x.new_zeros((x.shape[0], rows, *x.shape[2:]))
    n = min(rows, max(0, x.shape[1] - offset))
    out[:, :n] = x[:, offset : offset + n]
    return out


def eagle_passes(head: EagleHead, embed: Tensor, batch: Batch, depth: int = 1) -> list[Tensor]:
    """The head's outputs [B, T - 1, hidden] at each depth 1..depth. Pass 1's row t is the real pair
    (f_t, x_{t+1}) at x_{t+1}'s position, predicting f_{t+1}: what drafts the first token. Pass d's row
    t is the pair (pass d - 1's output at row t, x_{t+d}) at position t + d, predicting f_{t+d}: the
    d-th token of a chain drafted after position t + 1, fed the true tokens (EAGLE-3's training-time
    test; depth 1 is EAGLE-1's training)."""
    size, length, hidden = batch.features.shape
    pairs = length - 1
    attention = _TrainTimeAttention(pairs)
    inputs, outputs = batch.features[:, :pairs], []
    for d in range(1, depth + 1):
        tokens = F.embedding(_ahead(batch.tokens, d, pairs), embed).reshape(-1, hidden)
        positions = (torch.arange(pairs) + d).repeat(size)
        inputs = head(inputs.reshape(-1, hidden), tokens, positions, attention).view(size, pairs, hidden)
        outputs.append(inputs)
    return outputs


def eagle_loss(head: EagleHead, embed: Tensor, lm_head: Tensor, batch: Batch, depth: int = 1) -> tuple[Tensor, Hits]:
    """Per depth d (eagle_passes): smooth-L1 of the output against f_{t+d}, plus 0.1 x CE of its LM-head
    logits against y_{t+d}, summed over the depths; the hits per depth."""
    pairs = batch.features.shape[1] - 1
    loss, hits = batch.features.new_zeros(()), []
    for d, predicted in enumerate(eagle_passes(head, embed, batch, depth), start=1):
        rows = batch.rows(d)[:, :pairs]
        if not rows.any():
            break
        chosen = predicted[rows].float()
        regression = F.smooth_l1_loss(chosen, _ahead(batch.features, d, pairs)[rows])
        logits = F.linear(chosen, lm_head).float()
        labels = _ahead(batch.labels, d, pairs)[rows]
        loss = loss + regression + EAGLE_CLASSIFICATION_WEIGHT * F.cross_entropy(logits, labels)
        hits.append((int((logits.argmax(-1) == labels).sum()), len(labels)))
    return loss, hits


def _rates(hits: list[Hits]) -> list[float]:
    heads = max(len(h) for h in hits)
    return [sum(h[i][0] for h in hits if i < len(h)) / max(1, sum(h[i][1] for h in hits if i < len(h)))
            for i in range(heads)]


def _batches(data: list[Sequence], batch_size: int, generator: random.Random):
    """Endless epochs; each a shuffle of `data`, cut into batches of similar lengths (less padding)."""
    while True:
        order = list(range(len(data)))
        generator.shuffle(order)
        batches = []
        for pool in range(0, len(order), 32 * batch_size):
            chunk = sorted(order[pool : pool + 32 * batch_size], key=lambda i: len(data[i].token_ids))
            batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
        generator.shuffle(batches)
        for batch in batches:
            yield [data[i] for i in batch]


def train(method: str, loaded, out_dir: Path | None, num_tokens: int = 200_000, seq_len: int = 512,
          steps: int = 2000, lr: float = 1e-3, num_heads: int = 4, seed: int = 0,
          token_sequences: list[list[int]] | None = None, log_every: int = 50,
          save_dtype: str = "float32", command: str | None = None, data: list[Sequence] | None = None,
          data_info: dict | None = None, batch_size: int = 1, val_fraction: float = 0.0,
          autocast: bool | None = None, draft_vocab_size: int = DRAFT_VOCAB_SIZE,
          val_every: int = 0, depth: int = 1, init: Path | None = None) -> TrainResult:
    """Train heads for `loaded` (a LoadedModel in float32); save them to out_dir if given. The data:
    `data` (e.g. self_distillation_data's), else `token_sequences`, else ShareGPT conversations.
    autocast: matmuls in bf16 (float32 weights, losses and optimizer), by default where the CPU
    has native bf16 (most of a step is the LM head over every counted row). draft_vocab_size: the
    heads' default draft vocabulary, the tokens the target wrote most in the training rows
    (0: the whole vocabulary). val_every: also score the held-out rows every this many steps (the
    curve goes in the recipe), to see whether more steps would still pay. depth: EAGLE trains on its
    own outputs this many drafts deep (eagle_passes; 1: EAGLE-1's loss). init: start from the heads
    saved there (e.g. EAGLE-1 heads, trained on further at a greater depth) instead of fresh ones."""
    if method not in HEAD_METHODS:
        raise ThreefoldError(f"train-draft trains {' or '.join(HEAD_METHODS)} heads, not {method!r}.", param="method")
    if depth < 1 or (depth > 1 and method != "eagle"):
        raise ThreefoldError(f"depth={depth}: EAGLE trains 1 or more drafts deep; Medusa heads take depth 1 "
                             f"(each head is one position).", param="depth")
    if loaded.config.dtype != torch.float32:
        raise ThreefoldError("train heads against the float32 target (load it with dtype='float32').", param="dtype")
    start = time.time()
    torch.manual_seed(seed)
    model = loaded.model
    if data is None:
        token_sequences = token_sequences or sharegpt_token_sequences(loaded.tokenizer, num_tokens, seq_len, seed)
        data = target_sequences(model, token_sequences)
        data_info = {"data": "ShareGPT V3 train split, chat template", "seq_len": seq_len}
    held_out = min(len(data) - 1, round(val_fraction * len(data)))
    train_data, val_data = data[: len(data) - held_out], data[len(data) - held_out :]
    config = HeadsConfig(method, loaded.config.hidden_size, loaded.config.vocab_size, loaded.name,
                         num_heads if method == "medusa" else 1, save_dtype)
    heads = build_heads(config, loaded.config)
    if init is not None:
        init_config, trained = load_heads(init, loaded.config, loaded.name, method)
        if method == "medusa" and init_config.num_heads != num_heads:
            raise ThreefoldError(f"{init} holds {init_config.num_heads} Medusa heads, not {num_heads}.", param="init")
        heads.load_state_dict(trained.state_dict())
    heads = heads.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _warmup_cosine(s, steps))
    lm_head, embed = model.lm_head.weight, model.embed_tokens.weight

    autocast = has_native_bf16() if autocast is None else autocast
    if autocast:  # cast once, not in every step's forward and backward (the LM head is 28M weights for SmolLM2)
        lm_head = lm_head.to(torch.bfloat16)

    def loss_of(batch: Batch) -> tuple[Tensor, Hits]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if isinstance(heads, MedusaHeads):
                return medusa_loss(heads, lm_head, batch)
            assert isinstance(heads, EagleHead)
            return eagle_loss(heads, embed, lm_head, batch, depth)

    def validate() -> list[float]:
        heads.eval()
        with torch.no_grad():
            rates = _rates([loss_of(Batch.of(val_data[i : i + batch_size]))[1]
                            for i in range(0, len(val_data), batch_size)])
        heads.train()
        return rates

    losses, hits, val_curve = [], [], []
    batches = _batches(train_data, batch_size, random.Random(seed))
    for step in range(steps):
        loss, step_hits = loss_of(Batch.of(next(batches)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        hits.append(step_hits)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {losses[-1]:.4f} top-1 {[round(a, 3) for a in _rates([step_hits])]} "
                  f"({time.time() - start:.0f} s)", flush=True)
        if val_data and val_every and (step + 1) % val_every == 0 and step + 1 < steps:
            val_curve.append((step + 1, [round(a, 4) for a in validate()]))
            print(f"step {step + 1}: held-out top-1 {val_curve[-1][1]}", flush=True)
    val_accuracy = validate() if val_data else None
    heads.eval().requires_grad_(False)
    mean_accuracy = _rates(hits[-max(1, math.ceil(len(train_data) / batch_size)):])  # about the last epoch
    rows = sum(max(0, len(s.token_ids) - s.first_row - 1) for s in train_data)
    config.recipe = {**(data_info or {}), "sequences": len(train_data), "held_out_sequences": len(val_data),
                     "tokens": sum(len(s.token_ids) for s in train_data), "loss_rows": rows,
                     "batch_size": batch_size, "autocast_bf16": autocast,
                     "steps": steps, "epochs": round(steps * batch_size / len(train_data), 2),
                     "lr": lr, "seed": seed, **({"depth": depth} if method == "eagle" else {}),
                     **({"init": str(init)} if init is not None else {}),
                     "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                     "train_top1": [round(a, 4) for a in mean_accuracy],
                     "val_top1": [round(a, 4) for a in val_accuracy] if val_accuracy else None,
                     **({"val_top1_curve": val_curve} if val_curve else {}),
                     "wall_seconds": round(time.time() - start, 1), "command": command}
    draft_vocab = rank_draft_vocab(train_data, config.vocab_size)
    config.draft_vocab_size = min(draft_vocab_size, len(draft_vocab))
    config.recipe["draft_vocab"] = {"distinct_tokens": len(draft_vocab), "coverage_train": draft_vocab_coverage(
        draft_vocab, train_data, config.vocab_size),
        "coverage_held_out": draft_vocab_coverage(draft_vocab, val_data, config.vocab_size) if val_data else None}
    if out_dir is not None:
        save_heads(Path(out_dir), config, heads, draft_vocab)
    return TrainResult(config, heads, losses, mean_accuracy, val_accuracy)


def _answer_tokens(data: list[Sequence]) -> Tensor:
    """What the heads are asked to draft: the target's greedy tokens on every loss row."""
    rows = [s.labels[s.first_row :] for s in data]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)


def rank_draft_vocab(data: list[Sequence], vocab_size: int) -> Tensor:
    """Token ids the target wrote on the loss rows, most often first (ties: lower id first); tokens
    it never wrote are left out. The heads' draft vocabulary is a prefix of this (FR-Spec)."""
    order, seen = rank_tokens(_answer_tokens(data), vocab_size)
    return order[:seen]


def draft_vocab_coverage(ranked: Tensor, data: list[Sequence], vocab_size: int,
                         sizes=COVERAGE_SIZES) -> dict[int, float]:
    """Share of the loss rows' target tokens inside the first N ranked ids, per N: the ceiling of
    depth-1 acceptance a draft vocabulary of N leaves."""
    tokens = _answer_tokens(data)
    rank = torch.full((vocab_size,), vocab_size)
    rank[ranked] = torch.arange(len(ranked))
    return {n: round(float((rank[tokens] < n).float().mean()), 4) if len(tokens) else 0.0 for n in sizes}


def _warmup_cosine(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=HEAD_METHODS)
    parser.add_argument("--model", default="smollm2-135m", help="the target: registry name, GGUF file or HF dir")
    parser.add_argument("--out", required=True, help="directory for model.safetensors + config.json")
    parser.add_argument("--data", default="sharegpt", choices=DATA_MODES,
                        help="self: the target's own answers to ShareGPT-train prompts (generated by the engine); "
                             "sharegpt: the conversations as written")
    parser.add_argument("--num-prompts", type=int, default=1200, help="self: prompts the target answers")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="self: longest answer")
    parser.add_argument("--data-cache", default=None,
                        help="self: the generated data's file (default $THREEFOLD_HOME/heads/data/<target>-self-"
                             "<prompts>x<max new tokens>-seed<seed>.safetensors; reused if present)")
    parser.add_argument("--val-fraction", type=float, default=0.03, help="self: sequences held out for validation")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--num-tokens", type=int, default=200_000, help="sharegpt: train tokens to distil on")
    parser.add_argument("--seq-len", type=int, default=512, help="sharegpt: cut conversations to this")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-heads", type=int, default=4, help="medusa: heads (drafts per step)")
    parser.add_argument("--draft-vocab-size", type=int, default=DRAFT_VOCAB_SIZE,
                        help="the heads' default draft vocabulary: the N tokens the target wrote most in the "
                             "training rows (0: the whole vocabulary)")
    parser.add_argument("--depth", type=int, default=1,
                        help="eagle: also train on the head's own outputs this many drafts deep (EAGLE-3's "
                             "training-time test; 1: EAGLE-1's loss)")
    parser.add_argument("--init", default=None,
                        help="start from the heads in this directory (trained for the same target) instead of fresh "
                             "ones")
    parser.add_argument("--val-every", type=int, default=0,
                        help="self: score the held-out sequences every this many steps too (0: at the end only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="stored weights' dtype (bfloat16 halves the files)")


def run(args: argparse.Namespace) -> TrainResult:
    from threefold.model.loader import load_model

    loaded = load_model(args.model, dtype="float32")
    data, info, val_fraction = None, None, 0.0
    if args.data == "self":
        from threefold.env import Env

        cache = Path(args.data_cache).expanduser() if args.data_cache else Env.read().home / "heads" / "data" / (
            f"{loaded.name}-self-{args.num_prompts}x{args.max_new_tokens}-seed{args.seed}.safetensors")
        # The engine's dtype (bf16 where the CPU has it): the features and greedy tokens the heads will see.
        data, info = self_distillation_data(load_model(args.model, dtype="auto"), args.num_prompts,
                                            args.max_new_tokens, args.seed, cache)
        info["cache"] = str(cache)
        val_fraction = args.val_fraction
    result = train(args.method, loaded, Path(args.out), args.num_tokens, args.seq_len, args.steps, args.lr,
                   args.num_heads, args.seed, save_dtype=args.save_dtype, command=" ".join(sys.argv), data=data,
                   data_info=info, batch_size=args.batch_size, val_fraction=val_fraction,
                   draft_vocab_size=args.draft_vocab_size, val_every=args.val_every,
                   depth=args.depth, init=Path(args.init).expanduser() if args.init else None)
    print(f"saved {args.method} heads to {args.out}: {result.config.recipe}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="threefold train-draft", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
