"""What the engine hands back to users: RequestOutput and friends, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0
    """Everything so far: each output copies the whole completion (O(length) per step)."""
    DELTA = 1
    """Only what is new since the previous output (streaming; O(new tokens) per step)."""
    FINAL_ONLY = 2
    """One output, the whole completion, when the request finishes (offline generate)."""


@dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = top), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    Text, ids and logprobs are everything so far, or under RequestOutputKind.DELTA
    only the new part; cumulative_logprob, finish_reason and stop_reason are
    always the completion's current state.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    """None while running; then "stop" (EOS, stop token or stop string), "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative or a delta: see RequestOutputKind).

    A delta carries prompt_logprobs once, in the output where they become known."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)
    """Set when the request failed inside the engine (the server answers 500)."""
    num_draft_tokens: int = 0
    """Speculative drafts verified for this request so far (all its completions)."""
    num_accepted_tokens: int = 0
    """Of those, the accepted ones: each saved one target forward."""
    cached_tokens_by_tier: dict[str, int] | None = None
    """num_cached_tokens by source: "pool" (L1 prefix cache), "cpu" (L2), "disk" (L3), "redis" (L4)."""


def merge_deltas(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One output that is the concatenation of consecutive DELTA outputs of one request.

    Linear in their total size (the streams' slow consumers and non-streaming
    callers gather deltas with it, so nothing is copied once per step).
    """
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    completions = [_merge_completions([o.outputs[i] for o in outputs]) for i in range(len(last.outputs))]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return dataclasses.replace(last, outputs=completions, prompt_logprobs=prompt_logprobs)


def _merge_completions(parts: list[CompletionOutput]) -> CompletionOutput:
    last = parts[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = list(itertools.chain.from_iterable(p.logprobs or () for p in parts))
    return dataclasses.replace(last, text="".join(p.text for p in parts),
                               token_ids=list(itertools.chain.from_iterable(p.token_ids for p in parts)),
                               logprobs=logprobs)
