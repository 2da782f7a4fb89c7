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

import torch
import torch.nn.functional as F
from torch import Tensor

from threefold.errors import ThreefoldError
from threefold.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from threefold.spec.proposer import Draft, DraftRequest, Proposer

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


class DenseKV:
    """An AttentionFn with a contiguous per-layer cache for one sequence, cut back with `truncate`."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past_k, past_v = self.keys.get(layer_idx), self.values.get(layer_idx)
        keys = k if past_k is None else torch.cat([past_k, k])  # [P + T, kv_heads, head_dim]
        values = v if past_v is None else torch.cat([past_v, v])
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        group = q.shape[1] // k.shape[1]
        offset = keys.shape[0] - q.shape[0]
        mask = torch.arange(keys.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + offset  # [T, P + T]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
                                             values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1)

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

        draft = load_model(config.model_path, dtype=target.precision.name, max_model_len=target.max_model_len)
        check_compatible(target, draft)
        return cls(draft)

    def remove(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.catch_up_seconds = 0.0
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> Draft:
        cache, seen = self.caches.get(request.request_id) or (DenseKV(), [])
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
