"""Request: one sequence moving `num_computed_tokens` toward its tokens (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from threefold.errors import ThreefoldError
from threefold.sample.params import SamplingParams

REQUEST_CLASSES = ("online", "offline")
"""online: interactive, scheduled first; offline: batch work that fills the budget online leaves."""


def check_request_class(request_class: object) -> str:
    if request_class not in REQUEST_CLASSES:
        raise ThreefoldError(f"request_class must be one of {REQUEST_CLASSES}, got {request_class!r}.",
                             param="request_class")
    return str(request_class)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3
    """Its prefix is being read from a KV offload tier in the background; it holds the blocks it goes into."""
    # Everything from FINISHED_STOPPED on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """A sequence the scheduler moves forward.

    There are no prefill/decode phases: each step schedules
    `num_tokens - num_computed_tokens` (capped by the budget) new tokens, so
    chunked prefill, prefix-cache hits, resumption after preemption and decode
    are one loop. `spec_token_ids` are speculative drafts that ride along.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    """Resolved: never more than the model's context allows."""
    priority: int = 0
    """Lower runs first; FCFS within a level."""
    arrival_time: float = field(default_factory=time.time)
    request_class: str = "online"
    """online or offline (REQUEST_CLASSES)."""
    class_rank: int = 0
    """Set by the scheduler: 1 puts an offline request behind every online one (hybrid policy)."""
    group_key: float = 0.0
    """Set by the scheduler: offline requests sharing a first block sort together (the group's first arrival)."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first schedule (-1 until then)."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """num_cached_tokens by source: "pool" (L1 prefix hits) and KV offload tiers ("cpu", "disk", "redis")."""
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's full blocks, extended as tokens arrive."""
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Kept alongside the two parts so reading the whole sequence never copies it.
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output, without a copy: read it, never mutate it (append_output_token does)."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_offline(self) -> bool:
        return self.request_class == "offline"

    def sort_key(self) -> tuple[int, int, float, float, str]:
        return (self.class_rank, self.priority, self.group_key, self.arrival_time, self.request_id)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it; True if it did."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in (params.stop_token_ids or ()):
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
