"""SpecDecoder: the runner's one handle on speculation — who drafts how much, proposing,
verifying, and the counters behind vLLM's spec_decode metrics.

Per step, in the runner:

    drafts = decoder.propose(candidates, base_tokens, base_emitted)   # after sampling
    ... the scheduler puts drafts in lookahead slots; next step's forward scores them ...
    result = decoder.verify(request_ids, logits_rows, drafts, ...)     # k+1 rows each
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from threefold.sample.params import SamplingParams
from threefold.spec.adaptive import AdaptiveController, StepCostModel
from threefold.spec.config import SpeculativeConfig
from threefold.spec.proposer import Draft, DraftRequest, Proposer
from threefold.spec.tree import node_depths
from threefold.spec.verify import TreeVerifyResult, VerifyResult, verify_chains, verify_trees

PROFILE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
"""Token counts whose forward time seeds the cost model (then refined online)."""


@dataclass
class SpecDecodingStats:
    """Cumulative counters, named as vLLM's metrics (vllm:spec_decode_*)."""

    num_spec_tokens: int
    num_drafts: int = 0
    """Verify steps that carried at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step (accepted + the bonus/correction), vLLM's definition."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Candidate:
    """A request that may draft for its next step."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    max_drafts: int
    """Room left: never draft past max_tokens or the context (the scheduler may cut more)."""
    hidden_states: Tensor | None = None
    hidden_start: int = 0
    owed: int | None = None
    """Tokens it may still emit (max_tokens less its output; the controller's batch tail). None: unknown."""
    hidden_rows: list[Tensor] = field(default_factory=list)
    """hidden_states in pieces (joined only if it drafts: a request at k = 0 keeps them for later)."""

    def hidden(self) -> Tensor | None:
        if self.hidden_states is None and self.hidden_rows:
            self.hidden_states = torch.cat(self.hidden_rows)
        return self.hidden_states


def speculation_allowed(params: SamplingParams) -> bool:
    """Sampling features that speculation cannot keep exact would turn it off for the request.

    Every processed-distribution feature (temperature, top-k/p, min-p, penalties,
    min_tokens, seeds) is exact through verify_chains, so today only the request's
    own opt-out (SamplingParams.speculative = False) disables it."""
    return params.speculative


def profile_step_cost(forward: Callable[[int], None], token_counts=PROFILE_TOKENS, repeats: int = 2) -> StepCostModel:
    """Seconds per forward of each token count (best of `repeats`), measured on this machine."""
    profile = {}
    for num_tokens in token_counts:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward(num_tokens)
            times.append(time.perf_counter() - start)
        profile[num_tokens] = min(times)
    return StepCostModel(profile)


PROFILE_REQUEST = "__profile_draft_cost__"
"""The dummy request profile_draft_cost drafts for (removed after each call)."""


def profile_draft_cost(proposer: Proposer, num_drafts: int = 4, repeats: int = 2) -> float:
    """Seconds one drafted token costs (best of `repeats` calls after a cold one) on a dummy 8-token
    request, measured at startup as the step cost is: a cold first call (a draft model's first
    kernels) must not set the price the adaptive controller drafts by. 0 for proposers that draft
    from the target's hidden states (priced from their first calls)."""
    if proposer.needs_hidden_states:
        return 0.0
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        proposer.propose([DraftRequest(PROFILE_REQUEST, list(range(1, 9)), num_drafts)])
        times.append((time.perf_counter() - start - proposer.catch_up_seconds) / num_drafts)
        proposer.remove(PROFILE_REQUEST)
    return min(times[1:])


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cost: StepCostModel | None = None,
                 draft_seconds_per_token: float = 0.0) -> None:
        """draft_seconds_per_token: the proposer's profiled cost (profile_draft_cost); 0 = from its first call."""
        self.config = config
        self.proposer = proposer
        self.controller = None if not config.adaptive or cost is None else AdaptiveController(
            cost, config.num_speculative_tokens, config.acceptance_ema_weight,
            draft_seconds_per_token=draft_seconds_per_token, tokens_for_depth=config.tree_tokens_by_depth())
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.accepted_per_request: dict[str, int] = {}
        self.argmax: Callable[[Tensor], Tensor] | None = None
        """The row argmax verifying greedy rows uses (the runner's Sampler's native one); None: torch's."""
        self.deferred: set[str] = set()
        """The last propose()'s candidates that may draft but got k = 0: the proposer did not see their
        hidden rows, so the caller keeps those for their next call (EAGLE's context has no gaps)."""

    @property
    def needs_hidden_states(self) -> bool:
        return self.proposer.needs_hidden_states

    def propose(self, candidates: list[Candidate], base_tokens: int, base_emitted: int,
                num_running: int | None = None, num_waiting: int = 1) -> dict[str, Draft]:
        """Drafts for the next step (chains of at most k tokens, or trees at most k deep); requests
        left out (k = 0) decode plainly. num_waiting: requests waiting for a slot (0: only the
        batch's tail drafts, see adaptive.tail_weights)."""
        self.deferred = set()
        limit = self.config.disable_by_batch_size
        if limit is not None and (num_running or len(candidates)) >= limit:
            return {}
        eligible = [c for c in candidates if c.max_drafts > 0 and speculation_allowed(c.params)]
        ks = self._choose(eligible, base_tokens, base_emitted, num_waiting)
        asked = [(c, k) for c, k in zip(eligible, ks, strict=False) if k > 0]
        self.deferred = {c.request_id for c, k in zip(eligible, ks, strict=False) if k == 0}
        if not asked:
            return {}
        start = time.perf_counter()
        drafts = self.proposer.propose([DraftRequest(c.request_id, c.token_ids, k, c.hidden(), c.hidden_start)
                                        for c, k in asked])
        if self.controller is not None:  # the proposer's own cost per drafted token, measured
            seconds = time.perf_counter() - start - self.proposer.catch_up_seconds
            self.controller.observe_draft_cost(sum(k for _, k in asked), seconds)
        return {c.request_id: d if d.is_tree else Draft(d.token_ids[:k])
                for (c, k), d in zip(asked, drafts, strict=False) if d.token_ids}

    def _choose(self, eligible: list[Candidate], base_tokens: int, base_emitted: int, num_waiting: int) -> list[int]:
        k_max = self.config.num_speculative_tokens
        if self.controller is None:
            return [min(k_max, c.max_drafts) for c in eligible]
        owed = [c.owed for c in eligible]
        chosen = self.controller.choose([c.request_id for c in eligible], base_tokens, base_emitted,
                                        None if None in owed else owed, num_waiting)  # type: ignore[arg-type]
        return [min(k, c.max_drafts) for k, c in zip(chosen, eligible, strict=False)]

    def verify(self, request_ids: list[str], logits: Tensor, drafts: list[list[int]], params: list[SamplingParams],
               num_output_tokens: list[int], token_counts: list, generators: dict[int, torch.Generator],
               eos_token_ids: list[int]) -> VerifyResult:
        result = verify_chains(logits, drafts, params, num_output_tokens, token_counts, generators, eos_token_ids,
                               self.argmax)
        for rid, draft, accepted in zip(request_ids, drafts, result.num_accepted, strict=False):
            self.stats.observe(len(draft), accepted)
            self.accepted_per_request[rid] = self.accepted_per_request.get(rid, 0) + accepted
            if self.controller is not None:
                self.controller.observe(rid, len(draft), accepted)
        return result

    def verify_trees(self, request_ids: list[str], logits: Tensor, drafts: list[Draft], params: list[SamplingParams],
                     num_output_tokens: list[int], token_counts: list, generators: dict[int, torch.Generator],
                     eos_token_ids: list[int]) -> TreeVerifyResult:
        result = verify_trees(logits, drafts, params, num_output_tokens, token_counts, generators, eos_token_ids,
                              self.argmax)
        for rid, draft, accepted in zip(request_ids, drafts, result.num_accepted, strict=False):
            self.stats.observe(len(draft.token_ids), accepted)
            self.accepted_per_request[rid] = self.accepted_per_request.get(rid, 0) + accepted
            if self.controller is not None:  # the geometric model's trials run down the tree's depth
                self.controller.observe(rid, max(node_depths(draft.parent_ids or [])), accepted)
        return result

    def observe_step(self, num_tokens: int, seconds: float, num_draft_rows: int = 0) -> None:
        if self.controller is not None:
            self.controller.observe_step(num_tokens, seconds, num_draft_rows)

    def remove(self, request_id: str) -> None:
        self.proposer.remove(request_id)
        self.accepted_per_request.pop(request_id, None)
        if self.controller is not None:
            self.controller.remove(request_id)
