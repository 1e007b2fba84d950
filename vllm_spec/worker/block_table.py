"""A batch's block tables as one [B, blocks] array, kept across steps.

Building the array from every sequence's list costs a pass over every block id of the batch
(~50-90 us at batch 256). From one step to the next a decode batch keeps its sequences and
their tables only grow at the end, so the last step's array is kept and only the block ids
appended since are written: the persistent block table of vLLM V1's InputBatch.

This rests on one invariant of the block manager: a table list changes only by appending to it;
any other change (free on finish, abort or preemption) gives the sequence a NEW list. So a list
object seen before holds what it held then plus what was appended since, and a table that comes
back at the same length with other ids (preemption and re-admission) is another list object.
Lists are compared by identity and referenced until the next call: a freed list's id cannot be
reused by a new one while it is compared against.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.worker.batch import SeqInput

_table_of = operator.attrgetter("block_table")


class BlockTableArray:
    """The block-table array of the last batch prepared, updated for the next one."""

    def __init__(self):
        self._tables: list[list[int]] = []          # the last batch's lists (compared by identity)
        self._lens = np.zeros(0, dtype=np.int64)   # their lengths when written into _array
        self._array = np.zeros((0, 0), dtype=np.int64)

    def __call__(self, seqs: list[SeqInput]) -> np.ndarray:
        """[B, longest table] int64 block tables, NULL_BLOCK past each sequence's end: a view,
        read-only and valid until the next call."""
        tables = list(map(_table_of, seqs))
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        width = int(lens.max())
        if (len(tables) != len(self._tables) or width > self._array.shape[1]
                or not all(map(operator.is_, tables, self._tables))):
            # Other sequences, or a table outgrew the array: rebuild, with room for tables to grow.
            flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
            self._array = np.full((len(tables), 2 * width), NULL_BLOCK, dtype=np.int64)
            self._array[np.arange(2 * width)[None, :] < lens[:, None]] = flat   # row-major, as `flat`
        else:
            for i in np.flatnonzero(lens != self._lens).tolist():
                start, table = self._lens[i], tables[i]
                self._array[i, start: len(table)] = table[start:]
        self._tables, self._lens = tables, lens
        view = self._array[:, :width]
        view.flags.writeable = False   # the array is kept for the next step: a write would corrupt it
        return view
