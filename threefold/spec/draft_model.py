"""Draft-model proposer: a smaller model with the target's tokenizer, in the same process.

Each request keeps the draft's own KV (a dense per-layer cache, the draft being a few
percent of the target's size) in step with the target: a call first feeds the real
tokens added since the last call (the accepted drafts plus the bonus token, or the
whole prompt the first time), then drafts k tokens greedily one at a time, then cuts
its cache back to the real tokens, so rejected drafts never linger. A catch-up longer
than any step's (a new request's prompt) runs as a forward of its own, timed as
`catch_up_seconds`: the adaptive controller prices drafting by what a draft token
costs once the cache is current, not by prompt prefills.
"""

from __future__ import annotations

import time
from types import ModuleType

import torch
from torch import Tensor

from threefold.errors import ThreefoldError
from threefold.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from threefold.spec.proposer import Draft, DraftRequest, Proposer

_EMPTY_LONG = torch.empty(0, dtype=torch.long)

TOKENIZER_PROBE = "def main():\n    print('héllo, wörld', 12345)  # 你好 🙂\n"
"""Text whose ids must agree between draft and target tokenizers (code, accents, CJK, emoji)."""


def check_compatible(target, draft) -> None:
    """The draft must share the target's vocabulary ids, or its drafts are meaningless."""
    param = "speculative_config.model"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ThreefoldError(f"draft model {draft.name} has a vocabulary of {draft.config.vocab_size} rows, the "
                             f"target {target.name} {target.config.vocab_size}: pick a draft from the target's "
                             f"family (same tokenizer).", param=param)
    if draft.tokenizer.encode(TOKENIZER_PROBE) != target.tokenizer.encode(TOKENIZER_PROBE):
        raise ThreefoldError(f"draft model {draft.name} tokenizes text differently from {target.name}; a draft "
                             f"must share the target's tokenizer.", param=param)


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Causal attention of q [T, H, D], the last T of the P positions, over keys / values [P, KVH, D],
    in fp32, each kv head's query heads as the rows of one matmul (no copy of K/V per query head,
    which SDPA's GQA-by-repeat needs: 2.5x this at one row, Qwen-0.5B's shapes). Returns q's dtype."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    qg = q.float().view(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * rows, dim)
    scores = torch.bmm(qg, keys.float().permute(1, 2, 0)).mul_(dim ** -0.5)  # [KVH, group * T, P]
    if rows > 1:  # row t (of each head) sees positions <= P - T + t
        offset = keys.shape[0] - rows
        hidden = torch.arange(keys.shape[0])[None, :] > torch.arange(rows)[:, None] + offset  # [T, P]
        scores.masked_fill_(hidden.repeat(group, 1), float("-inf"))
    out = torch.bmm(scores.softmax(-1), values.float().transpose(0, 1))  # [KVH, group * T, D]
    return out.view(kv_heads, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, heads, dim).to(q.dtype)


class DenseKV:
    """An AttentionFn with a contiguous per-layer cache for one sequence, cut back with `truncate`.
    With `kernels`, a call of a few rows (a draft token, a verify step's catch-up) attends through the
    native paged decode kernel, the cache viewed as one block; otherwise `grouped_attention`."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0
        self.kernels = kernels

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past_k, past_v = self.keys.get(layer_idx), self.values.get(layer_idx)
        keys = k if past_k is None else torch.cat([past_k, k])  # [P + T, kv_heads, head_dim]
        values = v if past_v is None else torch.cat([past_v, v])
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        rows, total = q.shape[0], keys.shape[0]
        if (self.kernels is None or rows > MAX_SPECULATIVE_TOKENS + 1 or q.dtype != keys.dtype
                or q.dtype not in (torch.float32, torch.bfloat16)):
            return grouped_attention(q, keys, values)
        out = torch.empty(q.shape, dtype=q.dtype)
        seq_lens = torch.arange(total - rows + 1, total + 1)  # row t sees the positions up to its own
        self.kernels.paged_decode_attention(out, q, keys.view(1, *keys.shape), values.view(1, *values.shape),
                                            torch.zeros(rows, 1, dtype=torch.long), seq_lens,
                                            q.shape[-1] ** -0.5, 0, _EMPTY_LONG, _EMPTY_LONG)
        return out

    def truncate(self, length: int) -> None:
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][:length]
            self.values[layer] = self.values[layer][:length]
        self.length = min(self.length, length)


class DraftModelProposer(Proposer):
    def __init__(self, draft) -> None:
        self.draft = draft
        self.model = draft.model
        self.caches: dict[str, tuple[DenseKV, list[int]]] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> DraftModelProposer:
        from threefold.model.loader import load_model

        draft = load_model(config.model_path, dtype=target.precision.name, max_model_len=target.max_model_len,
                           quantization=config.quantization)
        check_compatible(target, draft)
        return cls(draft)

    def remove(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.catch_up_seconds = 0.0
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> Draft:
        cache, seen = self.caches.get(request.request_id) or (DenseKV(self.model.kernels), [])
        tokens = list(request.token_ids)
        common = cache.length if tokens[: cache.length] == seen[: cache.length] else 0
        common = min(common, len(tokens) - 1)  # the last real token is always fed: its logits draft x_L
        cache.truncate(common)  # a different history (after preemption) is recomputed from the start
        drafts: list[int] = []
        new = tokens[common:]
        position = common
        if len(new) > MAX_SPECULATIVE_TOKENS + 1:  # more than a verify step can add: a prompt, a new history
            start = time.perf_counter()
            self.model(torch.tensor(new[:-1]), torch.arange(position, position + len(new) - 1), cache)
            cache.length = position = position + len(new) - 1
            new = new[-1:]
            self.catch_up_seconds += time.perf_counter() - start
        for _ in range(request.num_drafts):
            hidden = self.model(torch.tensor(new), torch.arange(position, position + len(new)), cache)
            cache.length = position + len(new)
            drafts.append(int(self.model.compute_logits(hidden[-1:]).argmax()))
            position, new = cache.length, drafts[-1:]
        cache.truncate(len(tokens))
        self.caches[request.request_id] = (cache, tokens)
        return Draft(drafts)
