"""The values of a run read from a file, checked: sizes and indices in range, the known
keys of `device`, `meta` and `segments` of the types memdoctor reads them as.

Run.from_dict checks that every column holds its annotated type; this module checks what
a type cannot say (a negative size, a size past int64, an event index past the last
event, a block id no block has) and the free-form dicts, whose known keys the rules,
reports and TUI read. A run that passes loads into something all of them can read; one
that does not raises ValueError with one line naming the field (Run.from_dict words it
as a damaged run file). Unknown keys are kept as they are: nothing reads them.
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Callable

from memdoctor.units import MAX_SIZE

Check = Callable[[Any], bool]


def _int_in(lo: int, hi: int) -> Check:
    return lambda v: type(v) is int and lo <= v <= hi


SIZE = _int_in(0, MAX_SIZE)                 # bytes, counts, addresses: int64, not negative
INT = _int_in(-MAX_SIZE, MAX_SIZE)


def STR(v: Any) -> bool:
    return type(v) is str


def BOOL(v: Any) -> bool:
    return type(v) is bool


def NUMBER(v: Any) -> bool:
    return (type(v) is int and abs(v) <= MAX_SIZE) or (type(v) is float and math.isfinite(v))


def ANY(v: Any) -> bool:
    return True


def opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def list_of(check: Check) -> Check:
    return lambda v: type(v) is list and all(check(x) for x in v)


def counts_by_name(v) -> bool:
    """A dict of short names to counts (a model's lists of repeated blocks)."""
    return type(v) is dict and len(v) <= 4096 and all(STR(k) and len(k) <= 1024 and SIZE(n) for k, n in v.items())


def obj(required: tuple[str, ...] = (), **known: Check) -> Check:
    """A dict holding the `required` keys, whose known keys, where present, pass their checks."""
    return lambda v: (type(v) is dict and all(k in v for k in required)
                      and all(k not in v or c(v[k]) for k, c in known.items()))


_NVML = obj(available=BOOL, index=opt(SIZE), name=opt(STR), total_bytes=opt(SIZE), used_bytes=opt(SIZE),
            free_bytes=opt(SIZE), driver_version=opt(STR), reason=opt(STR),
            processes=list_of(obj(pid=opt(SIZE), bytes=opt(SIZE), is_self=opt(BOOL), name=opt(STR))))
DEVICE = obj(type=STR, index=SIZE, name=opt(STR), capacity_bytes=opt(SIZE), reserved_bytes=opt(SIZE),
             allocated_bytes=opt(SIZE), segment_count=opt(SIZE), allocator_conf=opt(STR),
             allocator_settings=opt(obj()), nvml=_NVML, nvml_at_oom=_NVML)
_FORWARD_CALL = obj(index=SIZE, module=STR, seq_start=SIZE, seq_end=opt(SIZE), training=BOOL,
                    grad_enabled=BOOL, backward=BOOL, mark_start=SIZE, mark_end=opt(SIZE), phase=STR,
                    graph=BOOL, params=BOOL, input_grad=BOOL)
_OPTIMIZER = obj(("class", "param_bytes"), **{"class": STR}, foreach=opt(BOOL), fused=opt(BOOL), momentum=opt(NUMBER),
                 num_params=SIZE, param_bytes=SIZE, largest_param_bytes=SIZE, frozen_param_bytes=SIZE, device=STR,
                 implementations=list_of(STR), history_size=opt(SIZE))
_SNAPSHOT = obj(trace_entries=SIZE, free_action=STR, blocks_before_trace=SIZE, bytes_before_trace=SIZE,
                implied_frees=SIZE, reserved_inconsistent=BOOL, time_us=list_of(opt(NUMBER)),
                block_context=list_of(lambda r: type(r) is list and len(r) == 3 and SIZE(r[0])
                                      and STR(r[1]) and STR(r[2])),
                external_annotations=list_of(ANY), external_annotations_total=SIZE, devices=list_of(SIZE))
META = obj(rank=SIZE, world_size=_int_in(1, MAX_SIZE), peak_live_bytes=SIZE, exit_code=opt(INT),
           script_error=opt(STR), steps_from=STR, forward_calls=list_of(_FORWARD_CALL),
           optimizers=list_of(_OPTIMIZER), snapshot=_SNAPSHOT,
           sliced_inputs=list_of(obj(block=SIZE, address=SIZE, rows=SIZE)), block_counts=counts_by_name,
           recomputed_in_backward=list_of(STR), checkpointed_in_forward=list_of(STR), frameworks=list_of(STR),
           ddp=list_of(obj(gradient_as_bucket_view=BOOL, param_bytes=SIZE)),
           kept_by=list_of(obj(source=INT, holder=STR, blocks=list_of(SIZE))), oom_building=obj(module=STR, how=STR),
           unstepped_grads=list_of(STR), unstepped_models=list_of(INT))
SEGMENT = obj(address=SIZE, total_size=SIZE, allocated_size=SIZE, inactive_size=SIZE,
              largest_inactive=SIZE, segment_type=STR, is_expandable=BOOL, blocks_omitted=SIZE,
              blocks=list_of(obj(size=SIZE, state=opt(STR))))


def _bad(where: str, why: str) -> ValueError:
    return ValueError(f"{where} {why}")


def _range(values, lo: int, hi: int, where: str, none_ok: bool = False) -> None:
    """Every value in [lo, hi] (None too when none_ok); works on lists and numpy arrays."""
    if hasattr(values, "dtype"):                    # the TUI's int64 columns (None read as -1)
        present = values[values >= 0] if none_ok else values
        small, big = (int(present.min()), int(present.max())) if len(present) else (lo, lo)
    else:
        present = [v for v in values if v is not None] if none_ok else values
        small, big = (min(present), max(present)) if present else (lo, lo)
    if small < lo or big > hi:
        raise _bad(where, f"holds {small if small < lo else big}, outside {lo}..{hi}")


def check_header(data: dict, num_events: int) -> None:
    """The run's scalars, marks, OOMs, samples, segments, device and meta (a Run's to_dict
    shape, types already checked)."""
    if data.get("budget_bytes") is not None:
        _range([data["budget_bytes"]], 0, MAX_SIZE, "budget_bytes")
    for key, check in (("device", DEVICE), ("meta", META), ("segments", list_of(SEGMENT))):
        if not check(data.get(key)):
            raise _bad(key, "holds a value of the wrong type or range")
    rows = {k: data.get(k) or [] for k in ("marks", "ooms", "samples")}
    _range([r["seq"] for k in rows for r in rows[k]], 0, num_events, "an event index")
    _range([r["step"] for k in ("marks", "ooms") for r in rows[k]], 0, MAX_SIZE, "a step")
    _range([r.get(k) for r in rows["ooms"] for k in ("requested_bytes", "live_bytes")],
           0, MAX_SIZE, "an OOM's size", none_ok=True)
    _range([r[k] for r in rows["samples"] for k in ("allocated", "reserved")], 0, MAX_SIZE, "a sample's size")
    if not all(NUMBER(m["time"]) for m in rows["marks"]):
        raise _bad("marks.time", "is not a finite number")


def check_blocks(cols: dict, num_events: int, categories: list[str]) -> None:
    """The block columns present in `cols` (lists, or the TUI's numpy arrays)."""
    for name, lo, hi, none_ok in (("id", 0, MAX_SIZE, False), ("nbytes", 0, MAX_SIZE, False),
                                  ("step", 0, MAX_SIZE, False), ("alloc_seq", 0, num_events, False),
                                  ("free_seq", 0, num_events, True), ("address", 0, MAX_SIZE, True)):
        if name in cols:
            _range(cols[name], lo, hi, f"blocks.{name}", none_ok)
    if "category" in cols and not set(cols["category"]) <= set(categories):
        raise _bad("blocks.category", f"holds a category other than {', '.join(categories)}")
    if "shape" in cols:
        dims = [d for shape in cols["shape"] for d in shape]
        _range(dims, 0, MAX_SIZE, "blocks.shape")


def check_events(actions: list, blocks: list, nbytes: list, block_ids, kinds: set[int]) -> None:
    if not set(actions) <= kinds:
        raise _bad("events.action", f"holds an action other than {sorted(kinds)}")
    _range(nbytes, 0, MAX_SIZE, "events.bytes")
    if not set(blocks) <= set(block_ids) | {-1}:
        raise _bad("events.block", "names a block the run does not have")


def _rows(items: list) -> list[dict]:
    return [{f.name: getattr(x, f.name) for f in fields(x)} for x in items]


def check_run(run, categories: list[str], actions: set[int]) -> None:
    """All of the above on a Run built from a file: `categories` and `actions` are the
    block categories and event actions there are."""
    n = run.num_events
    check_header({"budget_bytes": run.budget_bytes, "device": run.device, "meta": run.meta,
                  "segments": run.segments, "marks": _rows(run.marks), "ooms": _rows(run.ooms),
                  "samples": _rows(run.samples)}, n)
    blocks = list(run.blocks.values())
    check_blocks({name: [getattr(b, name) for b in blocks]
                  for name in ("id", "nbytes", "step", "alloc_seq", "free_seq", "address", "category", "shape")},
                 n, categories)
    check_events(run.actions, run.event_blocks, run.event_bytes, run.blocks.keys(), actions)
    _range([line for _, line, _ in run.sources], 0, MAX_SIZE, "sources' line numbers")
