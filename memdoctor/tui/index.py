"""What the TUI reads: a Run's blocks as numpy columns on top of attribution's LiveIndex,
so that any instant's breakdown costs O(log n) and no key press scans all blocks; plus
what the screens show of the blocks (names, modules, shapes) and the curve per column.
No textual and no torch here.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from memdoctor.attribution import LiveIndex, int_column, module_of
from memdoctor.run import OOM, Mark, Run


@dataclass
class Header:
    """The small parts of a run: everything but the events and the blocks."""
    source: str = "dispatch"
    device: dict[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    script: str | None = None
    argv: list[str] = field(default_factory=list)
    torch_version: str = ""
    marks: list[Mark] = field(default_factory=list)
    ooms: list[OOM] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tensor:
    """One live block as the TUI shows it."""
    name: str
    category: str
    nbytes: int
    shape: list[int] | None
    dtype: str
    module: str | None
    phase: str
    step: int


class _Owner:
    """Just enough of a Block for attribution.module_of."""
    __slots__ = ("category", "name", "module")

    def __init__(self, category: str, name: str, module: str | None):
        self.category, self.name, self.module = category, name, module


class RunIndex(LiveIndex):
    """A run's live-bytes index plus the columns that say what each block is."""

    def __init__(self, header: Header, num_events: int, blocks: dict[str, Sequence]):
        super().__init__(num_events, blocks["nbytes"], blocks["category"], blocks["alloc_seq"], blocks["free_seq"])
        self.header = header
        # what the tensors are (names, modules, ...) may arrive later: see attach()
        self.names: Sequence[str] | None = None
        self.modules: Sequence[str | None] | None = None
        self.dtypes: Sequence[str] | None = None
        self.phases: Sequence[str] | None = None
        self.steps: np.ndarray | None = None
        self.shapes: Sequence[list[int]] | None = None
        self.attach(blocks)
        self._by_size = np.argsort(-self.nbytes, kind="stable")
        self._mark_seqs = [m.seq for m in header.marks]

    def attach(self, columns: dict[str, Sequence]) -> None:
        """Add the columns that say what each block is (name, module, dtype, phase, step,
        shape), when they are parsed after the index was built."""
        if "name" in columns:
            self.names = columns["name"]
        if "module" in columns:
            self.modules = columns["module"]
        if "dtype" in columns:
            self.dtypes = columns["dtype"]
        if "phase" in columns:
            self.phases = columns["phase"]
        if "step" in columns:
            self.steps = int_column(columns["step"], 0)
        if "shape" in columns:
            self.shapes = columns["shape"]

    @property
    def has_details(self) -> bool:
        return self.names is not None and self.modules is not None

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_run(cls, run: Run) -> "RunIndex":
        blocks = list(run.blocks.values())
        columns = {name: [getattr(b, name) for b in blocks]
                   for name in ("nbytes", "category", "name", "shape", "dtype", "module", "phase", "step",
                                "alloc_seq", "free_seq")}
        header = Header(source=run.source, device=run.device, budget_bytes=run.budget_bytes,
                        script=run.script, argv=run.argv, torch_version=run.torch_version,
                        marks=run.marks, ooms=run.ooms, meta=run.meta)
        return cls(header, run.num_events, columns)

    # ---- instants -------------------------------------------------------------------
    def top(self, seq: int, k: int = 10) -> list[int]:
        """Rows of the k largest blocks alive at seq: walks the blocks by size, a chunk at a
        time, and stops as soon as it has k (the big ones are usually long-lived)."""
        found: list[int] = []
        start, chunk, total = 0, 256, len(self._by_size)
        while start < total and len(found) < k:
            rows = self._by_size[start:start + chunk]
            alive = rows[(self.alloc[rows] <= seq) & (self.free[rows] > seq)]
            found.extend(int(r) for r in alive[:k - len(found)])
            start += chunk
            chunk *= 4
        return found

    def tensor(self, row: int) -> Tensor:
        """One block as the TUI shows it; fields not parsed yet are empty (None / "")."""
        cat = self.category_names[row]
        return Tensor(name=self.names[row] if self.names is not None else "", category=cat,
                      nbytes=int(self.nbytes[row]),
                      shape=self.shapes[row] if self.shapes is not None else None,
                      dtype=self.dtypes[row] if self.dtypes is not None else "",
                      module=self.module_of(row) if self.has_details else None,
                      phase=self.phases[row] if self.phases is not None else "",
                      step=int(self.steps[row]) if self.steps is not None else 0)

    def module_of(self, row: int) -> str | None:
        return module_of(_Owner(self.category_names[row], self.names[row], self.modules[row]))

    def mark_at(self, seq: int) -> Mark | None:
        i = bisect.bisect_right(self._mark_seqs, seq) - 1
        return self.header.marks[i] if i >= 0 else None

    def by_module(self, seq: int) -> dict[str, dict[str, int]]:
        """Module -> category -> bytes alive at seq (one vectorised pass; used for the peak)."""
        out: dict[str, dict[str, int]] = {}
        rows = np.nonzero(self.live_mask(seq))[0]
        for row in rows.tolist():
            mod = self.module_of(row)
            key = mod if mod else "(outside modules)" if mod is None else "(root)"
            cats = out.setdefault(key, {})
            cat = self.category_names[row]
            cats[cat] = cats.get(cat, 0) + int(self.nbytes[row])
        return out

    # ---- the curve, downsampled -------------------------------------------------------
    def buckets(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(max live bytes, seq of that max, first seq) for each of `width` columns: equal
        slices of the run; with fewer events than columns an event spans several columns."""
        n, width = self.num_events, max(1, width)
        if not n:
            zero = np.zeros(1, dtype=np.int64)
            return zero, zero, zero
        starts = (np.arange(width, dtype=np.int64) * n) // width
        ends = np.maximum(np.append(starts[1:], n), starts + 1)
        # reduceat gives curve[start] where a start repeats: exactly the one event it spans
        maxes = np.maximum.reduceat(self.curve, starts)
        where = np.array([s + int(np.argmax(self.curve[s:e])) for s, e in zip(starts.tolist(), ends.tolist())],
                         dtype=np.int64)
        return maxes, where, starts
