"""Run -> Breakdown: bytes by category and by module at any instant, at the peak and per
step, and the largest live tensors with where they came from."""
from __future__ import annotations

from dataclasses import dataclass, field

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
        top=[TensorInfo(b.name, b.category, b.nbytes, b.shape, b.dtype, module_of(b), b.phase, b.step)
             for b in biggest],
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
