"""The contracts between scheduler, model runner and engine (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from threefold.sample.params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to cache its state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    """If True, `new_block_ids` replaces the request's whole block table."""


@dataclass
class SchedulerOutput:
    """The only thing the scheduler tells the runner each step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Request id -> tokens to compute this step (drafts included)."""
    total_num_scheduled_tokens: int
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)
    """(block_id, block_hash) to fill from the KV offload store before the forward (External KV)."""
    blocks_to_swap_out: list[tuple[int, bytes]] = field(default_factory=list)
    """(block_id, block_hash) of preempted requests' blocks to copy to host memory (swap): first of all,
    before this step's loads or forward can overwrite a block the preemption freed."""
    trimmed_blocks: dict[str, int] = field(default_factory=dict)
    """Request id -> blocks it keeps: the scheduler freed its blocks past that count (slots of drafts
    rejected last step); the runner truncates the request's block table before this step's new blocks."""
    blocks_to_store: list[tuple[int, bytes]] = field(default_factory=list)
    """(block_id, block_hash) published this step: the runner offloads them after the forward wrote
    them (write-through; a block cached this step is held by its request, so it cannot be reused first)."""
    num_waiting: int = 0
    """Requests left waiting for a slot after this step's scheduling (speculation's controller: a
    request that finishes sooner frees its slot for one of them; with none, only the batch's tail drafts)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class TokenLogprobs(NamedTuple):
    """Logprobs at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    """Rank of the chosen token (1 = most likely)."""


@dataclass
class ModelRunnerOutput:
    """What one forward produced, in plain Python lists."""

    sampled_token_ids: dict[str, list[int]]
    """Request id -> tokens accepted this step (1, or more with speculation)."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    """Request id -> logprobs of every prompt token (first None), once the prompt is done."""
    failed: dict[str, str] = field(default_factory=dict)
    """Request id -> error message for requests whose processing raised."""
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    """Request id -> drafts accepted this step (requests that verified drafts only)."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> drafts proposed for its next step (the scheduler's update_draft_token_ids)."""


@dataclass
class EngineCoreOutput:
    """Per-request news from one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    """num_cached_tokens split by where they came from: "pool" (L1) and the offload tiers."""
    error: str | None = None
    first_scheduled_time: float | None = None
    """When the request first got a slot (time.time()), for queue-time metrics."""
    num_draft_tokens: int = 0
    """Speculative drafts this request verified this step."""
    num_accepted_tokens: int = 0
    """Of those, how many were accepted (each saved one target step)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
