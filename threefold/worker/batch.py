"""Turning a SchedulerOutput into one flattened batch of tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threefold.core.block_pool import NULL_BLOCK_ID
from threefold.sample.params import SamplingParams
from threefold.worker.attention import AttentionMetadata, DecodeGroup, PrefillChunk


@dataclass
class CachedRequestState:
    """The runner's copy of a request, kept across steps (and across preemption)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_logprobs: list = field(default_factory=list)
    """Accumulated over prefill chunks; handed back once the prompt is done."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


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
                spec_tokens: dict[str, list[int]], block_size: int, device: torch.device,
                sliding_window: int | None = None, native_decode: bool = False) -> StepBatch:
    """native_decode: the decodes go to the native kernel as one group with no mask;
    otherwise they are bucketed by length for the torch path."""
    # Decodes (with their drafts: a verify is a multi-query decode) first, shortest context first
    # (so length buckets are contiguous), then prefill chunks.
    order = sorted(states, key=lambda s: (not _is_decode(s, num_scheduled[s.request_id]), s.num_computed_tokens))
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, lens, sample_rows, sampling = [], [], [], []
    for state in order:
        start, n = state.num_computed_tokens, num_scheduled[state.request_id]
        starts.append(len(input_ids))
        lens.append(n)
        input_ids.extend(state.token_ids[start : start + n])  # no copy of the whole sequence per step
        if start + n > len(state.token_ids):  # speculative drafts ride after the known tokens
            input_ids.extend(spec_tokens[state.request_id][: start + n - len(state.token_ids)])
        positions.extend(range(start, start + n))
        slots.extend(state.block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if start + n >= len(state.token_ids):
            sample_rows.append(len(input_ids) - 1)
            sampling.append(state)
    attn = _attention_metadata(order, starts, lens, slots, block_size, device, sliding_window, native_decode)
    return StepBatch(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), attn,
                     order, starts, lens, sample_rows, sampling)


def _is_decode(state: CachedRequestState, num_scheduled: int) -> bool:
    """One new token, or the last real token plus speculative drafts (k+1 queries)."""
    return num_scheduled == 1 or state.num_computed_tokens + 1 == len(state.token_ids)


def _attention_metadata(order: list[CachedRequestState], starts: list[int], lens: list[int],
                        slots: list[int], block_size: int, device: torch.device,
                        sliding_window: int | None, native_decode: bool) -> AttentionMetadata:
    num_decodes = sum(1 for state, n in zip(order, lens) if _is_decode(state, n))
    # Every decode query is one row: a verify's k+1 queries share the block table and see
    # one more key each (its own draft's, written before attention), as gpt-fast scores [last, *drafts].
    rows = [(state.block_ids, state.num_computed_tokens + j) for state, n in zip(order[:num_decodes], lens)
            for j in range(n)]
    if native_decode:
        buckets = [(0, len(rows))] if rows else []
    else:
        buckets = _length_buckets([context for _, context in rows], block_size)
    groups = [_decode_group(rows[lo:hi], lo, block_size, device, sliding_window, with_mask=not native_decode)
              for lo, hi in buckets]
    prefills = []
    for state, start, n in zip(order[num_decodes:], starts[num_decodes:], lens[num_decodes:]):
        num_blocks = -(-(state.num_computed_tokens + n) // block_size)
        prefills.append(PrefillChunk(start, n, state.num_computed_tokens,
                                     torch.tensor([state.block_ids[:num_blocks]], device=device)))
    return AttentionMetadata(torch.tensor(slots, device=device), groups, prefills, sliding_window)


# A bucket's longest context is at most this many times its shortest: padding
# every decode to the batch's longest context made one 2k-token request cost
# the whole batch ~10x in gathered K/V (measured on ShareGPT); buckets bound the
# waste at the price of one gather + SDPA call per bucket and layer.
_BUCKET_GROWTH = 1.5


def _length_buckets(contexts: list[int], block_size: int) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of decode rows (sorted by context) whose block counts are within a factor."""
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


def _decode_group(rows: list[tuple[list[int], int]], first_token: int, block_size: int, device: torch.device,
                  sliding_window: int | None, with_mask: bool) -> DecodeGroup:
    """rows: (block_ids, keys before the query) per decode query."""
    seq_lens = [context + 1 for _, context in rows]
    max_blocks = -(-max(seq_lens) // block_size)
    table = [ids[:max_blocks] + [NULL_BLOCK_ID] * (max_blocks - len(ids[:max_blocks])) for ids, _ in rows]
    block_table = torch.tensor(table, dtype=torch.long, device=device)
    lengths = torch.tensor(seq_lens, dtype=torch.long, device=device)
    if not with_mask:
        return DecodeGroup(first_token, len(rows), block_table, lengths, None)
    key_pos = torch.arange(max_blocks * block_size, device=device).unsqueeze(0)
    visible = key_pos < lengths.unsqueeze(1)
    if sliding_window is not None:
        visible &= key_pos >= lengths.unsqueeze(1) - sliding_window
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    return DecodeGroup(first_token, len(rows), block_table, lengths, mask)
