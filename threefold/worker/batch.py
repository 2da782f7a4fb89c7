"""Turning a SchedulerOutput into one flattened batch of tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threefold.core.outputs import NewRequestData, SchedulerOutput
from threefold.sample.metadata import TokenCounts
from threefold.sample.params import SamplingParams
from threefold.spec.tree import verify_positions
from threefold.worker.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from threefold.worker.block_table import BlockTable
from threefold.worker.tree_verify import TreeGroup, tree_bits, tree_group


@dataclass
class CachedRequestState:
    """The runner's copy of a request, kept across steps (and across preemption)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    row: int
    """This request's row in the runner's BlockTable."""
    num_computed_tokens: int
    generator: torch.Generator | None
    penalties: TokenCounts | None = None
    """Only for requests with a penalty: counts kept up to date token by token."""
    prompt_logprobs: list = field(default_factory=list)
    """Accumulated over prefill chunks; handed back once the prompt is done."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class RequestStates:
    """The runner's copies of the requests and their BlockTable rows, updated from each
    SchedulerOutput. An update costs O(new requests' tokens + new blocks), never O(context)."""

    def __init__(self, block_size: int, vocab_size: int, device: torch.device) -> None:
        self.states: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable(block_size, device)
        self.vocab_size = vocab_size
        self.device = device

    def update(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_req_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.block_table.free_row(state.row)
        for request_id, num_blocks in sched.trimmed_blocks.items():
            trimmed = self.states.get(request_id)
            if trimmed is not None:
                self.block_table.truncate(trimmed.row, num_blocks)
        for new in sched.scheduled_new_reqs:
            self._add(new)
        for cached in sched.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed_from_preemption:
                self.block_table.replace(state.row, cached.new_block_ids)
            else:
                self.block_table.append(state.row, cached.new_block_ids)

    def _add(self, new: NewRequestData) -> None:
        old = self.states.get(new.request_id)
        token_ids = list(new.prompt_token_ids)
        if old is not None:
            # Re-sent after preemption: its "prompt" now includes the outputs so far. Keep
            # the original prompt length, the generator and the penalty counts.
            old.token_ids, old.num_computed_tokens = token_ids, new.num_computed_tokens
            self.block_table.replace(old.row, new.block_ids)
            return
        params = new.sampling_params
        generator = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        counts = TokenCounts.for_params(params, token_ids, [], self.vocab_size, self.device)
        self.states[new.request_id] = CachedRequestState(
            new.request_id, token_ids, len(token_ids), params, self.block_table.add_row(new.block_ids),
            new.num_computed_tokens, generator, counts)


@dataclass
class StepBatch:
    """One step's inputs. Requests are ordered decodes first, then prefill chunks."""

    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    attn: AttentionMetadata
    order: list[CachedRequestState]
    query_starts: list[int]
    query_lens: list[int]
    sample_rows: list[int]
    """Token index whose logits feed sampling, per request in `order` that samples."""
    sampling_states: list[CachedRequestState]


def build_batch(states: list[CachedRequestState], num_scheduled: dict[str, int],
                spec_tokens: dict[str, list[int]], block_table: BlockTable, device: torch.device,
                sliding_window: int | None = None, native_decode: bool = False,
                trees: dict[str, list[int]] | None = None) -> StepBatch:
    """native_decode: the decodes go to the native kernel as one group with no mask (and the
    candidate trees as a second, with their ancestor masks); otherwise they are bucketed by length
    for the torch path. trees: request id -> the parent ids of the candidate tree its drafts form
    (worker/tree_verify.py); other drafts are chains.

    Python work is O(requests + scheduled tokens), never O(context): block tables
    and slots come from the persistent `block_table`."""
    trees = trees or {}
    # Decodes (with their drafts: a verify is a multi-query decode) first, shortest context first
    # (so length buckets are contiguous), then tree verifies, then prefill chunks.
    order = sorted(states, key=lambda s: (_kind(s, num_scheduled[s.request_id], trees), s.num_computed_tokens))
    input_ids: list[int] = []
    starts, lens, sample_rows, sampling = [], [], [], []
    for state in order:
        start, n = state.num_computed_tokens, num_scheduled[state.request_id]
        starts.append(len(input_ids))
        lens.append(n)
        input_ids.extend(state.token_ids[start : start + n])  # no copy of the whole sequence per step
        if start + n > len(state.token_ids):  # speculative drafts ride after the known tokens
            input_ids.extend(spec_tokens[state.request_id][: start + n - len(state.token_ids)])
        if start + n >= len(state.token_ids):
            sample_rows.append(len(input_ids) - 1)
            sampling.append(state)
    # Every token's position and block-table row, in one vector pass.
    rows = torch.tensor([s.row for s in order], dtype=torch.long)
    if len(input_ids) == len(order):  # decodes only: one token per request at its context length
        token_rows, positions = rows, torch.tensor([s.num_computed_tokens for s in order], dtype=torch.long)
    else:
        lens_t = torch.tensor(lens, dtype=torch.long)
        offsets = torch.tensor([s.num_computed_tokens - q for s, q in zip(order, starts, strict=True)],
                               dtype=torch.long)
        token_rows = rows.repeat_interleave(lens_t)
        positions = torch.arange(len(input_ids), dtype=torch.long) + offsets.repeat_interleave(lens_t)  # [T]
    slots = block_table.slot_mapping(token_rows, positions)  # tree rows take consecutive slots too
    verify_trees = []  # (index in order, parent ids) of each tree verify, in order
    for i, state in enumerate(order):
        parents = trees.get(state.request_id)
        if parents is not None and _kind(state, lens[i], trees) == 1:
            positions[starts[i] : starts[i] + lens[i]] = verify_positions(parents, state.num_computed_tokens)
            verify_trees.append((i, parents))
    attn = _attention_metadata(order, starts, lens, rows, slots, block_table, device, sliding_window, native_decode,
                               verify_trees)
    return StepBatch(torch.tensor(input_ids, device=device), positions.to(device), attn,
                     order, starts, lens, sample_rows, sampling)


def _kind(state: CachedRequestState, num_scheduled: int, trees: dict[str, list[int]]) -> int:
    """0: a decode or chain verify; 1: a tree verify; 2: a prefill chunk."""
    if not _is_decode(state, num_scheduled):
        return 2
    return 1 if num_scheduled > 1 and state.request_id in trees else 0


def _is_decode(state: CachedRequestState, num_scheduled: int) -> bool:
    """One new token, or the last real token plus speculative drafts (k+1 queries)."""
    return num_scheduled == 1 or state.num_computed_tokens + 1 == len(state.token_ids)


def _attention_metadata(order: list[CachedRequestState], starts: list[int], lens: list[int], rows: torch.Tensor,
                        slots: torch.Tensor, block_table: BlockTable, device: torch.device,
                        sliding_window: int | None, native_decode: bool,
                        verify_trees: list[tuple[int, list[int]]]) -> AttentionMetadata:
    block_size = block_table.block_size
    num_verifies = sum(1 for state, n in zip(order, lens, strict=False) if _is_decode(state, n))
    num_decodes = num_verifies - len(verify_trees)  # the tree verifies come right after the decodes
    # Every decode query is one row: a verify's k+1 queries share the request's block-table row
    # and see one more key each (its draft's, written before attention), as gpt-fast scores
    # [last, *drafts] in one call.
    query_rows = rows[:num_decodes].repeat_interleave(torch.tensor(lens[:num_decodes], dtype=torch.long))
    contexts = [state.num_computed_tokens + j
                for state, n in zip(order[:num_decodes], lens, strict=False) for j in range(n)]
    one_group = [(0, len(contexts))] if contexts else []
    buckets = one_group if native_decode else _length_buckets(contexts, block_size)
    groups = [_decode_group(contexts[lo:hi], query_rows[lo:hi], lo, block_table, device, sliding_window,
                            with_mask=not native_decode)
              for lo, hi in buckets]
    tree_groups: list[TreeGroup] = []
    if verify_trees and native_decode and sliding_window is None:
        groups.append(_tree_decode_group(order, starts, rows, verify_trees, block_table, device))
    else:
        tree_groups = [tree_group(parents, order[i].num_computed_tokens, starts[i], order[i].row, block_table,
                                  device, sliding_window) for i, parents in verify_trees]
    prefills = []
    for i in range(num_verifies, len(order)):
        state, start, n = order[i], starts[i], lens[i]
        num_blocks = -(-(state.num_computed_tokens + n) // block_size)
        table = block_table.rows(rows[i : i + 1], num_blocks)  # [1, num_blocks]
        prefills.append(PrefillChunk(start, n, state.num_computed_tokens, table))
    return AttentionMetadata(slots, groups, prefills, sliding_window, tree_groups)


def _tree_decode_group(order: list[CachedRequestState], starts: list[int], rows: torch.Tensor,
                       verify_trees: list[tuple[int, list[int]]], block_table: BlockTable,
                       device: torch.device) -> DecodeGroup:
    """Every tree verify of the step as one native decode group: tree row r of a request with C
    computed tokens reads C + r + 1 keys (its ancestors come before it) and sees, of the tree keys
    from C on, only those its bits allow."""
    sizes = [len(parents) + 1 for _, parents in verify_trees]
    words = -(-max(sizes) // 64)
    contexts = torch.tensor([order[i].num_computed_tokens for i, _ in verify_trees], dtype=torch.long)
    sizes_t = torch.tensor(sizes, dtype=torch.long)
    tree_starts = contexts.repeat_interleave(sizes_t)
    seq_lens = tree_starts + torch.cat([torch.arange(1, size + 1) for size in sizes])
    query_rows = rows[[i for i, _ in verify_trees]].repeat_interleave(sizes_t)
    table = block_table.rows(query_rows, -(-int(seq_lens.max()) // block_table.block_size))
    bits = torch.cat([tree_bits(parents, words) for _, parents in verify_trees])
    return DecodeGroup(starts[verify_trees[0][0]], len(seq_lens), table, seq_lens.to(device), None,
                       tree_starts.to(device), bits.to(device))


# A bucket's longest context is at most this many times its shortest: padding
# every decode to the batch's longest context made one 2k-token request cost
# the whole batch ~10x in gathered K/V (measured on ShareGPT); buckets bound the
# waste at the price of one gather + SDPA call per bucket and layer.
_BUCKET_GROWTH = 1.5


def _length_buckets(contexts: list[int], block_size: int) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of decode queries (sorted by context) whose block counts are within a factor."""
    buckets, lo = [], 0
    for i, context in enumerate(contexts):
        blocks = context // block_size + 1
        first = contexts[lo] // block_size + 1
        if i > lo and blocks > _BUCKET_GROWTH * first + 1:
            buckets.append((lo, i))
            lo = i
    if contexts:
        buckets.append((lo, len(contexts)))
    return buckets


def _decode_group(contexts: list[int], rows: torch.Tensor, first_token: int, block_table: BlockTable,
                  device: torch.device, sliding_window: int | None, with_mask: bool) -> DecodeGroup:
    """contexts: keys before each query; rows: each query's block-table row."""
    block_size = block_table.block_size
    seq_lens = [context + 1 for context in contexts]
    max_blocks = -(-max(seq_lens) // block_size)
    table = block_table.rows(rows, max_blocks)  # [num_queries, max_blocks]
    lengths = torch.tensor(seq_lens, dtype=torch.long, device=device)
    if not with_mask:
        return DecodeGroup(first_token, len(contexts), table, lengths, None)
    key_pos = torch.arange(max_blocks * block_size, device=device).unsqueeze(0)
    visible = key_pos < lengths.unsqueeze(1)
    if sliding_window is not None:
        visible &= key_pos >= lengths.unsqueeze(1) - sliding_window
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    return DecodeGroup(first_token, len(contexts), table, lengths, mask)
