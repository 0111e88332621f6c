"""Live-memory curves of a Run as arrays, and downsampling that keeps what matters exact.

A long run has millions of events; a chart needs a few thousand points. The curves are
computed in one pass over the events (numpy cumulative sums, one array per category), never
by a breakdown per sample. Downsampling keeps, per bucket of events, the lowest and the
highest total, plus the peak and every OOM (and the event before it), so the highest point
drawn is the true peak and every OOM sits where it happened.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memdoctor.run import CATEGORIES, Action, Category, Run

DEFAULT_MAX_POINTS = 5_000
_OTHER = CATEGORIES.index(Category.OTHER.value)


@dataclass
class Curves:
    """Live bytes after each event: `total[i]` and, per category, `category_delta` summed."""
    total: np.ndarray                 # int64, one value per event
    delta: np.ndarray                 # int64, the change each event makes
    codes: np.ndarray                 # int8, the category index of each event's block

    @property
    def num_events(self) -> int:
        return int(self.total.shape[0])

    def peak(self) -> tuple[int, int]:
        """(seq, bytes) of the first highest total, as attribution.peak gives it."""
        if self.num_events == 0:
            return 0, 0
        seq = int(np.argmax(self.total))
        return seq, max(int(self.total[seq]), 0)

    def categories_at(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Live bytes per category at the given event indices: one cumulative sum per category."""
        out = {}
        for k, name in enumerate(CATEGORIES):
            mask = self.codes == k
            if not mask.any():
                out[name] = np.zeros(len(idx), dtype=np.int64)
                continue
            out[name] = np.cumsum(np.where(mask, self.delta, 0))[idx]
        return out

    def by_category_at(self, seq: int) -> dict[str, int]:
        if self.num_events == 0:
            return dict.fromkeys(CATEGORIES, 0)
        got = self.categories_at(np.array([seq]))
        return {k: int(v[0]) for k, v in got.items()}


def curves(run: Run) -> Curves:
    """The live curves of a run in O(events)."""
    n = run.num_events
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Curves(empty, empty, np.zeros(0, dtype=np.int8))
    actions = np.fromiter(run.actions, dtype=np.int8, count=n)
    nbytes = np.fromiter(run.event_bytes, dtype=np.int64, count=n)
    delta = np.where(actions == Action.ALLOC, nbytes, np.where(actions == Action.FREE, -nbytes, 0))
    codes = _event_codes(run, n)
    return Curves(np.cumsum(delta), delta, codes)


def _event_codes(run: Run, n: int) -> np.ndarray:
    """Category index of each event's block (OTHER for OOM events and unknown blocks)."""
    event_blocks = np.fromiter(run.event_blocks, dtype=np.int64, count=n)
    if not run.blocks:
        return np.full(n, _OTHER, dtype=np.int8)
    index = {c: i for i, c in enumerate(CATEGORIES)}
    ids = np.fromiter(run.blocks.keys(), dtype=np.int64, count=len(run.blocks))
    cats = np.fromiter((index.get(b.category, _OTHER) for b in run.blocks.values()),
                       dtype=np.int8, count=len(run.blocks))
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < 4 * len(ids) + 4096:          # dense ids: a lookup table
        table = np.full(hi + 1, _OTHER, dtype=np.int8)
        table[ids] = cats
        inside = (event_blocks >= 0) & (event_blocks <= hi)
        codes = np.full(n, _OTHER, dtype=np.int8)
        codes[inside] = table[event_blocks[inside]]
        return codes
    order = np.argsort(ids)                           # sparse ids: a sorted search
    ids, cats = ids[order], cats[order]
    pos = np.clip(np.searchsorted(ids, event_blocks), 0, len(ids) - 1)
    return np.where(ids[pos] == event_blocks, cats[pos], _OTHER).astype(np.int8)


def pick_indices(total: np.ndarray, max_points: int = DEFAULT_MAX_POINTS,
                 keep: list[int] | tuple[int, ...] = ()) -> np.ndarray:
    """Sorted event indices to draw: all of them when they fit, else per bucket the min and
    the max of `total`, the first and last event, the peak and every index in `keep`."""
    return _pick(total, max_points, keep)[0]


def _pick(total: np.ndarray, max_points: int, keep) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices to draw, those on the upper envelope: bucket maxima, and those on the lower:
    bucket minima; both with the peak, the first and last event and `keep`)."""
    n = int(total.shape[0])
    extra = sorted({int(k) for k in keep if 0 <= int(k) < n})
    if n <= max_points:
        every = np.arange(n, dtype=np.int64)
        return every, every, every
    buckets = max((max_points - len(extra) - 3) // 2, 1)
    width = -(-n // buckets)
    padded = np.empty(buckets * width, dtype=total.dtype)
    padded[:n] = total
    padded[n:] = total[-1]
    grid = padded.reshape(buckets, width)
    offsets = np.arange(buckets, dtype=np.int64) * width
    hi = np.minimum(grid.argmax(axis=1) + offsets, n - 1)
    lo = np.minimum(grid.argmin(axis=1) + offsets, n - 1)
    peak = int(np.argmax(total))
    fixed = np.concatenate([np.array([0, n - 1, peak], dtype=np.int64), np.array(extra, dtype=np.int64)])
    return (np.unique(np.concatenate([hi, lo, fixed])), np.unique(np.concatenate([hi, fixed])),
            np.unique(np.concatenate([lo, fixed])))


@dataclass
class Timeline:
    """What the timeline chart draws: event indices, the total and the category stacks at
    them (bytes), and how many events the run had."""
    seq: np.ndarray
    total: np.ndarray
    by_category: dict[str, np.ndarray] = field(default_factory=dict)
    num_events: int = 0
    peak_seq: int = 0
    peak_bytes: int = 0
    upper: np.ndarray | None = None     # positions in seq of the upper envelope (bucket maxima)
    lower: np.ndarray | None = None     # positions in seq of the lower envelope (bucket minima)


    @property
    def downsampled(self) -> bool:
        return len(self.seq) < self.num_events


def timeline(run: Run, max_points: int = DEFAULT_MAX_POINTS, c: Curves | None = None) -> Timeline:
    """The downsampled timeline of a run: peak and OOMs exact."""
    c = c if c is not None else curves(run)
    keep = []
    for o in run.ooms:
        keep += [o.seq - 1, o.seq]
    idx, hi, lo = _pick(c.total, max_points, keep)
    peak_seq, peak_bytes = c.peak()
    return Timeline(idx, c.total[idx], c.categories_at(idx), c.num_events, peak_seq, peak_bytes,
                    np.searchsorted(idx, hi), np.searchsorted(idx, lo))


def downsample_series(x: np.ndarray, ys: dict[str, np.ndarray], key: str,
                      max_points: int = DEFAULT_MAX_POINTS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Any aligned series (allocator samples): min/max buckets of ys[key], others at the same points."""
    idx = pick_indices(ys[key], max_points)
    return x[idx], {k: v[idx] for k, v in ys.items()}


def step_peaks(run: Run, total: np.ndarray) -> list[dict]:
    """attribution.per_step from an already computed total curve (no second pass in Python)."""
    from memdoctor.attribution import step_ranges
    rows = []
    for step, start, end in step_ranges(run):
        if end <= start or start >= len(total):
            continue
        window = total[start:end]
        rows.append({"step": step, "peak_bytes": int(window.max()), "end_bytes": int(window[-1]),
                     "start_seq": start, "end_seq": end})
    return rows
