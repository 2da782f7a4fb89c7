"""SpecRunner: the model runner's speculative half (tensors in, token lists out).

Within one runner step:

    sampled = spec.sample(batch, hidden, sched.scheduled_spec_token_ids, plain_sample)
        requests without drafts -> the runner's own sampler (plain_sample)
        requests with k drafts  -> their k+1 rows -> verify_chains -> accepted + 1 tokens
    sampled.draft_token_ids = spec.propose(batch, hidden, sampled, ...)
        every request that just got tokens drafts for its next step (k from the controller)

The scheduler then holds the drafts as Request.spec_token_ids (update_draft_token_ids)
and reserves their slots in the same allocation as ordinary tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from threefold.core.outputs import ModelRunnerOutput, TokenLogprobs
from threefold.sample.logprobs import compute_logprobs_tensors
from threefold.spec.config import SpeculativeConfig
from threefold.spec.decoder import Candidate, SpecDecoder, profile_draft_cost, profile_step_cost
from threefold.spec.proposer import Draft, make_proposer
from threefold.spec.train import causal_attention


class SpecRunner:
    def __init__(self, decoder: SpecDecoder, model, eos_token_ids: list[int], max_model_len: int) -> None:
        self.decoder = decoder
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.pending_hidden: dict[str, tuple[int, list[Tensor]]] = {}
        """Hidden rows of prefill chunks not yet handed to the proposer: rid -> (first position, rows)."""
        self.trees: dict[str, Draft] = {}
        """The candidate tree each request drafted last (its tokens are the scheduler's spec_token_ids)."""
        self.paths: dict[str, list[int]] = {}
        """This step's accepted tree paths (node ids, root-down): their K/V move to the chain slots."""
        self.step_start = 0.0

    @classmethod
    def build(cls, config: SpeculativeConfig, loaded, max_model_len: int) -> SpecRunner:
        proposer = make_proposer(config, loaded)
        cost = profile_step_cost(lambda n: _dense_forward(loaded.model, n)) if config.adaptive else None
        draft_seconds = profile_draft_cost(proposer) if config.adaptive else 0.0
        return cls(SpecDecoder(config, proposer, cost, draft_seconds), loaded.model, list(loaded.eos_token_ids),
                   max_model_len)

    # ---- verify --------------------------------------------------------------
    def scheduled_trees(self, spec_tokens: dict[str, list[int]]) -> dict[str, list[int]]:
        """request id -> parent ids of the tree its scheduled drafts form (the scheduler may have cut
        the node list: any prefix of it is a tree). Drafts that form a chain are verified as one."""
        trees = {}
        for rid, tokens in spec_tokens.items():
            tree = self.trees.get(rid)
            if tree is None or tree.token_ids[: len(tokens)] != tokens:
                continue
            parents = (tree.parent_ids or [])[: len(tokens)]
            if parents != list(range(-1, len(tokens) - 1)):
                trees[rid] = parents
        return trees

    def sample(self, batch, hidden: Tensor, spec_tokens: dict[str, list[int]],
               plain_sample: Callable[[Any, Tensor], ModelRunnerOutput],
               trees: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """plain_sample(batch, logits): the runner's sampler over the logits of batch.sample_rows.
        trees: scheduled_trees(spec_tokens); those requests' drafts are verified as trees and their
        accepted paths left in self.paths for the runner to keep.

        One LM-head call scores every sampled row, the plain requests' and the verify rows (a
        second call would stream the LM head's weights again), in the model dtype: greedy rows
        are decided by their argmax there, as the plain sampler does."""
        self.paths = {}
        states = batch.sampling_states
        verifying = {i for i, s in enumerate(states) if spec_tokens.get(s.request_id)}
        plain = [i for i in range(len(states)) if i not in verifying]
        trees = trees or {}
        groups = [[i for i in sorted(verifying) if (states[i].request_id in trees) == is_tree]
                  for is_tree in (False, True)]
        # Each verifying request's k + 1 rows: its last real token's, then its drafts'.
        last = batch.sample_rows
        row_lists = [[last[i] for i in plain]] + [
            [r for i in members for r in range(last[i] - len(spec_tokens[states[i].request_id]), last[i] + 1)]
            for members in groups]
        rows = [r for rows in row_lists for r in rows]
        if not rows:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[rows], float32=False)  # [rows, vocab]
        plain_logits, *verify_logits = logits.split([len(r) for r in row_lists])
        output = plain_sample(dataclasses.replace(batch, sample_rows=[batch.sample_rows[i] for i in plain],
                                                  sampling_states=[states[i] for i in plain]), plain_logits)
        for members, member_logits in zip(groups, verify_logits, strict=True):
            if members:
                self._verify(batch, member_logits, members, spec_tokens, trees, output)
        return output

    def _verify(self, batch, logits: Tensor, members: list[int], spec_tokens: dict[str, list[int]],
                trees: dict[str, list[int]], output: ModelRunnerOutput) -> None:
        """Verify the chains, or the trees, of the sampling states `members` into `output`, from
        their rows' logits [sum(k + 1), vocab] (model dtype)."""
        states = [batch.sampling_states[i] for i in members]
        chains = [spec_tokens[s.request_id] for s in states]
        generators = {n: s.generator for n, s in enumerate(states) if s.generator is not None}
        args = ([s.params for s in states], [s.num_output_tokens for s in states], [s.penalties for s in states],
                generators, self.eos_token_ids)
        rids = [s.request_id for s in states]
        if states[0].request_id in trees:
            drafts = [Draft(chain, trees[rid]) for rid, chain in zip(rids, chains, strict=True)]
            tree_result = self.decoder.verify_trees(rids, logits, drafts, *args)
            token_ids, num_accepted, paths = tree_result.token_ids, tree_result.num_accepted, tree_result.paths
            self.paths.update(zip(rids, paths, strict=True))
        else:
            result = self.decoder.verify(rids, logits, chains, *args)
            token_ids, num_accepted = result.token_ids, result.num_accepted
            paths = [list(range(n)) for n in num_accepted]
        offset = 0
        for state, chain, emitted, accepted, path in zip(states, chains, token_ids, num_accepted, paths, strict=True):
            state.token_ids.extend(emitted)
            if state.penalties is not None:
                for token_id in emitted:
                    state.penalties.add(token_id)
            output.sampled_token_ids[state.request_id] = emitted
            output.num_accepted_tokens[state.request_id] = accepted
            if state.params.logprobs is not None:  # emitted[j] was drawn at the row of path[j - 1] (the root's: 0)
                scored = [offset] + [offset + 1 + node for node in path]
                output.logprobs[state.request_id] = _logprobs(logits[scored[: len(emitted)]], emitted,
                                                              state.params.logprobs)
            offset += len(chain) + 1

    # ---- propose -------------------------------------------------------------
    def propose(self, batch, hidden: Tensor, output: ModelRunnerOutput, spec_tokens: dict[str, list[int]],
                computed_before: dict[str, int], num_waiting: int = 1) -> dict[str, list[int]]:
        """Drafts for every request that got tokens this step. computed_before: each request's
        num_computed_tokens at the start of the step (its first row's position); num_waiting:
        requests the scheduler left waiting for a slot."""
        needs_hidden = self.decoder.needs_hidden_states
        if needs_hidden:
            self._keep_hidden(batch, hidden, output, spec_tokens, computed_before)
        candidates, taken = [], {}  # taken: rid -> (first position, hidden rows) handed over this step
        for state in batch.sampling_states:
            rid = state.request_id
            room = min((state.params.max_tokens or self.max_model_len) - state.num_output_tokens,
                       self.max_model_len - len(state.token_ids)) - 1
            start, rows = taken[rid] = self.pending_hidden.pop(rid, (0, [])) if needs_hidden else (0, [])
            candidates.append(Candidate(rid, state.token_ids, state.params, room, None, start, owed=room + 1,
                                        hidden_rows=rows))
        base_tokens = len(batch.input_ids) - sum(len(d) for d in spec_tokens.values())
        drafts = self.decoder.propose(candidates, base_tokens, len(candidates), num_waiting=num_waiting)
        for rid in self.decoder.deferred:  # not drafting this step: the proposer sees these rows next time
            if taken.get(rid, (0, []))[1]:
                self.pending_hidden[rid] = taken[rid]
        for state in batch.sampling_states:
            self.trees.pop(state.request_id, None)
        self.trees.update((rid, d) for rid, d in drafts.items() if d.is_tree)
        return {rid: d.token_ids for rid, d in drafts.items()}

    def _keep_hidden(self, batch, hidden: Tensor, output: ModelRunnerOutput, spec_tokens: dict[str, list[int]],
                     computed_before: dict[str, int]) -> None:
        """Hidden rows of every position that is now part of its sequence (rejected drafts' rows dropped)."""
        for state, start, num in zip(batch.order, batch.query_starts, batch.query_lens, strict=False):
            rid = state.request_id
            num_drafts = len(spec_tokens.get(rid, ()))
            first, rows = self.pending_hidden.get(rid, (computed_before[rid], []))
            if first + sum(len(r) for r in rows) != computed_before[rid]:  # a gap: start afresh
                first, rows = computed_before[rid], []
            known = start + num - num_drafts  # the rows after the known tokens' are the drafts'
            path = self.paths.get(rid)
            if path is None:  # a chain: its accepted drafts' rows follow the known tokens'
                # A copy, not a view: a request at k = 0 keeps its rows for steps (deferred), and a view
                # would keep each of those steps' whole hidden tensor alive with it.
                rows.append(hidden[start : known + output.num_accepted_tokens.get(rid, 0)].clone())
            else:
                rows.append(hidden[[*range(start, known), *(known + node for node in path)]])
            self.pending_hidden[rid] = (first, rows)

    def remove(self, request_id: str) -> None:
        self.pending_hidden.pop(request_id, None)
        self.trees.pop(request_id, None)
        self.decoder.remove(request_id)

    def observe_step(self, num_tokens: int, seconds: float, num_draft_rows: int = 0) -> None:
        self.decoder.observe_step(num_tokens, seconds, num_draft_rows)


def _logprobs(logits: Tensor, emitted: list[int], num_top: int) -> list[TokenLogprobs]:
    """Raw logprobs (the model's own distribution) of each emitted token, as the Sampler returns."""
    logprobs = logits[: len(emitted)].float().log_softmax(-1)
    tensors = compute_logprobs_tensors(logprobs, num_top, torch.tensor(emitted, device=logits.device))
    return [TokenLogprobs(tensors.token_ids[i, : num_top + 1].tolist(), tensors.logprobs[i, : num_top + 1].tolist(),
                          int(tensors.ranks[i])) for i in range(len(emitted))]


@torch.inference_mode()
def _dense_forward(model, num_tokens: int) -> None:
    """One forward of num_tokens (no KV cache): the linear layers dominate a verify step's cost."""
    model.compute_logits(model(torch.zeros(num_tokens, dtype=torch.long, device=model.embed_tokens.weight.device),
                               torch.arange(num_tokens, device=model.embed_tokens.weight.device), causal_attention))
