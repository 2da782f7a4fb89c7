"""Scheduler: one token budget per step, shared by prefill chunks and decodes.

Every request moves `num_computed_tokens` toward `num_tokens` (plus its
speculative drafts). Running requests go first, in priority order; when the
pool runs dry the lowest-priority running request (the tail, never one
already scheduled this step) is preempted by recompute. Waiting requests are
admitted, prefix-cache hits first skipped, only if nobody was preempted.
With `max_prefill_tokens` (`threefold serve`: 512), online prompt chunks also share that smaller budget
whenever another request waits or runs, so a burst's first prompts get their first token a step or
three sooner instead of all at the end of one long step.

With KV offload tiers (External KV, core/external_kv.py), a waiting request whose prefix sits in a slow
tier waits in `loading` while the reads run in the background; a preempted request's blocks are swapped
to host memory or dropped for recompute, by cost.

Under the hybrid policy, while offline (batch) requests exist, online work is
planned first and offline requests only get what threefold/core/hybrid.py's
OfflineBudget grants; offline requests sort behind every online one, so they
are the tail that preemption takes first.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from threefold.config import SchedulerConfig
from threefold.core.external_kv import NO_HIT, ExternalKV, ExternalLoads, tokens_by_tier
from threefold.core.hybrid import OfflineBudget, StepPredictor, floor_tokens
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from threefold.core.request import Request, RequestStatus
from threefold.core.step_cost import BatchShape
from threefold.errors import ThreefoldError


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_num_drafts: int = 0
    """Speculative verify steps that carried drafts (vllm:spec_decode_num_drafts)."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] | None = None
    """Accepted drafts by draft position (None when nothing was drafted yet)."""
    num_running_offline: int = 0
    """Offline (batch) requests among num_running; the rest are online."""
    num_waiting_offline: int = 0
    offline_tokens: int = 0
    """Cumulative tokens computed for offline requests (prefill and decode)."""
    num_preemptions_online: int = 0
    num_preemptions_offline: int = 0


class _StepPlan:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int, prefill_budget: int | None = None) -> None:
        self.budget = budget
        self.prefill_budget = prefill_budget
        """Prompt tokens online requests may still take this step (max_prefill_tokens); None: no cap."""
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.num_tokens: dict[str, int] = {}
        self.spec: dict[str, list[int]] = {}
        self.preempted: set[str] = set()
        self.load: list[tuple[int, bytes]] = []
        self.swap_out: list[tuple[int, bytes]] = []
        self.out_of_blocks = False
        """Running requests were preempted for memory: admit nobody new this step."""
        self.shape = BatchShape()
        self.offline: OfflineBudget | None = None
        """Set once online work is planned (hybrid policy): what offline requests may add."""

    def grant(self, request: Request, num_new: int) -> int:
        return num_new if self.offline is None else self.offline.grant(request, num_new)

    def prefill_room(self, request: Request, num_computed: int) -> int | None:
        """The prompt tokens a chunk of `request` may still take this step; None: it is not capped. Online
        requests with more than their next token to compute (a prompt, or a recompute after preemption)
        share prefill_budget; decodes and their drafts never count against it."""
        if self.prefill_budget is None or request.class_rank != 0 or request.num_tokens - num_computed <= 1:
            return None
        return self.prefill_budget

    def limit_prefill(self, request: Request, num_computed: int, num_new: int) -> int:
        room = self.prefill_room(request, num_computed)
        return num_new if room is None else min(num_new, room)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_lookahead_tokens: int = 0, predictor: StepPredictor | None = None,
                 external: ExternalKV | None = None) -> None:
        self.config = config
        self.external = external
        """The KV offload store (External KV), or None."""
        self.loads = None if external is None else ExternalLoads(external, kv)
        """Prefixes being read from the tiers (WAITING_FOR_KV), and requests holding what arrived."""
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_counts = [0, 0, 0]  # drafts (verify steps with drafts), draft tokens, accepted tokens
        self.spec_accepted_per_pos: list[int] = []
        self.trimmed_blocks: dict[str, int] = {}
        """Request id -> blocks kept after a verify freed the rejected drafts' blocks (for the next output)."""
        self.hybrid = config.scheduling_policy == "hybrid"
        self.predictor = predictor
        """Step time over a batch's shape; the engine sets it (calibrated) before offline work runs."""
        self.last_shape = BatchShape()
        """The shape of the step schedule() returned last (the engine times it to refit the predictor)."""
        self.offline_tokens_scheduled = 0
        self.preemptions_by_class = {"online": 0, "offline": 0}
        self.offline_queued_tokens = 0
        """prompt + max_tokens of unfinished offline requests (the queue limit's count)."""
        self.offline_owed = 0.0
        """Offline's floor carried between steps: owed (> 0) or earned ahead in idle steps (< 0)."""
        self.busy_steps = 0
        """Hybrid steps with online work since the last offline-only one (offline rides decodes past a limit)."""
        self.offline_groups: dict[bytes, list] = {}
        """First-block key -> [group's first arrival, live members]: offline requests sharing it sort together."""

    # ---- queue bookkeeping -------------------------------------------------
    def check_offline_room(self, num_tokens: int) -> None:
        """Refuse offline work past max_offline_queued_tokens (the batch runner holds lines back)."""
        limit = self.config.max_offline_queued_tokens
        if self.offline_queued_tokens + num_tokens > limit:
            raise ThreefoldError(
                f"The offline queue is full: {self.offline_queued_tokens} of {limit} tokens (prompt + max_tokens) "
                f"are queued and this request needs {num_tokens}; retry when some finish.",
                param="request_class", status_code=429)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.is_offline:
            self.check_offline_room(request.num_prompt_tokens + request.max_tokens)
            self.offline_queued_tokens += request.num_prompt_tokens + request.max_tokens
            if self.hybrid:
                request.class_rank = 1
                request.group_key = self._join_group(request)
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def _join_group(self, request: Request) -> float:
        group = self.offline_groups.setdefault(self._group_of(request), [request.arrival_time, 0])
        group[1] += 1
        return group[0]

    def _group_of(self, request: Request) -> bytes:
        # The first block's tokens (all of a shorter prompt): what a shared system prompt puts in common.
        return str(request.prompt_token_ids[: self.kv.block_size]).encode()

    def _leave(self, request: Request) -> None:
        if not request.is_offline:
            return
        self.offline_queued_tokens -= request.num_prompt_tokens + request.max_tokens
        key = self._group_of(request)
        group = self.offline_groups.get(key)
        if self.hybrid and group is not None:
            group[1] -= 1
            if group[1] <= 0:
                del self.offline_groups[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_KV:
                assert self.loads is not None
                del self.loads.loading[request_id]  # release() below drops the read
            else:
                (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self._leave(request)
        self.kv.free(request)
        if self.loads is not None:
            self.loads.forget(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        if self.loads is not None:  # swap or recompute: the copy-out runs before this step reuses a block
            plan.swap_out.extend(self.loads.preempt(request))
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_class[request.request_class] += 1
        plan.preempted.add(request.request_id)
        bisect.insort(self.waiting, request, key=Request.sort_key)

    # ---- scheduling --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # The prefill cap only ever delays the request it cuts: it pays when another one waits or runs.
        alone = len(self.running) + len(self.waiting) <= 1
        plan = _StepPlan(self.config.max_num_batched_tokens, None if alone else self.config.max_prefill_tokens)
        if self.loads is not None and self.loads.loading:
            for request in self.loads.finish(plan.load):  # back in line, holding the blocks that arrived
                bisect.insort(self.waiting, request, key=Request.sort_key)
        self._preempt_for_priority(plan)
        if self.hybrid and self.offline_queued_tokens:
            self._schedule_hybrid(plan)
        else:
            self._schedule_running(plan)
            if not plan.out_of_blocks:
                self._schedule_waiting(plan)
        if self.loads is not None and not plan.num_tokens and not self.running:
            self.loads.unhold_if_stuck(self.waiting)
        self.last_shape = plan.shape
        finished, self.finished_req_ids = self.finished_req_ids, set()
        trimmed, self.trimmed_blocks = self.trimmed_blocks, {}
        loaded = {block_hash for _, block_hash in plan.load}
        # Loaded blocks are already in the store; everything else published this step is written through.
        to_store = [e for e in self.kv.pool.drain_cached_events() if e[1] not in loaded]
        return SchedulerOutput(
            scheduled_new_reqs=plan.new, scheduled_cached_reqs=plan.cached,
            num_scheduled_tokens=plan.num_tokens,
            total_num_scheduled_tokens=sum(plan.num_tokens.values()),
            scheduled_spec_token_ids=plan.spec, finished_req_ids=finished,
            preempted_req_ids=plan.preempted, blocks_to_load=plan.load, blocks_to_store=to_store,
            blocks_to_swap_out=plan.swap_out, trimmed_blocks=trimmed, num_waiting=len(self.waiting))

    def _schedule_hybrid(self, plan: _StepPlan) -> None:
        """Online first (running, then waiting) in the budget less offline's floor; offline fills the rest."""
        reserve = min(floor_tokens(self.config), plan.budget)
        plan.budget -= reserve
        self._schedule_running(plan, rank=0)
        if not plan.out_of_blocks:
            self._schedule_waiting(plan, rank=0)
        plan.budget += reserve
        online = [self.requests[rid] for rid in plan.num_tokens]
        online_waiting = bool(self.waiting) and self.waiting[0].class_rank == 0  # sorted: online first
        plan.offline = OfflineBudget(self.config, self.predictor, plan.shape, online, online_waiting,
                                     self.offline_owed, self.busy_steps)
        self.busy_steps = 0 if not plan.offline.online_present else self.busy_steps + 1
        self._schedule_offline_decodes(plan)
        self._schedule_running(plan, rank=1)
        if not plan.out_of_blocks:
            self._schedule_waiting(plan, rank=1)
        self.offline_owed = plan.offline.still_owed(self.config)

    def _schedule_offline_decodes(self, plan: _StepPlan) -> None:
        """Offline requests at their next output token go first: each is a token of arithmetic riding on
        the weights the step reads anyway, and an output; a prompt chunk of that size is neither."""
        first = bisect.bisect_left(self.running, 1, key=lambda r: r.class_rank)
        for request in self.running[first:]:
            if request.num_tokens_with_spec - request.num_computed_tokens != 1:
                continue
            if plan.budget <= 0 or plan.grant(request, 1) <= 0:
                return
            new_blocks = self.kv.allocate_slots(request, 1, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                return  # out of blocks: the ordinary pass preempts the tail (never one scheduled here)
            plan.cached.append(CachedRequestData(
                request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens))
            self._commit(request, 1, plan)

    def _preempt_for_priority(self, plan: _StepPlan) -> None:
        """A waiting request that outranks the running tail takes its place when room is short."""
        while self.waiting and self.running:
            head, tail = self.waiting[0], self.running[-1]
            if head.sort_key() >= tail.sort_key() or head.class_rank == 1:
                return  # offline work waits for room: its prefix-grouped order must not churn running requests
            need = -(-min(head.num_tokens, plan.budget) // self.kv.block_size)
            if len(self.running) < self.config.max_num_seqs and self.kv.pool.num_free_blocks >= need:
                return
            self._preempt(self.running.pop(), plan)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        wanted = request.num_tokens_with_spec - request.num_computed_tokens
        return min(wanted, budget, self.max_model_len - request.num_computed_tokens)

    def _schedule_running(self, plan: _StepPlan, rank: int = 0) -> None:
        """Running requests of one class rank (all of them outside hybrid scheduling), in order."""
        index = 0 if rank == 0 else bisect.bisect_left(self.running, rank, key=lambda r: r.class_rank)
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            if request.class_rank != rank:
                return
            if request.request_id in plan.num_tokens:  # an offline decode, scheduled first
                index += 1
                continue
            num_new = plan.grant(request, plan.limit_prefill(request, request.num_computed_tokens,
                                                             self._num_new_tokens(request, plan.budget)))
            if num_new <= 0:
                if plan.offline is not None and plan.offline.exhausted:
                    return
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:
                return  # the request preempted itself: it was the tail
            plan.cached.append(CachedRequestData(
                request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens))
            self._commit(request, num_new, plan)
            index += 1

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan):
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks
            if self.running[-1].request_id in plan.num_tokens:
                plan.out_of_blocks = True  # the tail is an offline decode scheduled this step: keep it
                return None
            victim = self.running.pop()
            self._preempt(victim, plan)
            plan.out_of_blocks = True
            if victim is request:
                return None

    def _commit(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        plan.num_tokens[request.request_id] = num_new
        plan.budget -= num_new
        room = plan.prefill_room(request, request.num_computed_tokens)
        if room is not None:
            plan.prefill_budget = room - num_new
        if plan.offline is None:  # the offline budget adds its own grants to the shape
            plan.shape.add(num_new, request.num_computed_tokens)
        if request.is_offline:
            self.offline_tokens_scheduled += num_new
        num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
        if num_spec > 0:
            plan.spec[request.request_id] = request.spec_token_ids[:num_spec]

    def _schedule_waiting(self, plan: _StepPlan, rank: int = 0) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.class_rank != rank:
                return
            held = self.loads.loaded.get(request.request_id) if self.loads is not None else None
            if held is not None:  # its prefix came in from a tier: it holds those blocks already
                if not self._admit(request, plan, [], request.num_computed_tokens, [], held):
                    return
                continue
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            hit = self.loads.fetch(request, len(computed_blocks)) if self.loads is not None else NO_HIT
            if hit.tiers and not hit.ready:  # prefetch from a slow tier; the step goes on without it
                assert self.loads is not None
                if not self.loads.start(request, computed_blocks, num_hit, hit.tiers):
                    return  # no room for its blocks yet
                self.waiting.pop(0)
                self.kv.record_lookup(request.num_tokens, num_hit)
                continue
            if not self._admit(request, plan, computed_blocks, num_hit, hit.tiers,
                               tokens_by_tier(num_hit, hit.tiers, self.kv.block_size)):
                return

    def _admit(self, request: Request, plan: _StepPlan, computed_blocks: list, num_hit: int,
               external: list[str], by_tier: dict[str, int]) -> bool:
        """Schedule the head of `waiting` resuming from `num_hit` computed tokens plus `external` blocks
        loaded this step; False (nothing changed) when the budget or the pool says no."""
        num_external = len(external) * self.kv.block_size
        num_resumed = num_hit + num_external
        num_new = plan.limit_prefill(request, num_resumed, min(request.num_tokens - num_resumed, plan.budget))
        if num_new <= 0:
            return False  # this step's prompt tokens are spent
        if plan.offline is not None:
            # Granted against the state it resumes from (num_resumed computed).
            computed, request.num_computed_tokens = request.num_computed_tokens, num_resumed
            num_new = plan.grant(request, num_new)
            request.num_computed_tokens = computed
            if num_new <= 0:
                return False
        new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks,
                                            num_lookahead_tokens=self.num_lookahead_tokens,
                                            num_external_computed_tokens=num_external)
        if new_blocks is None:
            return False  # what was staged stays staged for the next try
        self.waiting.pop(0)
        if self.loads is None or self.loads.loaded.pop(request.request_id, None) is None:
            self.kv.record_lookup(request.num_tokens, num_hit)  # (a loaded request was counted at its start)
        if external:
            start = len(computed_blocks)
            plan.load.extend((block.block_id, request.block_hashes[start + i])
                             for i, block in enumerate(new_blocks[: len(external)]))
            assert self.external is not None
            self.external.commit(request.request_id, len(external))
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_resumed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
            request.num_cached_tokens = num_resumed
            request.cached_tokens_by_tier = by_tier
        block_ids = self.kv.block_ids(request.request_id)
        if resumed and request.request_id not in plan.preempted:
            plan.cached.append(CachedRequestData(request.request_id, block_ids, request.num_computed_tokens, True))
        else:
            plan.new.append(NewRequestData(request.request_id, request.all_token_ids,
                                           request.sampling_params, block_ids, request.num_computed_tokens))
        bisect.insort(self.running, request, key=Request.sort_key)
        self._commit(request, num_new, plan)
        return True

    # ---- drafts ------------------------------------------------------------
    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The one entry point for speculative drafts (vLLM's): they become the request's
        spec_token_ids, and the next schedule() computes them in lookahead slots reserved by
        the same allocate_slots call as its ordinary tokens. Drafts that could overrun
        max_tokens or the context are cut; finished or waiting requests take none."""
        for request_id, drafts in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            request.spec_token_ids = list(drafts[: max(room, 0)])

    def _count_spec(self, num_spec: int, num_accepted: int) -> None:
        self.spec_counts[0] += 1
        self.spec_counts[1] += num_spec
        self.spec_counts[2] += num_accepted
        if len(self.spec_accepted_per_pos) < num_spec:
            self.spec_accepted_per_pos.extend([0] * (num_spec - len(self.spec_accepted_per_pos)))
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    # ---- results -----------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, num_scheduled in sched.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_spec = len(sched.scheduled_spec_token_ids.get(request_id, ()))
            outputs.append(self._update_request(request, num_scheduled, num_spec, out))
        return [o for o in outputs if o is not None]

    def _update_request(self, request: Request, num_scheduled: int, num_spec: int,
                        out: ModelRunnerOutput) -> EngineCoreOutput | None:
        rid = request.request_id
        if rid in out.failed:
            self.running.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            return EngineCoreOutput(rid, [], finish_reason="error", error=out.failed[rid])
        sampled = out.sampled_token_ids.get(rid, [])
        # Drafts past the first rejection were computed but are not part of the sequence.
        num_rejected = num_spec + 1 - len(sampled) if sampled and num_spec else 0
        request.num_computed_tokens += num_scheduled - num_rejected
        request.spec_token_ids = []
        kept = self.kv.trim(request)  # rejected drafts' slots and the unused lookahead go back to the pool
        if kept is not None:
            self.trimmed_blocks[rid] = kept
        if num_spec and sampled:
            self._count_spec(num_spec, num_spec - num_rejected)
        new_ids = []
        for token_id in sampled:
            request.append_output_token(token_id)
            new_ids.append(token_id)
            if request.check_stop(self.max_model_len):
                break
        prompt_logprobs = out.prompt_logprobs.get(rid)
        if not new_ids and prompt_logprobs is None:
            return None
        result = EngineCoreOutput(rid, new_ids, out.logprobs.get(rid, [])[: len(new_ids)] or None,
                                  prompt_logprobs, num_cached_tokens=request.num_cached_tokens,
                                  cached_tokens_by_tier=request.cached_tokens_by_tier or None,
                                  first_scheduled_time=request.first_scheduled_time)
        if num_spec and sampled:
            result.num_draft_tokens, result.num_accepted_tokens = num_spec, num_spec - num_rejected
        if request.is_finished:
            result.finish_reason, result.stop_reason = request.status.finish_reason, request.stop_reason
            self.running.remove(request)
            self._free(request)
        return result

    def stats(self) -> SchedulerStats:
        num_loading = len(self.loads.loading) if self.loads is not None else 0
        return SchedulerStats(len(self.running), len(self.waiting) + num_loading, self.kv.usage(),
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions,
                              self.spec_counts[0], self.spec_counts[1], self.spec_counts[2],
                              list(self.spec_accepted_per_pos) or None,
                              sum(r.is_offline for r in self.running), sum(r.is_offline for r in self.waiting),
                              self.offline_tokens_scheduled, self.preemptions_by_class["online"],
                              self.preemptions_by_class["offline"])
