"""EAGLE head: top-1 in training, on held-out text, and as the engine feeds it (issue 11).

    tfrun .venv/bin/python benchmarks/eagle_heldout.py --heads ~/.cache/threefold/heads/smollm2-135m-eagle
    tfrun .venv/bin/python benchmarks/eagle_heldout.py --heads OLD_DIR,NEW_DIR   # side by side, same text

Rows (each the head's top-1 agreement with the target's greedy next token):

    train (in-sample)     the recipe's own training sequences (ShareGPT as written, or the target's own
                          answers to train-split prompts for `--data self` heads), fp32 target
    own answers held out  `--data self` heads: the data's held-out sequences (train-split prompts the
                          head never saw), at the answers' positions, bf16 features as trained
    test (held-out)       the same construction on ShareGPT's test split, fp32 and bf16 target
    own output, depth 1   greedy continuations the engine generated (bf16, speculation off) for the
                          benchmark's prompts: the head on the real pairs, at the generated positions
                          only; this is a greedy chain's first-position acceptance
    own output, depth 2   the same, chained once on the head's own feature and drafted token (EAGLE's
                          second draft), counted when both drafts match
    engine k=1 / k=2      the engine's measured acceptance per position, non-adaptive (always drafts k),
                          same prompts: equal to the two rows above if the engine feeds the head as
                          trained
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams
from threefold.spec.heads import EagleHead, load_heads
from threefold.spec.train import causal_attention, load_sequences, sharegpt_token_sequences
from threefold.spec.tree import masked_attention


class _Recording:
    """Causal attention over one sequence that keeps each call's k and v (the head has one layer)."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.k, self.v = k, v
        return causal_attention(layer_idx, q, k, v)


class _Chained:
    """Row t (a drafted pair at position t + 2) sees the real pairs at positions <= t + 1 and itself."""

    def __init__(self, k: Tensor, v: Tensor, scale: float) -> None:
        self.real_k, self.real_v, self.scale = k, v, scale

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rows = q.shape[0]
        visible = torch.cat([torch.ones(rows, rows, dtype=torch.bool).tril(), torch.eye(rows, dtype=torch.bool)], 1)
        return masked_attention(q, torch.cat([self.real_k[:rows], k]), torch.cat([self.real_v[:rows], v]), visible,
                                self.scale)


@torch.inference_mode()
def evaluate(head: EagleHead, model, ids: list[int], first: int = 2) -> tuple[int, int, int]:
    """(rows, depth-1 hits, depth-2 hits) over the head's predictions of tokens ids[first:], teacher forced
    on ids (depth 2 drafts on from the head's own feature and token, as EagleProposer chains)."""
    tokens = torch.tensor(ids)
    features = model(tokens, torch.arange(len(ids)), causal_attention).float()
    labels = model.compute_logits(features.to(model.embed_tokens.weight.dtype)).argmax(-1)  # y_t predicts x_{t+1}
    embed = model.embed_tokens.weight
    rows = len(ids) - 1
    recording = _Recording()
    # Pair j = (f_j, x_{j+1}) at position j + 1 -> f_hat_{j+1}, whose LM head drafts x_{j+2} (label y_{j+1}).
    predicted = head(features[:rows], F.embedding(tokens[1:], embed).float(), torch.arange(1, rows + 1), recording)
    draft1 = model.compute_logits(predicted.to(embed.dtype)).argmax(-1)  # [rows]: drafts for x_{j+2}
    hit1 = draft1 == labels[1:]
    # Depth 2: the pair (f_hat_{j+1}, draft1_j) at position j + 2 -> drafts x_{j+3} (label y_{j+2}).
    chained_rows = rows - 1
    chained = head(predicted[:chained_rows], F.embedding(draft1[:chained_rows], embed).float(),
                   torch.arange(2, chained_rows + 2), _Chained(recording.k, recording.v, head.arch.head_dim ** -0.5))
    draft2 = model.compute_logits(chained.to(embed.dtype)).argmax(-1)
    hit2 = hit1[:chained_rows] & (draft2 == labels[2:])
    keep = slice(max(first - 2, 0), None)  # row j predicts x_{j+2}
    return len(hit1[keep]), int(hit1[keep].sum()), int(hit2[keep].sum())


def rate(head, model, sequences: list[tuple[list[int], int]]) -> dict:
    rows = hits1 = hits2 = 0
    for ids, first in sequences:
        n, h1, h2 = evaluate(head, model, ids, first)
        rows, hits1, hits2 = rows + n, hits1 + h1, hits2 + h2
    return {"rows": rows, "depth1": round(hits1 / rows, 4), "depth2": round(hits2 / rows, 4)}


def generate(loaded, prompts: list[str], max_tokens: int, speculative_config: dict | None = None):
    engine = LLMEngine(loaded, EngineArgs(dtype="auto", kv_cache_memory=1 << 29, max_model_len=2048,
                                          enable_prefix_caching=False, speculative_config=speculative_config))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = (list(output.prompt_token_ids), list(output.outputs[0].token_ids))
    stats = engine.get_stats()
    per_pos = [round(a / stats.spec_num_drafts, 4) for a in stats.spec_num_accepted_tokens_per_pos or []] \
        if stats.spec_num_drafts else []
    return [outputs[i] for i in range(len(prompts))], per_pos


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from spec_decode import humaneval_prompts, sharegpt_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=str(Path.home() / ".cache/threefold/heads/smollm2-135m-eagle"),
                        help="EAGLE head directories, comma-separated: each gets every row, on the same text")
    parser.add_argument("--num-sequences", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's k=1 / k=2 acceptance rows")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    fp32, bf16 = load_model("smollm2-135m", dtype="float32"), load_model("smollm2-135m", dtype="auto")
    test = _split_sequences(fp32.tokenizer, "test", args.num_sequences, 256)
    workloads = {}
    for workload, prompts in (("sharegpt", sharegpt_prompts(bf16.tokenizer, args.num_prompts)),
                              ("humaneval", humaneval_prompts(args.num_prompts))):
        generated, _ = generate(bf16, prompts, args.max_tokens)
        workloads[workload] = (prompts, generated)
    results = {}
    for heads in args.heads.split(","):
        config, head = load_heads(heads, fp32.config, fp32.name, "eagle")
        assert isinstance(head, EagleHead)
        own = config.recipe.get("data") == "self"  # trained on bf16 features: rate it on them
        rows = {f"train (in-sample), {'bf16' if own else 'fp32'}": rate(
                    head, (bf16 if own else fp32).model, _in_sample(fp32.tokenizer, config.recipe, args.num_sequences)),
                "test (held-out), fp32": rate(head, fp32.model, [(s, 2) for s in test]),
                "test (held-out), bf16": rate(head, bf16.model, [(s, 2) for s in test])}
        if own:
            rows["train split, own answers held out, bf16"] = rate(
                head, bf16.model, _self_sequences(config.recipe, held_out=True, num=args.num_sequences))
        for workload, (prompts, generated) in workloads.items():
            sequences = [(p + o, len(p) + 1) for p, o in generated]  # output token 2 on: the first is the prefill's
            rows[f"{workload} own output, bf16"] = rate(head, bf16.model, sequences)
            rows[f"{workload} own output, fp32"] = rate(head, fp32.model, sequences)
            for k in () if args.no_engine else (1, 2):
                spec = {"method": "eagle", "model": heads, "num_speculative_tokens": k, "adaptive": False}
                again, per_pos = generate(bf16, prompts, args.max_tokens, spec)
                assert again == generated, "speculation changed greedy output"
                rows[f"{workload} engine k={k} (acceptance per position)"] = {"per_pos": per_pos}
        print(f"{heads}: {json.dumps(config.recipe.get('tokens'))} tokens, data {config.recipe.get('data')}")
        for name, row in rows.items():
            print(f"  {name:52s} {json.dumps(row)}", flush=True)
        results[heads] = {"recipe": config.recipe, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


def _in_sample(tokenizer, recipe: dict, num: int) -> list[tuple[list[int], int]]:
    """The head's own training sequences: the self-generated ones (counted from the answer's second
    token, as the engine drafts) or the ShareGPT conversations as written."""
    if recipe.get("data") == "self":
        return _self_sequences(recipe, held_out=False, num=num)
    return [(s, 2) for s in sharegpt_token_sequences(tokenizer, recipe.get("tokens", 24000),
                                                     recipe.get("seq_len", 256), recipe.get("seed", 0))[:num]]


def _self_sequences(recipe: dict, held_out: bool, num: int) -> list[tuple[list[int], int]]:
    """From the recipe's data cache: the first `num` training sequences, or the held-out ones."""
    data, _ = load_sequences(Path(recipe["cache"]))
    chosen = data[recipe["sequences"] :][:num] if held_out else data[:num]
    return [(s.token_ids.tolist(), s.answer_start + 1) for s in chosen]


def _split_sequences(tokenizer, split: str, num: int, seq_len: int) -> list[list[int]]:
    """sharegpt_token_sequences' construction on another split."""
    from threefold.bench.sharegpt import dialogue, open_sharegpt

    out = []
    for record in open_sharegpt().iter_records(split, 0):
        messages = [m for user, reply in dialogue(record)
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
        if not messages:
            continue
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                               add_special_tokens=False)[:seq_len]
        if len(ids) >= 8:
            out.append(ids)
        if len(out) == num:
            break
    return out


if __name__ == "__main__":
    main()
