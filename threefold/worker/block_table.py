"""BlockTable: every live request's block ids, kept across steps as rows of one tensor.

    row 0  [ 7  8 12  0  0  0 ...]   num_blocks[0] = 3
    row 1  [ 3  0  0  0  0  0 ...]   num_blocks[1] = 1
    row 2  [ 0  0  0  0  0  0 ...]   free
             ^ NULL_BLOCK_ID pads every row past its blocks

A request's row grows by the block ids the scheduler hands out each step
(vLLM v1's `BlockTable`), so a step never rebuilds the tables from Python
lists: decode tables are one row gather, and slot mappings one vector pass.
The table lives on the host; what a step needs is copied to the device.
"""

from __future__ import annotations

import torch

from threefold.core.block_pool import NULL_BLOCK_ID

_INITIAL_ROWS = 64
_INITIAL_BLOCKS = 64


class BlockTable:
    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.table = torch.full((_INITIAL_ROWS, _INITIAL_BLOCKS), NULL_BLOCK_ID, dtype=torch.long)
        """[max_rows, max_blocks] int64 on the host; both sizes double when outgrown."""
        self.num_blocks = [0] * _INITIAL_ROWS
        self.free_rows = list(range(_INITIAL_ROWS - 1, -1, -1))  # popped from the end: row 0 first

    # ---- rows ---------------------------------------------------------------
    def add_row(self, block_ids: list[int]) -> int:
        """A fresh row holding `block_ids`; the caller frees it with `free_row`."""
        if not self.free_rows:
            self._grow(rows=2 * self.table.shape[0], cols=self.table.shape[1])
        row = self.free_rows.pop()
        self.append(row, block_ids)
        return row

    def free_row(self, row: int) -> None:
        self.table[row, : self.num_blocks[row]] = NULL_BLOCK_ID
        self.num_blocks[row] = 0
        self.free_rows.append(row)

    def append(self, row: int, block_ids: list[int]) -> None:
        """Add the blocks newly allocated to the request of `row` (O(new blocks))."""
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            cols = self.table.shape[1]
            while cols < end:
                cols *= 2
            self._grow(rows=self.table.shape[0], cols=cols)
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        self.num_blocks[row] = end

    def replace(self, row: int, block_ids: list[int]) -> None:
        """A request resumed after preemption: its blocks are all new."""
        self.table[row, : self.num_blocks[row]] = NULL_BLOCK_ID
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def truncate(self, row: int, num_blocks: int) -> None:
        """Keep the row's first num_blocks blocks (the scheduler freed the rest)."""
        if num_blocks < self.num_blocks[row]:
            self.table[row, num_blocks : self.num_blocks[row]] = NULL_BLOCK_ID
            self.num_blocks[row] = num_blocks

    def block_ids(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()

    def _grow(self, rows: int, cols: int) -> None:
        """Rare (sizes double): copy into a larger table."""
        table = torch.full((rows, cols), NULL_BLOCK_ID, dtype=torch.long)
        old_rows, old_cols = self.table.shape
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows
        self.num_blocks += [0] * (rows - old_rows)

    # ---- per-step views -------------------------------------------------------
    def rows(self, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[len(rows), num_blocks] on the device: the first blocks of each row, NULL-padded."""
        if num_blocks > self.table.shape[1]:
            self._grow(rows=self.table.shape[0], cols=num_blocks)
        # index_select, then narrow: cheaper than advanced indexing with a slice (measured).
        return self.table.index_select(0, rows)[:, :num_blocks].contiguous().to(self.device)

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] cache slot of each token: its row's block at position // block_size, plus the offset.

        token_rows, positions: [T] int64 on the host.
        """
        flat_index = token_rows * self.table.shape[1] + positions // self.block_size
        block_ids = self.table.view(-1).index_select(0, flat_index)
        return (block_ids * self.block_size + positions % self.block_size).to(self.device)
