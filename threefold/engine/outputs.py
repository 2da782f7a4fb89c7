"""What the engine hands back to users: RequestOutput and friends, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """One of the `n` completions of a request. Text and ids are cumulative."""

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
    """The state of one request after an engine step (cumulative, not a delta)."""

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
