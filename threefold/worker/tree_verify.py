"""Candidate trees verified inside the engine: the verify rows' positions and mask, and keeping the
accepted path's KV.

A request verifying a tree of N nodes computes N + 1 query rows (root = its last real token, then
every node in node order). Their K/V go to the request's next N + 1 slots in node order, so the
scheduler's lookahead slots hold a tree as they hold a chain:

    slots     C     C+1   C+2   C+3   C+4          C = the root's position (computed tokens)
    rows      root  n0    n1    n2    n3           n0, n1 children of the root; n2 under n0; n3 under n1
    position  C     C+1   C+1   C+2   C+2          RoPE sees root_position + depth

Row r attends to the whole context before the root plus the tree rows that are r or its ancestors
(spec/tree.verify_mask), so each row computes what a causal pass over its path would. Two paths
compute it:

    native kernel   the tree rows are one more decode group: row r reads C + r + 1 keys in place
                    (its ancestors all come before it) with an ancestor bitmask over the tree keys
                    (`tree_bits`; the kernel's TreeMask), every tree of the step in one call
    plain torch     one SDPA call per tree request over its gathered blocks and a bool mask
                    (`tree_group`): the reference, and the path of sliding-window models (the
                    kernel's window is counted from a row's key count, not from its depth)

After acceptance the path's K/V are moved to the chain slots C+1, C+2, ... (`keep_path`, through
the codec's read and write); the scheduler then frees the blocks past the accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.kv.paged import PagedKVCache
from threefold.spec.tree import verify_mask, verify_positions
from threefold.worker.block_table import BlockTable


@dataclass
class TreeGroup:
    """One request's tree verify rows, attended in one masked call."""

    query_start: int
    num_rows: int
    block_table: torch.Tensor
    """[1, num_blocks] blocks covering the context and every tree row."""
    mask: torch.Tensor
    """[1, 1, num_rows, num_blocks * block_size] bool: True where the row may attend."""


def tree_group(parent_ids: list[int], root_position: int, query_start: int, row: int, block_table: BlockTable,
               device: torch.device, sliding_window: int | None = None) -> TreeGroup:
    """The verify rows of one request whose block-table row is `row`; keys are laid out by slot
    (context 0..C-1, then the tree rows at C..C+N)."""
    num_rows = len(parent_ids) + 1
    num_keys = root_position + num_rows
    num_blocks = -(-num_keys // block_table.block_size)
    table = block_table.rows(torch.tensor([row], dtype=torch.long), num_blocks)
    visible = torch.zeros(num_rows, num_blocks * block_table.block_size, dtype=torch.bool)
    visible[:, :root_position] = True
    if sliding_window is not None:  # the context keys inside each row's window (tree rows are all recent)
        row_positions = verify_positions(parent_ids, root_position)
        keys = torch.arange(root_position)
        visible[:, :root_position] &= keys[None, :] > row_positions[:, None] - sliding_window
    visible[:, root_position:num_keys] = verify_mask(parent_ids)
    return TreeGroup(query_start, num_rows, table, visible.to(device)[None, None])


def tree_bits(parent_ids: list[int], words: int) -> torch.Tensor:
    """[N + 1, words] int64: row r's bit j (word j // 64, bit j % 64) is set where tree row j is r or
    one of its ancestors (spec/tree.verify_mask packed for the native kernel)."""
    mask = verify_mask(parent_ids)
    padded = torch.zeros(mask.shape[0], words * 64, dtype=torch.long)
    padded[:, : mask.shape[1]] = mask
    return (padded.view(-1, words, 64) << torch.arange(64)).sum(-1)  # bit 63 wraps to the sign bit, as meant


def keep_path(cache: PagedKVCache, block_table: BlockTable, row: int, root_position: int, path: list[int]) -> None:
    """Move the K/V of the accepted nodes `path` (root-down node ids) from their tree slots
    root_position + 1 + node to the chain slots root_position + 1, + 2, ... in every layer (a
    layer's sources are all read before any destination is written)."""
    moves = [(root_position + 1 + node, root_position + 1 + depth) for depth, node in enumerate(path)
             if node != depth]
    if not moves:
        return
    size = block_table.block_size
    rows = torch.tensor([row] * len(moves), dtype=torch.long)
    src = torch.tensor([s for s, _ in moves], dtype=torch.long)
    dst = block_table.slot_mapping(rows, torch.tensor([d for _, d in moves], dtype=torch.long))
    src_blocks = block_table.rows(torch.tensor([row], dtype=torch.long), int(src.max()) // size + 1)[0]
    table = src_blocks[src // size].view(-1, 1)  # [M, 1]: each source's block
    offsets = (src % size).to(table.device)
    picked = torch.arange(len(moves), device=table.device)
    for layer in range(len(cache.layers)):
        keys, values = cache.read(layer, table)  # [M, kvh, block_size, d]
        cache.write(layer, dst, keys[picked, :, offsets], values[picked, :, offsets])
