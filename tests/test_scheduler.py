"""Scheduler: token budget, chunked prefill, preemption, priorities, abort (no model needed)."""

from __future__ import annotations

import dataclasses

from threefold.config import SchedulerConfig
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import ModelRunnerOutput, SchedulerOutput
from threefold.core.request import Request, RequestStatus
from threefold.core.scheduler import Scheduler
from threefold.sample.params import SamplingParams

BLOCK = 4
EOS = 0


def make(num_blocks=32, budget=8, max_seqs=8, caching=True, max_prefill=None) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, "m", enable_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_prefill_tokens=max_prefill), kv, max_model_len=64)


def req(request_id: str, num_tokens: int, max_tokens=4, priority=0, arrival=0.0, start=1) -> Request:
    return Request(request_id, list(range(start, start + num_tokens)), SamplingParams(max_tokens=max_tokens),
                   frozenset({EOS}), max_tokens, priority, arrival)


def run_step(s: Scheduler, token=7) -> SchedulerOutput:
    """One step where every request that reached its end samples `token`."""
    out = s.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n >= r.num_tokens:
            sampled[rid] = [token]
    s.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def test_chunked_prefill_shares_the_budget():
    s = make(budget=8)
    s.add_request(req("a", 10, arrival=1))
    s.add_request(req("b", 6, arrival=2, start=100))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[1, 2]]
    out = run_step(s)
    assert out.num_scheduled_tokens == {"a": 2, "b": 6}
    assert [c.new_block_ids for c in out.scheduled_cached_reqs] == [[3]]
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[4, 5]]
    assert s.requests["a"].output_token_ids == [7] and s.requests["b"].output_token_ids == [7]
    out = run_step(s)  # both decode now
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_finish_on_length_and_eos_frees_every_block():
    s = make()
    s.add_request(req("a", 5, max_tokens=2))
    s.add_request(req("b", 5, max_tokens=10, start=50))
    outputs = []
    for token in (7, 7, EOS):
        out = s.schedule()
        sampled = {rid: [token] for rid in out.num_scheduled_tokens}
        outputs.append(s.update_from_output(out, ModelRunnerOutput(sampled)))
    reasons = [{o.request_id: o.finish_reason for o in step} for step in outputs]
    assert reasons == [{"a": None, "b": None}, {"a": "length", "b": None}, {"b": "stop"}]
    assert not s.has_unfinished_requests()
    assert s.kv.usage() == 0.0
    assert s.schedule().finished_req_ids == {"b"}  # "a" was reported to the runner a step earlier


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 usable blocks of 4 tokens; two requests of 7 tokens need 2 blocks each, then a third each.
    s = make(num_blocks=5, budget=64, caching=False)
    s.add_request(req("a", 7, max_tokens=6, arrival=1))
    s.add_request(req("b", 7, max_tokens=6, arrival=2, start=50))
    run_step(s)  # both prefilled: 8 tokens each after sampling... 7 computed, 8 tokens
    assert s.kv.pool.num_free_blocks == 0
    out = run_step(s)  # a decodes at position 7 (block 2 still has room); b too
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out = run_step(s)  # a needs a third block: b (the tail) is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]  # nothing lost
    while s.requests.get("a"):
        run_step(s)
    out = run_step(s)  # b resumes: recomputes prompt + its outputs
    assert [c.resumed_from_preemption for c in out.scheduled_cached_reqs] == [True]
    assert out.num_scheduled_tokens == {"b": 9}
    assert s.num_preemptions == 1


def test_priority_orders_admission_and_preempts_lower_priority():
    s = make(num_blocks=5, budget=64, max_seqs=1)
    s.add_request(req("low", 3, priority=5, arrival=1))
    run_step(s)
    s.add_request(req("b", 3, priority=1, arrival=3, start=20))
    s.add_request(req("a", 3, priority=1, arrival=2, start=40))
    out = run_step(s)
    # "a" and "b" outrank "low"; the single seat goes to the earlier arrival of the best level.
    assert out.preempted_req_ids == {"low"}
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "low"]


def test_abort_anywhere_frees_everything():
    s = make(budget=8)
    s.add_request(req("a", 12))
    s.add_request(req("b", 12, start=40))
    run_step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.usage() == 0.0
    assert s.schedule().finished_req_ids == {"a", "b"}


def test_max_num_seqs_caps_running():
    s = make(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, arrival=i, start=10 * i + 1))
    out = run_step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert out.num_waiting == 1  # the speculation controller's refill signal


def test_prefix_hit_skips_computed_tokens_and_counts_stats():
    s = make(budget=64)
    s.add_request(req("a", 10))
    run_step(s)
    s.add_request(req("b", 10))
    out = run_step(s)
    assert out.num_scheduled_tokens["b"] == 2  # 8 tokens (2 blocks) from the cache
    assert s.requests["b"].num_cached_tokens == 8
    assert (s.kv.stats.queries, s.kv.stats.hits) == (20, 8)


def test_spec_tokens_ride_along_and_rejections_roll_back():
    s = make(budget=64)
    s.add_request(req("a", 4, max_tokens=10))
    run_step(s)
    r = s.requests["a"]
    r.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_token_ids == {"a": [11, 12, 13]}
    s.update_from_output(out, ModelRunnerOutput({"a": [11, 5]}))  # one draft accepted, then a correction
    assert r.output_token_ids == [7, 11, 5]
    assert r.num_computed_tokens == 6 and r.num_tokens == 7


def test_rejected_drafts_blocks_are_freed_and_the_runner_told():
    s = Scheduler(SchedulerConfig(8, 64), KVCacheManager(32, BLOCK, "m"), max_model_len=64, num_lookahead_tokens=6)
    s.add_request(req("a", 7, max_tokens=20))
    run_step(s)  # prefill 7 tokens (+6 lookahead slots): 4 blocks held, 2 kept
    r, pool = s.requests["a"], s.kv.pool
    assert len(s.kv.req_to_blocks["a"]) == 2 and pool.num_free_blocks == 31 - 2
    r.spec_token_ids = [11, 12, 13, 14, 15, 16]
    out = s.schedule()
    assert out.trimmed_blocks == {"a": 2}  # last step's trim, for the runner's block table
    assert len(s.kv.req_to_blocks["a"]) == 5  # 7 + 7 scheduled + 6 lookahead slots
    s.update_from_output(out, ModelRunnerOutput({"a": [11, 5]}))  # one accepted: 9 computed
    assert r.num_computed_tokens == 9
    assert len(s.kv.req_to_blocks["a"]) == 3 and pool.num_free_blocks == 31 - 3
    assert s.schedule().trimmed_blocks == {"a": 3}
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == 31


def test_a_burst_is_prefilled_a_few_prompts_a_step_while_decodes_ride_along():
    """max_prefill_tokens: six 4-token prompts at once, 8 prompt tokens a step: the first two reach their
    first token after one step instead of all six after one big step; decodes never count against the cap."""
    s = make(num_blocks=64, budget=64, max_prefill=8)
    for i in range(6):
        s.add_request(req(f"r{i}", 4, max_tokens=8, arrival=i, start=10 * i + 1))
    steps = [run_step(s).num_scheduled_tokens for _ in range(4)]
    assert steps == [{"r0": 4, "r1": 4},
                     {"r0": 1, "r1": 1, "r2": 4, "r3": 4},
                     {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 4, "r5": 4},
                     {f"r{i}": 1 for i in range(6)}]


def test_without_the_cap_the_burst_is_one_step():
    s = make(num_blocks=64, budget=64)
    for i in range(6):
        s.add_request(req(f"r{i}", 4, max_tokens=8, arrival=i, start=10 * i + 1))
    assert run_step(s).num_scheduled_tokens == {f"r{i}": 4 for i in range(6)}


def test_the_cap_chunks_a_long_prompt_beside_decodes_but_not_a_prompt_alone():
    s = make(num_blocks=64, budget=64, max_prefill=8)
    s.add_request(req("long", 20, max_tokens=4))
    assert run_step(s).num_scheduled_tokens == {"long": 20}  # alone: cutting it would only delay it
    s.add_request(req("next", 20, max_tokens=4, start=100))
    steps = [run_step(s).num_scheduled_tokens for _ in range(3)]
    assert steps == [{"long": 1, "next": 8}, {"long": 1, "next": 8}, {"long": 1, "next": 4}]
    assert s.requests["next"].output_token_ids == [7]


def test_a_recompute_after_preemption_counts_as_prefill():
    s = make(num_blocks=5, budget=64, caching=False)
    s.add_request(req("a", 7, max_tokens=6, arrival=1))
    s.add_request(req("b", 7, max_tokens=6, arrival=2, start=50))
    for _ in range(3):
        run_step(s)
    assert s.requests["b"].status == RequestStatus.PREEMPTED  # with 2 outputs: 9 tokens to recompute
    while s.requests.get("a"):
        run_step(s)
    s.add_request(req("c", 2, max_tokens=2, arrival=3, start=90))
    s.config = dataclasses.replace(s.config, max_prefill_tokens=4)
    out = run_step(s)
    assert out.num_scheduled_tokens == {"b": 4}  # the cap is spent on b's recompute; c waits
    assert [c.resumed_from_preemption for c in out.scheduled_cached_reqs] == [True]
    assert run_step(s).num_scheduled_tokens == {"b": 4}
    assert run_step(s).num_scheduled_tokens == {"b": 1, "c": 2}  # b's last token is not a prompt chunk
