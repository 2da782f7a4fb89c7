"""Adaptive speculation length: choose each request's k to maximise goodput (plain Python).

Goodput = expected emitted tokens per second of step time. With a per-token
acceptance rate a (geometric model, Leviathan eq. 1), a request that drafts k
emits E(k) = 1 + a + a^2 + ... + a^k tokens; the j-th extra draft adds a^j.
Every draft costs the same: one more verify query (and one draft token), so

    goodput(k_1..k_n) = (base + sum_i E_i(k_i)) / (t_verify(T + sum k) + t_draft * sum k)

is raised by taking increments in order of a_i^j, highest first, while the
ratio still grows (E is concave in each k, the time convex-ish in tokens).
At high load t_verify grows ~linearly in tokens and the a^j gains stop paying:
k falls to 0, which is why speculation never costs throughput (vLLM PR 26504:
acceptance flat at 0.86-0.91 while speculation went from +23% to -16%).

`StepCostModel` holds the measured step time per token count (profiled at
startup, then updated online from steps without drafts) plus what drafts cost
beyond that, measured from the steps with drafts (their whole step time, verify
and sampling included, against the curve) and fitted as a fixed part per step
with drafts (a second LM-head call, the rejection sampler) plus a part per draft
row; `AcceptanceTracker` holds each request's EMA.

The batch's tail: a request's extra tokens are worth a freed slot only while
another request waits for it. With nobody waiting, the run ends when the
request that owes the most tokens is done, so drafts of a request that will be
done before that anyway (even if every request drafted its most) buy nothing,
and it does not draft (`tail_weights`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

PRIOR_ACCEPTANCE = 0.5
"""A new request's acceptance rate before it has drafted (no evidence either way)."""


class StepCostModel:
    """Seconds of one forward step as a function of the tokens it computes.

    Points are (num_tokens, seconds) EMAs, one per measured token count;
    between points the time is interpolated linearly, past the last point
    extrapolated with the last segment's slope (or proportionally, with one point).
    """

    def __init__(self, profile: dict[int, float], ema_weight: float = 0.1) -> None:
        if not profile:
            raise ValueError("StepCostModel needs at least one measured (num_tokens, seconds) point")
        self.ema_weight = ema_weight
        self.tokens: list[int] = sorted(profile)
        self.seconds: list[float] = [float(profile[t]) for t in self.tokens]
        self._monotone = list(accumulate(self.seconds, max))
        self.verify_seconds = 0.0
        """What a step with drafts costs beyond a plain step of as many tokens, whatever its drafts."""
        self.draft_row_seconds = 0.0
        """And beyond that, per draft row. Both fitted by least squares over the steps with drafts,
        older steps fading by (1 - ema_weight) a step: their verify logits and rejection sampling,
        and whatever the curve misses at this batch."""
        self._sums = [0.0] * 5  # faded sums of 1, rows, rows^2, excess, rows * excess

    def observe(self, num_tokens: int, seconds: float, num_draft_rows: int = 0) -> None:
        """Fold one measured step in. Without drafts: the curve (an EMA at a known count, a new point
        otherwise). With drafts: the step time beyond the curve's, fitted as fixed + per row."""
        if num_draft_rows > 0:
            excess, rows = seconds - self(num_tokens), float(num_draft_rows)
            keep = 1.0 - self.ema_weight
            self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, rows, rows * rows, excess, rows * excess),
                                                         strict=True)]
            n, sx, sxx, sy, sxy = self._sums
            spread = n * sxx - sx * sx
            if spread > 1e-9 * n * sxx:  # rows varied: both parts; else all of it fixed
                self.draft_row_seconds = (n * sxy - sx * sy) / spread
                self.verify_seconds = (sy - self.draft_row_seconds * sx) / n
            else:
                self.draft_row_seconds, self.verify_seconds = 0.0, sy / n
            return
        index = bisect.bisect_left(self.tokens, num_tokens)
        if index < len(self.tokens) and self.tokens[index] == num_tokens:
            self.seconds[index] += self.ema_weight * (seconds - self.seconds[index])
        else:
            self.tokens.insert(index, num_tokens)
            self.seconds.insert(index, seconds)
        # Noise must never make more tokens look cheaper: read the running maximum.
        self._monotone = list(accumulate(self.seconds, max))

    def __call__(self, num_tokens: int) -> float:
        tokens, seconds = self.tokens, self._monotone
        if num_tokens <= tokens[0]:
            return seconds[0]
        if len(tokens) == 1:
            return seconds[0] * num_tokens / max(tokens[0], 1)
        index = min(bisect.bisect_left(tokens, num_tokens), len(tokens) - 1)
        t0, t1, s0, s1 = tokens[index - 1], tokens[index], seconds[index - 1], seconds[index]
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)

    def step(self, base_tokens: int, draft_rows: int) -> float:
        """Predicted seconds of a step computing base_tokens plus draft_rows verify rows. A negative
        surcharge counts as 0: where the curve overestimates a step (a profile point no plain step
        has corrected yet), drafts must not look cheaper than plain tokens, or they would be taken
        everywhere and never correct it."""
        plain = self(base_tokens)
        if draft_rows <= 0:
            return plain
        return (self(base_tokens + draft_rows) + max(self.verify_seconds, 0.0)
                + max(self.draft_row_seconds, 0.0) * draft_rows)


@dataclass
class _Evidence:
    accepted: float
    trials: float


@dataclass
class AcceptanceTracker:
    """Per-request acceptance-rate EMA under the geometric model.

    A step that drafted k and accepted m saw m successes in m + (m < k) Bernoulli
    trials (the run stops at the first rejection); both counts are EMAs, so the
    rate is their ratio and a truncated run is not mistaken for a rejection.
    """

    ema_weight: float = 0.3
    prior: float = PRIOR_ACCEPTANCE
    requests: dict[str, _Evidence] = field(default_factory=dict)

    def rate(self, request_id: str) -> float:
        evidence = self.requests.get(request_id)
        if evidence is None or evidence.trials <= 0:
            return self.prior
        return evidence.accepted / evidence.trials

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        trials = num_accepted + (num_accepted < num_drafted)
        evidence = self.requests.get(request_id)
        if evidence is None:  # the first observation counts in full, weighed against the prior
            self.requests[request_id] = _Evidence(num_accepted + self.prior, trials + 1.0)
            return
        w = self.ema_weight
        evidence.accepted += w * (num_accepted - evidence.accepted)
        evidence.trials += w * (trials - evidence.trials)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify step emits for k drafts: 1 + a + ... + a^k."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def tail_weights(owed: Sequence[int], rates: Sequence[float], max_drafts: Sequence[int]) -> list[float]:
    """Per request, 1 if its drafts can shorten the run when no request waits for a slot, else 0.

    owed: tokens each request may still emit (max_tokens less its output). The run lasts
    at least H = max_j owed_j / E_j(k_j max) steps (the longest request at its best
    speculation); a request owing at most H tokens is done by then drafting nothing."""
    horizon = max((o / expected_tokens(r, m) for o, r, m in zip(owed, rates, max_drafts, strict=True)), default=0.0)
    return [1.0 if o > horizon else 0.0 for o in owed]


def choose_num_drafts(rates: list[float], max_drafts: list[int], cost: StepCostModel,
                      base_tokens: int, base_emitted: int, draft_seconds_per_token: float = 0.0,
                      tokens_for_depth: Sequence[int] | None = None,
                      weights: Sequence[float] | None = None) -> list[int]:
    """k per speculating request maximising goodput for this step.

    rates/max_drafts: one entry per speculating request (max 0 = may not draft);
    base_tokens: tokens the step computes anyway (prefill chunks, every decode's
    one query); base_emitted: tokens it emits anyway (one per decode/finished prefill).
    tokens_for_depth: candidate trees, where k is the depth: [d] = the verify rows a
    depth-d tree adds (its nodes), so a deeper level costs every node it brings
    (None: chains, d). The gain of a level stays a^d, a being the tree's
    per-level acceptance rate. weights: what a request's extra token is worth
    (tail_weights; None: 1 each). The step time is cost.step: the curve plus the
    measured surcharge of each draft row.
    """
    # For a fixed number m of extra drafts the best choice is the m largest gains w_i a_i^j (each
    # request's gains fall with j, so the top m are prefixes); the best m is found by one scan.
    weights = [1.0] * len(rates) if weights is None else weights
    heap = [(-rate * weight, i) for i, (rate, most, weight) in enumerate(zip(rates, max_drafts, weights, strict=False))
            if most > 0 and rate * weight > 0]
    heapq.heapify(heap)
    taken: list[int] = []  # request index of each increment, best first
    counts = [0] * len(rates)
    emitted, best, best_m = float(base_emitted), base_emitted / cost.step(base_tokens, 0), 0
    extra = 0  # verify rows the drafts taken so far add
    while heap:
        neg_gain, i = heapq.heappop(heap)
        taken.append(i)
        counts[i] += 1
        extra += 1 if tokens_for_depth is None else tokens_for_depth[counts[i]] - tokens_for_depth[counts[i] - 1]
        emitted -= neg_gain
        m = len(taken)
        goodput = emitted / (cost.step(base_tokens, extra) + draft_seconds_per_token * m)
        if goodput > best:
            best, best_m = goodput, m
        if counts[i] < max_drafts[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))
    num_drafts = [0] * len(rates)
    for i in taken[:best_m]:
        num_drafts[i] += 1
    return num_drafts


class AdaptiveController:
    """Per-step k for each request: acceptance EMAs + the measured cost model.

    A request at k = 0 gets a one-draft probe every `probe_interval` of its steps,
    so a request whose text turns predictable can win speculation back (a probe
    never adds a step: a verify emits at least one token).
    """

    def __init__(self, cost: StepCostModel, max_drafts: int, ema_weight: float = 0.3,
                 probe_interval: int = 16, draft_seconds_per_token: float = 0.0,
                 tokens_for_depth: Sequence[int] | None = None) -> None:
        self.cost = cost
        self.tokens_for_depth = tokens_for_depth
        """Candidate trees: the verify rows of a tree of each depth (choose_num_drafts); None: chains."""
        self.max_drafts = max_drafts
        self.acceptance = AcceptanceTracker(ema_weight)
        self.probe_interval = probe_interval
        self.draft_seconds_per_token = draft_seconds_per_token
        self._draft_cost_measured = draft_seconds_per_token > 0.0  # profiled at startup: calls refine it
        self.idle_steps: dict[str, int] = {}

    def choose(self, request_ids: list[str], base_tokens: int, base_emitted: int,
               owed: Sequence[int] | None = None, num_waiting: int = 1) -> list[int]:
        """owed: tokens each request may still emit; num_waiting: requests waiting for a slot (with
        none, only the batch's tail drafts: tail_weights). A probe is skipped where even a
        certain draft would not pay this step (or, with nobody waiting, the request is not in the tail)."""
        rates = [self.acceptance.rate(rid) for rid in request_ids]
        max_drafts = [self.max_drafts] * len(rates)
        weights = None if owed is None or num_waiting > 0 else tail_weights(owed, rates, max_drafts)
        chosen = choose_num_drafts(rates, max_drafts, self.cost, base_tokens, base_emitted,
                                   self.draft_seconds_per_token, self.tokens_for_depth, weights)
        first_rows = 1 if self.tokens_for_depth is None else self.tokens_for_depth[1]
        probe_pays = ((base_emitted + 1) / (self.cost.step(base_tokens, first_rows) + self.draft_seconds_per_token)
                      > base_emitted / self.cost.step(base_tokens, 0))
        for index, rid in enumerate(request_ids):
            idle = self.idle_steps.get(rid, 0) + 1 if chosen[index] == 0 else 0
            if idle >= self.probe_interval and probe_pays and (weights is None or weights[index] > 0):
                chosen[index], idle = 1, 0
            self.idle_steps[rid] = idle
        return chosen

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_drafted, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float, num_draft_rows: int = 0) -> None:
        self.cost.observe(num_tokens, seconds, num_draft_rows)

    def observe_draft_cost(self, num_drafted: int, seconds: float, ema_weight: float = 0.1) -> None:
        """Fold a measured proposer call into the seconds each drafted token costs (unless profiled at
        startup, the first call sets it: an EMA from 0 would let an expensive proposer look cheap for
        its first few dozen calls)."""
        if num_drafted <= 0:
            return
        weight = ema_weight if self._draft_cost_measured else 1.0
        self.draft_seconds_per_token += weight * (seconds / num_drafted - self.draft_seconds_per_token)
        self._draft_cost_measured = True

    def remove(self, request_id: str) -> None:
        self.acceptance.remove(request_id)
        self.idle_steps.pop(request_id, None)
