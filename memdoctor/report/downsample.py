"""Live-memory curves of a Run as arrays, and downsampling that keeps what matters exact.

A long run has millions of events; a chart needs a few thousand points. The curves come
from attribution's LiveIndex (built once, then any event's categories by binary search),
never from a breakdown per sample. Downsampling keeps, per bucket of events, the lowest and
the highest total, plus the peak and every OOM (and the event before it), so the highest
point drawn is the true peak and every OOM sits where it happened.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memdoctor.attribution import LiveIndex
from memdoctor.run import CATEGORIES, Category, Run

DEFAULT_MAX_POINTS = 5_000
_OTHER = Category.OTHER.value


@dataclass
class Curves:
    """What the charts draw from: live bytes after each event, in total and per category;
    the seven categories of the contract (any other a block names counts as other)."""
    live: LiveIndex

    @property
    def total(self) -> np.ndarray:
        """int64, the live total after each event."""
        return self.live.curve

    @property
    def num_events(self) -> int:
        return self.live.num_events

    def peak(self) -> tuple[int, int]:
        """(seq, bytes) of the first highest total, as attribution.peak gives it."""
        if self.num_events == 0:
            return 0, 0
        seq = int(np.argmax(self.total))
        return seq, max(int(self.total[seq]), 0)

    def categories_at(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Live bytes per category at the given event indices."""
        got = self.live.categories_at(idx)
        out = {name: got[name] for name in CATEGORIES}
        for name in self.live.categories[len(CATEGORIES):]:
            out[_OTHER] = out[_OTHER] + got[name]
        return out

    def by_category_at(self, seq: int) -> dict[str, int]:
        if self.num_events == 0:
            return dict.fromkeys(CATEGORIES, 0)
        got = self.categories_at(np.array([seq]))
        return {k: int(v[0]) for k, v in got.items()}


def curves(run: Run) -> Curves:
    """The live curves of a run."""
    return Curves(LiveIndex.from_run(run))


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
