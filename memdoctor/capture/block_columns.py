"""The blocks a trace records, kept as columns until it ends.

A Block object per storage would stay alive for the whole run, and the garbage collector
walks every such object at each full collection: a run of many small ops spent about as
long in the collector as in recording. A column holds only ints, strings, None and the
shape lists shared by all blocks of one shape, so the collector sees one list per column.
The Recorder turns the columns into the Run's Block objects once, when the trace stops.
"""
from __future__ import annotations

from itertools import repeat

from memdoctor.run import Block


class BlockColumns:
    """Block `i`'s fields are item `i` of each column (its id is `i`)."""
    __slots__ = ("nbytes", "category", "name", "shape", "dtype", "device", "module", "phase", "step",
                 "alloc_seq", "free_seq", "source", "_appends")

    def __init__(self):
        for column in self.__slots__[:-1]:
            setattr(self, column, [])
        # each column's append, in slot order: a row is appended with one call each
        self._appends = tuple(getattr(self, c).append for c in self.__slots__[:-1])

    def __len__(self) -> int:
        return len(self.nbytes)

    def append(self, nbytes: int, category: str, name: str, shape: list[int], dtype: str, device: str,
               module: str | None, phase: str, step: int, alloc_seq: int) -> int:
        """A new block, not freed and of no known line yet; its id."""
        i = len(self.nbytes)
        a = self._appends
        a[0](nbytes), a[1](category), a[2](name), a[3](shape), a[4](dtype), a[5](device)
        a[6](module), a[7](phase), a[8](step), a[9](alloc_seq), a[10](None), a[11](-1)
        return i

    def blocks(self, start: int = 0) -> dict[int, Block]:
        """Block objects of ids `start` on, by id."""
        columns = (self.nbytes, self.category, self.name, self.shape, self.dtype, self.device, self.module,
                   self.phase, self.step, self.alloc_seq, self.free_seq)
        ids = range(start, len(self))
        # map calls Block with one item of each column: no row tuple made per block
        return dict(zip(ids, map(Block, ids, *(c[start:] for c in columns), repeat(None), self.source[start:])))
