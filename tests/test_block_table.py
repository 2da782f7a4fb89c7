"""The runner's persistent BlockTable against a from-scratch rebuild, step by step (no model needed).

A real Scheduler and KVCacheManager run under memory pressure (preemption) and
aborts; after each step the runner-side rows, slot mapping and decode/prefill
tables must equal what the old per-step rebuild from the scheduler's block
lists gives.
"""

from __future__ import annotations

import random

import torch

from threefold.config import SchedulerConfig
from threefold.core.block_pool import NULL_BLOCK_ID
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import ModelRunnerOutput
from threefold.core.request import Request, RequestStatus
from threefold.core.scheduler import Scheduler
from threefold.sample.params import SamplingParams
from threefold.worker.batch import RequestStates, build_batch
from threefold.worker.block_table import BlockTable

BLOCK = 4
CPU = torch.device("cpu")


def _rebuilt_slots(order, num_scheduled, block_ids) -> list[int]:
    """The old per-step rebuild: one Python expression per token from the block id lists."""
    slots = []
    for state in order:
        blocks = block_ids[state.request_id]
        start = state.num_computed_tokens
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + num_scheduled[state.request_id])]
    return slots


def _rebuilt_table(blocks: list[int], num_blocks: int) -> list[int]:
    return blocks[:num_blocks] + [NULL_BLOCK_ID] * (num_blocks - len(blocks[:num_blocks]))


def _check_batch(batch, num_scheduled, block_ids) -> None:
    assert batch.attn.slot_mapping.tolist() == _rebuilt_slots(batch.order, num_scheduled, block_ids)
    expected_positions = [p for s in batch.order for p in range(s.num_computed_tokens,
                                                                s.num_computed_tokens + num_scheduled[s.request_id])]
    assert batch.positions.tolist() == expected_positions
    for group in batch.attn.decode_groups:
        members = batch.order[group.query_start : group.query_start + group.num_seqs]
        width = group.block_table.shape[1]
        assert group.block_table.tolist() == [_rebuilt_table(block_ids[s.request_id], width) for s in members]
    prefills = batch.order[len(batch.order) - len(batch.attn.prefills):]
    for state, chunk in zip(prefills, batch.attn.prefills):
        num_blocks = -(-(chunk.context_len + chunk.query_len) // BLOCK)
        assert chunk.block_table.tolist() == [block_ids[state.request_id][:num_blocks]]


def _request(i: int, rng: random.Random) -> Request:
    prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 30))]
    max_tokens = rng.randrange(4, 30)
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), frozenset({0}), max_tokens,
                   arrival_time=float(i))


def test_persistent_table_matches_rebuild_with_preemption_and_abort():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK, model_fingerprint="m")  # tight: forces preemption
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24), kv, max_model_len=128)
    states = RequestStates(BLOCK, vocab_size=512, device=CPU)
    for i in range(20):
        scheduler.add_request(_request(i, rng))
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        if steps % 7 == 0 and scheduler.running:  # abort a running request now and then
            scheduler.finish_requests([rng.choice(scheduler.running).request_id], RequestStatus.FINISHED_ABORTED)
        sched = scheduler.schedule()
        states.update(sched)
        block_ids = {rid: kv.block_ids(rid) for rid in sched.num_scheduled_tokens}
        for rid, blocks in block_ids.items():
            assert states.block_table.block_ids(states.states[rid].row) == blocks
        if sched.is_empty:
            continue
        batch_states = [states.states[rid] for rid in sched.num_scheduled_tokens]
        batch = build_batch(batch_states, sched.num_scheduled_tokens, {}, states.block_table, CPU)
        _check_batch(batch, sched.num_scheduled_tokens, block_ids)
        sampled = {}
        for state in batch.sampling_states:  # what the runner does after its forward
            token = rng.randrange(1, 500)
            state.token_ids.append(token)
            sampled[state.request_id] = [token]
        for state in batch.order:
            state.num_computed_tokens += sched.num_scheduled_tokens[state.request_id]
        scheduler.update_from_output(sched, ModelRunnerOutput(sampled))
    assert scheduler.num_preemptions > 0
    states.update(scheduler.schedule())  # hands over the last finished ids
    assert not states.states
    table = states.block_table
    assert sorted(table.free_rows) == list(range(table.table.shape[0]))
    assert bool((table.table == NULL_BLOCK_ID).all())  # freed rows are cleared


def test_block_table_grows_rows_and_columns():
    table = BlockTable(BLOCK)
    rows = [table.add_row([i + 1]) for i in range(70)]  # more rows than the initial 64
    assert rows == list(range(70))
    table.append(rows[3], list(range(100, 300)))  # more blocks than the initial 64 columns
    assert table.block_ids(rows[3]) == [4, *range(100, 300)]
    assert table.block_ids(rows[69]) == [70]
    table.replace(rows[3], [9])
    assert table.block_ids(rows[3]) == [9] and int(table.table[rows[3], 1:].abs().sum()) == 0
    positions = torch.tensor([0, 3, 2])
    assert table.slot_mapping(torch.tensor([69, 69, 3]), positions).tolist() == [280, 283, 9 * BLOCK + 2]
