"""Run -> Breakdown: bytes by category and by module at any instant, at the peak and per
step, and the largest live tensors with where they came from; and LiveIndex, the one
live-bytes index that the report's charts and the TUI read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from memdoctor.run import CATEGORIES, Action, Block, Category, Run

_OWNED_BY_PARAM = (Category.WEIGHTS.value, Category.GRADIENTS.value, Category.OPTIMIZER_STATE.value)


@dataclass
class TensorInfo:
    name: str
    category: str
    nbytes: int
    shape: list[int]
    dtype: str
    module: str | None
    phase: str
    step: int
    source: str = ""            # the user's line that made it: "train.py:25 logits = model(x)"


@dataclass
class Breakdown:
    seq: int
    total_bytes: int
    by_category: dict[str, int]
    by_module: dict[str, int]
    phase: str
    step: int
    top: list[TensorInfo] = field(default_factory=list)
    reserved_bytes: int | None = None

    def to_dict(self) -> dict:
        return {"seq": self.seq, "total_bytes": self.total_bytes, "by_category": self.by_category,
                "by_module": self.by_module, "phase": self.phase, "step": self.step,
                "reserved_bytes": self.reserved_bytes,
                "top": [t.__dict__ for t in self.top]}


def source_label(run: Run, index: int) -> str:
    """"train.py:25 logits = model(x)" for a source index; "" when unknown."""
    source = run.source_at(index)
    if source is None:
        return ""
    text = source.text()
    return f"{source.label} {text}" if text else source.label


def module_of(block: Block) -> str | None:
    """The module a block belongs to: for parameter-owned memory the parameter's module."""
    if block.category in _OWNED_BY_PARAM and block.name:
        pname = block.name.split(":", 1)[0].removesuffix(".grad")
        return pname.rsplit(".", 1)[0] if "." in pname else ""
    return block.module


def live_curve(run: Run) -> list[int]:
    """Live bytes after each event."""
    live, out = 0, []
    append = out.append
    for action, nbytes in zip(run.actions, run.event_bytes):
        if action == Action.ALLOC:
            live += nbytes
        elif action == Action.FREE:
            live -= nbytes
        append(live)
    return out


def peak(run: Run, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(seq, bytes) of the highest live total in [start, end)."""
    live, best, best_seq = 0, -1, 0
    end = run.num_events if end is None else end
    for seq, (action, nbytes) in enumerate(zip(run.actions, run.event_bytes)):
        if seq >= end:
            break
        if action == Action.ALLOC:
            live += nbytes
        elif action == Action.FREE:
            live -= nbytes
        if seq >= start and live > best:
            best, best_seq = live, seq
    return best_seq, max(best, 0)


def live_blocks(run: Run, seq: int) -> list[Block]:
    """Blocks alive just after event `seq`."""
    return [b for b in run.blocks.values()
            if b.alloc_seq <= seq and (b.free_seq is None or b.free_seq > seq)]


NEVER = np.iinfo(np.int64).max      # free seq of a block that is never freed


def int_column(values: Any, none: int) -> np.ndarray:
    """A column of ints (None read as `none`) as an int64 array."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    return np.fromiter((none if v is None else v for v in values), dtype=np.int64, count=len(values))


class LiveIndex:
    """Live bytes, in total and per category, just after any event, from four block columns.

    The rule is live_blocks' (alloc_seq <= seq < free_seq) without walking the blocks: for
    each category the alloc seqs and the free seqs of its blocks are sorted once with the
    running sum of their bytes, and its live bytes at `seq` are two binary searches, (bytes
    allocated at or before seq) - (bytes freed at or before seq). The categories are the
    seven known ones, then any others the blocks name.
    """

    def __init__(self, num_events: int, nbytes: Sequence[int], category: Sequence[str],
                 alloc_seq: Sequence[int], free_seq: Sequence[int | None]):
        self.num_events = n = int(num_events)
        self.nbytes = int_column(nbytes, 0)
        self.alloc = int_column(alloc_seq, 0)
        free = int_column(free_seq, -1)
        self.free = np.where(free < 0, NEVER, free)
        self.categories: list[str] = list(CATEGORIES)
        codes_of = {c: i for i, c in enumerate(self.categories)}
        for c in sorted(set(category) - set(codes_of), key=str):
            codes_of[c] = len(self.categories)
            self.categories.append(c)
        self.category_names = category
        self.codes = np.fromiter(map(codes_of.__getitem__, category), dtype=np.int16, count=len(category))

        # per category: sorted alloc/free seqs and the running sums of their bytes
        self._cum: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for code in range(len(self.categories)):
            mask = self.codes == code
            a, f, b = self.alloc[mask], self.free[mask], self.nbytes[mask]
            order = np.argsort(a, kind="stable")
            a_sorted, a_cum = a[order], np.concatenate(([0], np.cumsum(b[order])))
            freed = f != NEVER
            f, fb = f[freed], b[freed]
            order = np.argsort(f, kind="stable")
            self._cum.append((a_sorted, a_cum, f[order], np.concatenate(([0], np.cumsum(fb[order])))))

        # the total after each event, by the same rule
        delta = np.zeros(n + 1, dtype=np.int64)
        inside = (self.alloc >= 0) & (self.alloc < n)
        np.add.at(delta, self.alloc[inside], self.nbytes[inside])
        gone = self.free < n
        np.add.at(delta, self.free[gone], -self.nbytes[gone])
        self.curve = np.cumsum(delta[:n]) if n else np.zeros(0, dtype=np.int64)
        if n:
            self.peak_seq = int(np.argmax(self.curve))
            self.peak_bytes = int(self.curve[self.peak_seq])
        else:
            self.peak_seq, self.peak_bytes = 0, 0

    @classmethod
    def from_run(cls, run: Run) -> "LiveIndex":
        blocks = run.blocks.values()
        return cls(run.num_events, [b.nbytes for b in blocks], [b.category for b in blocks],
                   [b.alloc_seq for b in blocks], [b.free_seq for b in blocks])

    def clamp(self, seq: int) -> int:
        return max(0, min(int(seq), self.num_events - 1)) if self.num_events else 0

    def total_at(self, seq: int) -> int:
        return int(self.curve[self.clamp(seq)]) if self.num_events else 0

    def _live(self, code: int, seqs):
        a, a_cum, f, f_cum = self._cum[code]
        return a_cum[np.searchsorted(a, seqs, "right")] - f_cum[np.searchsorted(f, seqs, "right")]

    def by_category(self, seq: int) -> dict[str, int]:
        """Live bytes per category just after event seq: O(categories x log blocks)."""
        return {name: int(self._live(code, seq)) for code, name in enumerate(self.categories)}

    def categories_at(self, seqs: np.ndarray) -> dict[str, np.ndarray]:
        """Live bytes per category just after each of the events `seqs` (int64 arrays)."""
        return {name: self._live(code, seqs) for code, name in enumerate(self.categories)}

    def live_mask(self, seq: int) -> np.ndarray:
        """Which blocks are alive just after event seq."""
        return (self.alloc <= seq) & (self.free > seq)


def breakdown_at(run: Run, seq: int, top: int = 10) -> Breakdown:
    blocks = live_blocks(run, seq)
    by_category = dict.fromkeys(CATEGORIES, 0)
    by_module: dict[str, int] = {}
    for b in blocks:
        by_category[b.category] = by_category.get(b.category, 0) + b.nbytes
        mod = module_of(b)
        key = mod if mod else "(outside modules)" if mod is None else "(root)"
        by_module[key] = by_module.get(key, 0) + b.nbytes
    biggest = sorted(blocks, key=lambda b: b.nbytes, reverse=True)[:top]
    mark = run.mark_at(seq)
    reserved = None
    for s in run.samples:
        if s.seq <= seq:
            reserved = s.reserved
    return Breakdown(
        seq=seq, total_bytes=sum(b.nbytes for b in blocks), by_category=by_category,
        by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
        phase=mark.phase if mark else "other", step=mark.step if mark else 0,
        top=[TensorInfo(b.name, b.category, b.nbytes, b.shape, b.dtype, module_of(b), b.phase, b.step,
                        source_label(run, b.source)) for b in biggest],
        reserved_bytes=reserved)


def at_peak(run: Run, top: int = 10) -> Breakdown:
    seq, _ = peak(run)
    return breakdown_at(run, seq, top)


def at_oom(run: Run, top: int = 10) -> Breakdown | None:
    """What was alive when the first OOM struck (the request itself is not in it)."""
    if not run.ooms:
        return None
    return breakdown_at(run, max(run.ooms[0].seq - 1, 0), top)


def step_ranges(run: Run) -> list[tuple[int, int, int]]:
    """(step, first seq, end seq) for each step seen in the marks."""
    bounds: dict[int, list[int]] = {}
    for m in run.marks:
        r = bounds.setdefault(m.step, [m.seq, m.seq])
        r[0] = min(r[0], m.seq)
    steps = sorted(bounds)
    out = []
    for i, s in enumerate(steps):
        end = bounds[steps[i + 1]][0] if i + 1 < len(steps) else run.num_events
        out.append((s, bounds[s][0], end))
    return out


def per_step(run: Run) -> list[dict]:
    """Peak and end-of-step live bytes per step: a leak shows as a slope."""
    curve = live_curve(run)
    rows = []
    for step, start, end in step_ranges(run):
        if end <= start:
            continue
        window = curve[start:end]
        rows.append({"step": step, "peak_bytes": max(window), "end_bytes": window[-1],
                     "start_seq": start, "end_seq": end})
    return rows
