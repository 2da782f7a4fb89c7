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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from threefold.errors import ThreefoldError
from threefold.model.llama import Linear, use_kernels_in
from threefold.spec.config import SpeculativeConfig
from threefold.spec.heads import EagleHead, MedusaHeads, draft_vocab_ids, load_heads
from threefold.spec.proposer import ROOT, Draft, DraftRequest, Proposer
from threefold.spec.tree import eagle2_tree, masked_attention, medusa_tree, node_depths

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


@dataclass
class _EagleState:
    keys: Tensor
    """[P, kv_heads, head_dim] the head's keys over the real pairs so far."""
    values: Tensor
    positions: Tensor
    """[P] each cached pair's position (x_{j+1}'s): gaps are fine (prefix-cache hits)."""
    root_feature: Tensor | None = None
    """f_hat_{L-1}: the head's output on the newest real pair."""
    root_position: int = -1


class _CaptureAttention:
    """AttentionFn over cached keys (visible per row) plus the rows themselves (self_mask);
    keeps the rows' k and v for the caller."""

    def __init__(self, past_k: Tensor, past_v: Tensor, past_visible: Tensor, self_mask: Tensor, scale: float):
        self.past_k, self.past_v, self.past_visible, self.self_mask, self.scale = (
            past_k, past_v, past_visible, self_mask, scale)
        self.k: Tensor = past_k[:0]  # set by the call
        self.v: Tensor = past_v[:0]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.k, self.v = k.contiguous(), v.contiguous()
        visible = torch.cat([self.past_visible, self.self_mask], dim=1)
        return masked_attention(q, torch.cat([self.past_k, self.k]), torch.cat([self.past_v, self.v]), visible,
                                self.scale)


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
        kv: dict[int, tuple[Tensor, Tensor]] = {}

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            return self._expand(state, last, frontier, tokens, parents, features, kv)

        draft = eagle2_tree(root_logprobs, expand, request.num_drafts, top_k, total)  # draft-vocabulary indices
        token_ids = self.lm_head.token_ids(draft.token_ids)
        return Draft(token_ids) if top_k == 1 else Draft(token_ids, draft.parent_ids)

    def _absorb(self, request: DraftRequest) -> _EagleState:
        """Run the head over the newly computed real pairs and cache their keys/values."""
        state = self.states.get(request.request_id)
        if state is None:
            empty = torch.empty(0, self.head.arch.num_kv_heads, self.head.arch.head_dim, dtype=self.dtype)
            no_positions = torch.empty(0, dtype=torch.long)
            state = self.states[request.request_id] = _EagleState(empty, empty.clone(), no_positions)
        hidden = request.hidden_states
        if hidden is None or len(hidden) == 0:
            return state
        start = request.hidden_start
        num = min(len(hidden), len(request.token_ids) - 1 - start)  # pair j needs x_{j+1}
        keep = state.positions <= start  # recomputed positions (after preemption) replace old ones
        state.keys, state.values, state.positions = state.keys[keep], state.values[keep], state.positions[keep]
        positions = torch.arange(start + 1, start + 1 + num)
        tokens = torch.tensor(request.token_ids[start + 1 : start + 1 + num])
        capture = _CaptureAttention(state.keys, state.values, torch.ones(num, len(state.positions), dtype=torch.bool),
                                    torch.ones(num, num, dtype=torch.bool).tril(), self.scale)
        predicted = self.head(hidden[:num].to(self.dtype), self._embed(tokens), positions, capture)
        state.keys, state.values = torch.cat([state.keys, capture.k]), torch.cat([state.values, capture.v])
        state.positions = torch.cat([state.positions, positions])
        state.root_feature, state.root_position = predicted[-1], start + num
        return state

    def _embed(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.target_model.embed_tokens.weight).to(self.dtype)

    def _expand(self, state: _EagleState, last: int, frontier: list[int], tokens: list[int], parents: list[int],
                features: dict[int, Tensor], kv: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
        """The head on the pairs (parent's f_hat, node's token) for each frontier node, attending to
        the real pairs and the node's drafted ancestors; returns next-token log-probs [F, vocab]."""
        expanded = list(kv)
        depths = node_depths(parents)
        visible = torch.zeros(len(frontier), len(expanded), dtype=torch.bool)
        for row, node in enumerate(frontier):
            ancestor = parents[node]
            while ancestor != ROOT:
                visible[row, expanded.index(ancestor)] = True
                ancestor = parents[ancestor]
        past_k = torch.cat([state.keys, *[kv[n][0] for n in expanded]])
        past_v = torch.cat([state.values, *[kv[n][1] for n in expanded]])
        past_visible = torch.cat([torch.ones(len(frontier), len(state.positions), dtype=torch.bool), visible], 1)
        capture = _CaptureAttention(past_k, past_v, past_visible, torch.eye(len(frontier), dtype=torch.bool),
                                    self.scale)
        root = state.root_feature
        assert root is not None  # propose() refreshed it before expanding
        parent_features = torch.stack([root if parents[n] == ROOT else features[parents[n]] for n in frontier])
        positions = torch.tensor([last + depths[n] for n in frontier])
        predicted = self.head(parent_features, self._embed(torch.tensor(self.lm_head.token_ids(
            [tokens[n] for n in frontier]))), positions, capture)
        for row, node in enumerate(frontier):
            features[node] = predicted[row]
            kv[node] = (capture.k[row : row + 1], capture.v[row : row + 1])
        return torch.log_softmax(self.lm_head(predicted), -1)
