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

import logging
import time
from types import ModuleType

import torch
from torch import Tensor

from threefold.errors import ThreefoldError
from threefold.model.llama import DecodeStep
from threefold.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from threefold.spec.draft_vocab import draft_model_vocab
from threefold.spec.heads_proposer import DraftLMHead
from threefold.spec.proposer import Draft, DraftRequest, Proposer

logger = logging.getLogger(__name__)

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
    """An AttentionFn over one sequence's per-layer K/V in contiguous buffers [1, capacity, kvh, d]
    (grown by doubling), cut back with `truncate` (no copy). With `kernels`, a forward of a few rows (a
    draft token, a verify step's catch-up) runs every layer in one native call (`native_step`: the
    buffers as one-block paged caches for kernels.decode_layers); a row-by-row call of a few rows
    attends through the native paged decode kernel; anything else through `grouped_attention`."""

    def __init__(self, kernels: ModuleType | None = None, num_layers: int = 0) -> None:
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.filled: list[int] = []
        self.kernels = kernels
        self.num_layers = num_layers
        """Layers of the model (0: unknown); the native step needs every layer's buffer."""
        self.decode_step: DecodeStep | None = None
        """Set by `native_step` for the next forward only (CausalLM.forward reads it)."""

    @property
    def length(self) -> int:
        """Tokens cached (every layer holds as many after a forward)."""
        return self.filled[0] if self.filled else 0

    def _reserve(self, layer: int, total: int) -> None:
        size = self.k[layer].shape[1]
        if total > size:
            grown = max(total, 2 * size)
            for buffers in (self.k, self.v):
                old = buffers[layer]
                buffers[layer] = old.new_empty(1, grown, *old.shape[2:])
                buffers[layer][:, :size] = old

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rows = q.shape[0]
        if layer_idx == len(self.k):  # first call for this layer: its buffers
            for buffers in (self.k, self.v):
                buffers.append(k.new_empty(1, max(256, rows), *k.shape[1:]))
            self.filled.append(0)
        start = self.filled[layer_idx]
        total = start + rows
        self._reserve(layer_idx, total)
        self.k[layer_idx][0, start:total] = k
        self.v[layer_idx][0, start:total] = v
        self.filled[layer_idx] = total
        keys, values = self.k[layer_idx], self.v[layer_idx]
        if (self.kernels is None or rows > MAX_SPECULATIVE_TOKENS + 1 or q.dtype != keys.dtype
                or q.dtype not in (torch.float32, torch.bfloat16)):
            return grouped_attention(q, keys[0, :total], values[0, :total])
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernels.paged_decode_attention(out, q, keys, values, torch.zeros(rows, 1, dtype=torch.long),
                                            torch.arange(start + 1, total + 1), q.shape[-1] ** -0.5, 0,
                                            _EMPTY_LONG, _EMPTY_LONG)
        return out

    def native_step(self, rows: int, dtype: torch.dtype) -> bool:
        """Set `decode_step` for a forward of `rows` new tokens if it can run natively (kernels, every
        layer's buffer in `dtype`, a few rows); the caller then calls `advance(rows)` after it."""
        self.decode_step = None
        if (self.kernels is None or not self.num_layers or len(self.k) != self.num_layers
                or rows > MAX_SPECULATIVE_TOKENS + 1 or self.k[0].dtype != dtype):
            return False
        start = self.length
        for layer in range(self.num_layers):
            self._reserve(layer, start + rows)
        self.decode_step = DecodeStep(self.k, self.v, torch.arange(start, start + rows), [0],
                                      [torch.zeros(rows, 1, dtype=torch.long)],
                                      [torch.arange(start + 1, start + rows + 1)],  # row t sees up to itself
                                      [_EMPTY_LONG], [_EMPTY_LONG], self.k[0].shape[-1] ** -0.5, 0)
        return True

    def advance(self, rows: int) -> None:
        """After a native step: its rows are in every layer's buffer."""
        self.decode_step = None
        self.filled = [n + rows for n in self.filled]

    def truncate(self, length: int) -> None:
        self.filled = [min(n, length) for n in self.filled]


class DraftModelProposer(Proposer):
    def __init__(self, draft, vocab: Tensor | None = None) -> None:
        """vocab: the token ids drafts are chosen from (a draft vocabulary, spec/draft_vocab.py; the
        LM head computes only their rows); None: the whole vocabulary."""
        self.draft = draft
        self.model = draft.model
        self.head = DraftLMHead(draft.model, vocab)
        self.caches: dict[str, tuple[DenseKV, list[int]]] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> DraftModelProposer:
        from threefold.model.loader import load_model

        draft = load_model(config.model_path, dtype=target.precision.name, max_model_len=target.max_model_len,
                           quantization=config.quantization)
        check_compatible(target, draft)
        vocab = draft_model_vocab(draft, config.draft_vocab_size)
        if vocab is not None:
            logger.info("draft model %s drafts over the %d ShareGPT-train-most-frequent of its %d tokens", draft.name,
                        len(vocab), draft.config.vocab_size)
        return cls(draft, vocab)

    def _forward(self, cache: DenseKV, tokens: list[int], position: int) -> Tensor:
        """The draft's hidden states for `tokens` at `position` (= cache.length), their K/V cached."""
        native = self.model.runs_decode_steps and cache.native_step(len(tokens), self.model.config.dtype)
        hidden = self.model(torch.tensor(tokens), torch.arange(position, position + len(tokens)), cache)
        if native:
            cache.advance(len(tokens))
        return hidden

    def remove(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.catch_up_seconds = 0.0
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> Draft:
        cache, seen = self.caches.get(request.request_id) or (DenseKV(self.model.kernels, len(self.model.layers)), [])
        tokens = list(request.token_ids)
        common = cache.length if tokens[: cache.length] == seen[: cache.length] else 0
        common = min(common, len(tokens) - 1)  # the last real token is always fed: its logits draft x_L
        cache.truncate(common)  # a different history (after preemption) is recomputed from the start
        drafts: list[int] = []
        new = tokens[common:]
        position = common
        if len(new) > MAX_SPECULATIVE_TOKENS + 1:  # more than a verify step can add: a prompt, a new history
            start = time.perf_counter()
            self._forward(cache, new[:-1], position)
            position = cache.length
            new = new[-1:]
            self.catch_up_seconds += time.perf_counter() - start
        for _ in range(request.num_drafts):
            hidden = self._forward(cache, new, position)
            drafts.append(self.head.token_ids([int(self.head(hidden[-1:]).argmax())])[0])
            position, new = cache.length, drafts[-1:]
        cache.truncate(len(tokens))
        self.caches[request.request_id] = (cache, tokens)
        return Draft(drafts)
