"""Proposers over trained heads: Medusa (chain or static sparse tree) and EAGLE (chain or
EAGLE-2 dynamic tree). Both read the target's final hidden states from DraftRequest.

Index convention: the sequence is x_0 .. x_{L-1}; the target has computed f_0 .. f_{L-2}
(f_t is the hidden state whose LM-head output predicted x_{t+1}); x_{L-1} was just sampled.

- Medusa head i on f_{L-2} drafts x_{L+i}.
- EAGLE keeps a small KV cache of its one layer over the real pairs (f_j, x_{j+1}), j <= L-2,
  at x_{j+1}'s position; the last pair's output f_hat_{L-1} drafts x_L, and each drafted
  token extends the chain (or tree) with the pair (f_hat, x_hat). Drafted pairs never enter
  the cache: the next call replaces them with the target's real features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from threefold.errors import ThreefoldError
from threefold.model.llama import Linear, use_kernels_in
from threefold.spec.config import SpeculativeConfig
from threefold.spec.heads import EagleHead, MedusaHeads, draft_vocab_ids, load_heads
from threefold.spec.proposer import ROOT, Draft, DraftRequest, Proposer
from threefold.spec.tree import eagle2_tree, medusa_tree, node_depths

logger = logging.getLogger(__name__)


class DraftLMHead:
    """The LM head drafts are read through: the target's own, or only its rows for a draft
    vocabulary (FR-Spec, EAGLE-3: the tokens the target writes most). SmolLM2's LM head is 28M of
    its 135M weights, so over the whole vocabulary it is most of what a drafted token costs.
    Logits come in the draft vocabulary's index space; `token_ids` maps indices to token ids."""

    def __init__(self, target_model, ids: Tensor | None) -> None:
        lm_head = target_model.lm_head
        self.dtype = lm_head.weight.dtype
        self.ids = ids
        self.linear = lm_head if ids is None else lm_head.rows(ids)
        self._ids = None if ids is None else ids.tolist()

    @property
    def size(self) -> int:
        return self.linear.out_features

    def __call__(self, features: Tensor) -> Tensor:
        """[..., hidden] -> float32 [..., size] (as rows: the few-row kernel takes 2-D calls)."""
        rows = features.reshape(-1, features.shape[-1]).to(self.dtype)
        return self.linear(rows).float().view(*features.shape[:-1], self.size)

    def token_ids(self, indices: list[int]) -> list[int]:
        return indices if self._ids is None else [self._ids[i] for i in indices]

    def token_tensor(self, indices: Tensor) -> Tensor:
        return indices if self.ids is None else self.ids[indices]


def for_inference(heads: nn.Module, target_model) -> nn.Module:
    """The heads as the target runs: in its compute dtype, every Linear prepacked for oneDNN and on
    the few-row kernel where the target's are, norms and silu-and-mul native where the target's are.
    Trained heads load as fp32 modules, whose one-row matmuls (MKL) took ~175 us a projection on the
    avx512 EPYC: most of a drafted token's time."""
    dtype = target_model.config.dtype
    heads = heads.to(dtype)
    for module in heads.modules():
        if isinstance(module, Linear):
            module.pack()
    use_kernels_in(heads, target_model.kernels, dtype)
    return heads


def _draft_lm_head(config: SpeculativeConfig, heads_config, target) -> DraftLMHead:
    head = DraftLMHead(target.model, draft_vocab_ids(config.model_path, heads_config, config.draft_vocab_size))
    logger.info("%s heads draft over %d of the %d tokens (draft_vocab_size=%s)", config.method, head.size,
                heads_config.vocab_size, config.draft_vocab_size)
    return head


class MedusaProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, lm_head: DraftLMHead, paths: list[tuple[int, ...]] | None) -> None:
        self.heads, self.lm_head, self.paths = heads, lm_head, paths

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> MedusaProposer:
        heads_config, heads = load_heads(config.model_path, target.config, target.name, "medusa")
        assert isinstance(heads, MedusaHeads)  # load_heads checked the method
        for_inference(heads, target.model)
        if config.num_speculative_tokens > heads.num_heads:
            raise ThreefoldError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the "
                                 f"{heads.num_heads} Medusa heads in {config.model}.",
                                 param="speculative_config.num_speculative_tokens")
        return cls(heads, _draft_lm_head(config, heads_config, target),
                   config.tree_paths() if config.speculative_token_tree else None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        last = [(i, r.hidden_states[-1]) for i, r in enumerate(requests)
                if r.hidden_states is not None and len(r.hidden_states)]
        if not last:
            return drafts
        rows = [i for i, _ in last]
        features = torch.stack([h for _, h in last]).to(self.lm_head.dtype)  # [M, hidden]
        logits = self.lm_head(self.heads(features))  # [num_heads, M, draft vocab]
        if self.paths is None:
            choices = self.lm_head.token_tensor(logits.argmax(-1)).T.tolist()  # [M, num_heads]
            for m, i in enumerate(rows):
                drafts[i] = Draft(choices[m][: requests[i].num_drafts])
            return drafts
        top_ranks = self.lm_head.token_tensor(logits.topk(1 + max(max(p) for p in self.paths), dim=-1).indices)
        for m, i in enumerate(rows):
            paths = [p for p in self.paths if len(p) <= requests[i].num_drafts]
            drafts[i] = medusa_tree(paths, top_ranks[:, m])
        return drafts


class _EagleState:
    """One request's cache of the head's keys and values (float32: the batched matmuls over views of it
    take MKL's strided path; bf16 ones copied): rows [0, length) are the real pairs so far,
    in position order; the rows after them hold this step's drafted nodes (overwritten each step).
    Kept [kv_heads, capacity, head_dim], grown by doubling, so a step appends in place and attention
    reads a view, instead of copying the context per drafted token."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.keys = torch.empty(kv_heads, 64, head_dim, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self.positions = torch.empty(64, dtype=torch.long)
        """Each real pair's position (x_{j+1}'s): gaps are fine (prefix-cache hits)."""
        self.length = 0
        self.root_feature: Tensor | None = None
        """f_hat_{L-1}: the head's output on the newest real pair."""
        self.root_position = -1

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows in all."""
        capacity = self.keys.shape[1]
        if rows <= capacity:
            return
        while capacity < rows:
            capacity *= 2
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], capacity, old.shape[2])
            grown[:, : self.length] = old[:, : self.length]
            setattr(self, name, grown)
        positions = self.positions.new_empty(capacity)
        positions[: self.length] = self.positions[: self.length]
        self.positions = positions


class _SlotAttention:
    """AttentionFn for rows written at slots [start, start + rows) of a _EagleState: stores their keys
    and values there, then attends over slots [0, start + rows) where `visible` [rows, start + rows]
    allows (None: all of them)."""

    def __init__(self, state: _EagleState, start: int, visible: Tensor | None, scale: float) -> None:
        self.state, self.start, self.visible, self.scale = state, start, visible, scale

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state, end = self.state, self.start + q.shape[0]
        state.reserve(end)
        state.keys[:, self.start : end] = k.transpose(0, 1)
        state.values[:, self.start : end] = v.transpose(0, 1)
        return _gqa_attention(q, state.keys[:, :end], state.values[:, :end], self.visible, self.scale)


def _gqa_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """q [R, Hq, D] over keys/values [Hkv, S, D] where visible [R, S] allows (None: all): two batched
    matmuls over the KV heads, each query head reading its group's keys in place (no repeated copy
    of the context), in the keys' dtype."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    grouped = q.view(rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, rows * group, dim)
    scores = torch.bmm(grouped.to(keys.dtype), keys.transpose(1, 2)) * scale  # [Hkv, R * group, S]
    if visible is not None:
        scores.masked_fill_(~visible.repeat_interleave(group, 0)[None], float("-inf"))
    out = torch.bmm(scores.softmax(-1), values)  # [Hkv, R * group, D]
    return out.view(kv_heads, rows, group, dim).transpose(0, 1).reshape(rows, heads, dim).to(q.dtype)


class EagleProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target_model, top_k: int = 1, total_tokens: int | None = None,
                 lm_head: DraftLMHead | None = None) -> None:
        self.head, self.target_model = head, target_model
        self.lm_head = lm_head or DraftLMHead(target_model, None)
        self.top_k, self.total_tokens = top_k, total_tokens
        self.scale = head.arch.head_dim ** -0.5
        self.dtype = head.fc.weight.dtype
        self.states: dict[str, _EagleState] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> EagleProposer:
        heads_config, head = load_heads(config.model_path, target.config, target.name, "eagle")
        assert isinstance(head, EagleHead)  # load_heads checked the method
        for_inference(head, target.model)
        return cls(head, target.model, config.tree_top_k, config.tree_total_tokens,
                   _draft_lm_head(config, heads_config, target))

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: DraftRequest) -> Draft:
        state = self._absorb(request)
        last = len(request.token_ids) - 1
        if state.root_feature is None or state.root_position != last:
            return Draft([])  # no fresh feature for the last token (e.g. a full prefix hit)
        root_logprobs = torch.log_softmax(self.lm_head(state.root_feature), -1)
        top_k = self.top_k
        total = request.num_drafts if top_k == 1 else (self.total_tokens or request.num_drafts * top_k)
        features: dict[int, Tensor] = {}
        slots: dict[int, int] = {}

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            return self._expand(state, last, frontier, tokens, parents, features, slots)

        draft = eagle2_tree(root_logprobs, expand, request.num_drafts, top_k, total)  # draft-vocabulary indices
        token_ids = self.lm_head.token_ids(draft.token_ids)
        return Draft(token_ids) if top_k == 1 else Draft(token_ids, draft.parent_ids)

    def _absorb(self, request: DraftRequest) -> _EagleState:
        """Run the head over the newly computed real pairs and cache their keys/values."""
        state = self.states.get(request.request_id)
        if state is None:
            arch = self.head.arch
            state = self.states[request.request_id] = _EagleState(arch.num_kv_heads, arch.head_dim, torch.float32)
        hidden = request.hidden_states
        if hidden is None or len(hidden) == 0:
            return state
        start = request.hidden_start
        num = min(len(hidden), len(request.token_ids) - 1 - start)  # pair j needs x_{j+1}
        # Recomputed positions (after preemption) replace the cached ones: positions are increasing.
        state.length = int((state.positions[: state.length] <= start).sum())
        positions = torch.arange(start + 1, start + 1 + num)
        tokens = torch.tensor(request.token_ids[start + 1 : start + 1 + num])
        visible = None
        if num > 1:  # the new rows are causal among themselves
            visible = torch.ones(num, state.length + num, dtype=torch.bool)
            visible[:, state.length :] = visible[:, state.length :].tril()
        attention = _SlotAttention(state, state.length, visible, self.scale)
        predicted = self.head(hidden[:num].to(self.dtype), self._embed(tokens), positions, attention)
        state.positions[state.length : state.length + num] = positions
        state.length += num
        state.root_feature, state.root_position = predicted[-1], start + num
        return state

    def _embed(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.target_model.embed_tokens.weight).to(self.dtype)

    def _expand(self, state: _EagleState, last: int, frontier: list[int], tokens: list[int], parents: list[int],
                features: dict[int, Tensor], slots: dict[int, int]) -> Tensor:
        """The head on the pairs (parent's f_hat, node's token) for each frontier node, attending to
        the real pairs and the node's drafted ancestors; returns next-token log-probs [F, vocab].
        slots: each expanded node's row in the state, after the real pairs (filled here)."""
        start = state.length + len(slots)
        mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
        mask[:, : state.length] = True  # each row sees the real pairs, its drafted ancestors and itself
        for row, node in enumerate(frontier):
            mask[row, start + row] = True
            ancestor = parents[node]
            while ancestor != ROOT:
                mask[row, slots[ancestor]] = True
                ancestor = parents[ancestor]
        visible = None if bool(mask.all()) else mask  # a chain sees every row: no mask
        root = state.root_feature
        assert root is not None  # propose() refreshed it before expanding
        parent_features = torch.stack([root if parents[n] == ROOT else features[parents[n]] for n in frontier])
        depths = node_depths(parents)
        positions = torch.tensor([last + depths[n] for n in frontier])
        predicted = self.head(parent_features, self._embed(torch.tensor(self.lm_head.token_ids(
            [tokens[n] for n in frontier]))), positions, _SlotAttention(state, start, visible, self.scale))
        for row, node in enumerate(frontier):
            features[node] = predicted[row]
            slots[node] = start + row
        return torch.log_softmax(self.lm_head(predicted), -1)
