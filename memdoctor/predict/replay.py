"""The replay: the fake step's allocations and frees through the model of the CUDA caching
allocator, with the last step repeated until the allocator's layout settles, for the peaks
`max_memory_allocated()` and `max_memory_reserved()` would report; and again with the
allocator capped at a budget, for where it would run out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memdoctor.cuda.allocator_model import AllocatorConfig, CachingAllocatorModel, ModelOOM, placements
from memdoctor.run import Action, CATEGORIES, Category, Run

__all__ = ["Replay", "counted_blocks", "replay", "check_budget", "MAX_REPEATS"]


_CPU_RNG_OUTPUTS = frozenset({"aten._scaled_dot_product_efficient_attention", "aten._efficient_attention_forward"})


def counted_blocks(run: Run, device_type: str, skip_cpu_scalars: bool) -> set[int]:
    """The blocks that live on the simulated device. Standing in for CUDA on the CPU, the
    optimizers' 0-dim step counters are left out: on a GPU they stay on the CPU."""
    out = set()
    for b in run.blocks.values():
        if not b.device.startswith(device_type):
            continue
        if b.name in _CPU_RNG_OUTPUTS and not b.shape and b.nbytes == 8:
            continue        # memory-efficient attention's philox seed and offset: CPU tensors on a GPU
        if skip_cpu_scalars and b.category == Category.OPTIMIZER_STATE.value and not b.shape \
                and b.name.endswith(":step"):
            continue
        out.add(b.id)
    return out


MAX_REPEATS = 8     # steady steps replayed after the recorded ones, at most


def _steady_step(run: Run, counted: set[int], steps: int):
    """The last recorded step as a template for the steps after it: (its end event index,
    its events as (seq, action, bid, carried)), or None if it does not repeat.

    The allocator's layout can take more steps than the recorded ones to settle: Llama 1B
    ran out of memory in its third step on the H200 after two steps at the predicted peak.
    A block the step frees that an earlier step made (last step's gradients) is `carried`:
    in a repeat it is the block of this step with the same name and size."""
    starts: dict[int, int] = {}
    for m in run.marks:
        starts.setdefault(m.step, m.seq)
    last = steps - 1
    if steps < 2 or last not in starts:
        return None
    first, end = starts[last], starts.get(steps, len(run.actions))
    kept: dict[tuple, list[int]] = {}              # made in the step and still live at its end
    for seq in range(first, end):
        bid = run.event_blocks[seq]
        b = run.blocks[bid]
        if run.actions[seq] == Action.ALLOC and bid in counted and (b.free_seq is None or b.free_seq >= end):
            kept.setdefault((b.name, b.nbytes), []).append(bid)
    events = []
    for seq in range(first, end):
        bid = run.event_blocks[seq]
        if bid not in counted:
            continue
        carried = None
        b = run.blocks[bid]
        if run.actions[seq] == Action.FREE and b.alloc_seq < first:
            same = kept.get((b.name, b.nbytes))
            if not same:
                return None                         # frees what no step makes again
            carried = same.pop(0)
        events.append((seq, run.actions[seq], bid, carried))
    if any(kept.values()):
        return None                                 # keeps more each step (a leak): no steady state
    return end, events


def _layout(model: CachingAllocatorModel) -> tuple:
    return (tuple(sorted(model.segments.items())), tuple(model.large_pool.keys), tuple(model.small_pool.keys))


def _events(run: Run, counted: set[int], model: CachingAllocatorModel, steps: int | None):
    """(seq, action, key, bid, repeat) for the Run's events of the `counted` blocks; with
    `steps`, the last step then repeats until the allocator's layout at the end of a step
    stops changing (at most MAX_REPEATS times), before the events after it. A repeat's
    seq is the template's, its key a new block's."""
    steady = _steady_step(run, counted, steps) if steps else None
    end = steady[0] if steady else len(run.actions)
    for seq in range(end):
        bid = run.event_blocks[seq]
        if bid in counted:
            yield seq, run.actions[seq], bid, bid, 0
    if steady:
        template = steady[1]
        before = _layout(model)
        for r in range(1, MAX_REPEATS + 1):
            for seq, action, bid, carried in template:
                if carried is not None:
                    yield seq, action, (carried if r == 1 else (r - 1, carried)), carried, r
                else:
                    yield seq, action, (r, bid), bid, r
            after = _layout(model)
            if after == before:
                break
            before = after
    for seq in range(end, len(run.actions)):
        bid = run.event_blocks[seq]
        if bid in counted:
            yield seq, run.actions[seq], bid, bid, 0


@dataclass
class Replay:
    """What the allocator model saw: its peaks, where they were first reached (the event, and
    in which repeat of the steady step: 0 in the recorded steps), each block's allocated size,
    and the first OOM under a cap."""
    peak_allocated: int
    peak_reserved: int
    peak_seq: int                   # where the allocated peak was first reached
    peak_repeat: int
    peak_reserved_recorded: int     # the recorded steps' own reserved peak, before any repeat
    peak_reserved_seq: int          # where the reserved peak was first reached
    peak_reserved_repeat: int
    sizes: dict[int, int]           # block id -> the bytes the allocator gave it
    category_peaks: dict[str, int]  # each category's own peak, in allocated (rounded) bytes
    category_peaks_raw: dict[str, int]  # and in requested bytes
    live_peak: int                  # the peak of requested bytes
    stats: dict                     # the allocator model's counters at the end
    oom: dict | None = None         # the first request the capped allocator refused


def replay(run: Run, counted: set[int], model: CachingAllocatorModel, stop_on_oom: bool = False,
           sizes_of: dict[int, int] | None = None, steps: int | None = None,
           maps: dict[int, int] | None = None) -> Replay:
    """Replay the Run's allocations and frees of the `counted` blocks, with `steps` (the
    steps recorded) also the steady steps after them (_events); `sizes_of` overrides the
    bytes of some blocks (a rank's shard under ZeRO); `maps`: block id -> the bytes the driver
    maps for a library just before that block (memdoctor.cuda.library_memory)."""
    handles: dict[Any, Any] = {}
    sizes: dict[int, int] = {}
    cat_of = {bid: run.blocks[bid].category for bid in counted}
    cat_live = dict.fromkeys(CATEGORIES, 0)
    cat_peak = dict.fromkeys(CATEGORIES, 0)
    raw_live = dict.fromkeys(CATEGORIES, 0)
    raw_peak = dict.fromkeys(CATEGORIES, 0)
    live = live_peak = 0
    peak_alloc, peak_seq, peak_res_seq, peak_repeat = -1, 0, 0, 0
    oom = None
    reserved_recorded, peak_res_repeat, peak_reserved = None, 0, model.peak_reserved
    ALLOC, FREE = Action.ALLOC, Action.FREE
    event_bytes = run.event_bytes
    for seq, action, key, bid, repeat in _events(run, counted, model, steps):
        if repeat and reserved_recorded is None:
            reserved_recorded = model.peak_reserved         # the recorded steps' own peak
        if action == ALLOC:
            if maps and not repeat and bid in maps:
                model.map_outside(maps[bid])
            nbytes = event_bytes[seq]
            if sizes_of is not None:
                nbytes = sizes_of.get(bid, nbytes)
            try:
                h = model.malloc(nbytes)
            except ModelOOM as exc:
                oom = {"seq": seq, "repeat": repeat, "requested_bytes": exc.requested,
                       "allocated_bytes": exc.allocated, "reserved_bytes": exc.reserved}
                if stop_on_oom:
                    break
                continue
            if h is None:
                continue
            handles[key] = h
            sizes[bid] = h.size
            cat = cat_of[bid]
            cat_live[cat] += h.size
            if cat_live[cat] > cat_peak[cat]:
                cat_peak[cat] = cat_live[cat]
            raw_live[cat] += nbytes
            if raw_live[cat] > raw_peak[cat]:
                raw_peak[cat] = raw_live[cat]
            live += nbytes
            if live > live_peak:
                live_peak = live
            if model.allocated > peak_alloc:
                peak_alloc, peak_seq, peak_repeat = model.allocated, seq, repeat
            if model.reserved > peak_reserved:      # where the reserved peak was first reached
                peak_reserved, peak_res_seq, peak_res_repeat = model.reserved, seq, repeat
        elif action == FREE:
            h = handles.pop(key, None)
            if h is None:
                continue
            cat_live[cat_of[bid]] -= h.size
            raw_live[cat_of[bid]] -= h.requested
            live -= h.requested
            model.free(h)
    return Replay(
        peak_allocated=max(model.peak_allocated, 0), peak_reserved=model.peak_reserved,
        peak_seq=peak_seq, peak_repeat=peak_repeat,
        peak_reserved_recorded=model.peak_reserved if reserved_recorded is None else reserved_recorded,
        peak_reserved_seq=peak_res_seq, peak_reserved_repeat=peak_res_repeat, sizes=sizes,
        category_peaks=cat_peak, category_peaks_raw=raw_peak, live_peak=live_peak, stats=model.stats(), oom=oom)


def check_budget(run: Run, counted: set[int], conf: AllocatorConfig, budget: int,
                 sizes_of: dict[int, int] | None, steps: int | None = None,
                 maps: dict[int, int] | None = None, placement: str = "driver") -> tuple[bool, dict | None, int]:
    """Replay again with the allocator capped at the budget (cached segments are released
    and the request retried before an OOM, as on a GPU), steady steps included: whether it
    fits, the OOM if not (where, and what asked), and the reserved peak under the cap, with
    the segment placement the estimate reports (`placement`, a name of
    memdoctor.cuda.allocator_model.placements())."""
    model = CachingAllocatorModel(budget, conf, placements()[placement])
    result = replay(run, counted, model, stop_on_oom=True, sizes_of=sizes_of, steps=steps, maps=maps)
    oom = result.oom
    if oom is None:
        return True, None, result.peak_reserved
    mark = run.mark_at(oom["seq"])
    oom.update(phase=mark.phase if mark else "other", step=(mark.step if mark else 0) + oom.pop("repeat"))
    block = run.blocks.get(run.event_blocks[oom["seq"]])
    if block is not None:
        oom.update(tensor=block.name, category=block.category, module=block.module)
    return False, oom, result.peak_reserved
