"""One rank of several, as changes to the fake step's Run before the replay: DDP's gradient
buckets added, or ZeRO's shards of the model states."""
from __future__ import annotations

from memdoctor.cuda.allocator_model import MiB
from memdoctor.predict.events import insert_events
from memdoctor.run import Category, Run
from memdoctor.units import format_bytes

__all__ = ["one_rank", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES"]

DDP_BUCKET_BYTES = 25 * MiB         # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1 * MiB    # and its first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def one_rank(run: Run, counted: set[int], world_size: int, zero: int | None,
             grad_bytes: int, device_type: str) -> tuple[dict[int, int] | None, str]:
    """What one rank of `world_size` holds, as changes to the Run before the replay, and a note.

    Without ZeRO (DDP): the reducer's flat gradient buckets (gradient_as_bucket_view=False,
    its default: one more copy of the gradients, in 25 MiB buckets) are allocated before
    the first forward and kept. With ZeRO stage s: stage 1 shards the optimizer state and
    the optimizer step's temporaries to 1/N, stage 2 also the gradients, stage 3 also the
    weights: the per-block byte overrides the replay takes (`sizes_of`)."""
    n = max(int(world_size), 1)
    if zero is None:
        if n == 1:
            return None, ""
        start = next((m.seq for m in run.marks if m.phase == "forward"), 0)
        chunks, left, first = [], grad_bytes, True
        while left > 0:
            size = min(left, DDP_FIRST_BUCKET_BYTES if first else DDP_BUCKET_BYTES)
            chunks.append((start, "alloc", None, size, "DDP gradient bucket", Category.OTHER.value))
            left -= size
            first = False
        insert_events(run, chunks, device_type)
        counted.update(b.id for b in run.blocks.values() if b.name == "DDP gradient bucket")
        return None, (f"world size {n} (DDP): {format_bytes(grad_bytes)} of gradient buckets added (one more "
                      "copy of the gradients, in 25 MiB buckets, as DistributedDataParallel's default "
                      "gradient_as_bucket_view=False keeps); NCCL's own buffers are not in the estimate")
    cats = {Category.OPTIMIZER_STATE.value}
    if zero >= 2:
        cats.add(Category.GRADIENTS.value)
    if zero >= 3:
        cats.add(Category.WEIGHTS.value)
    sizes: dict[int, int] = {}
    for bid in counted:
        b = run.blocks[bid]
        if b.category in cats or (b.category == Category.TEMPORARIES.value and b.phase == "optimizer"):
            sizes[bid] = -(-b.nbytes // n)
    shards = ", ".join(sorted(cats)) + ", the optimizer step's temporaries"
    return sizes, (f"ZeRO-{zero} over {n} ranks: {shards} sharded to 1/{n} per rank in the replay; the "
                   "collectives' buffers" + (", the layers ZeRO-3 gathers for forward and backward" if zero >= 3
                                              else "") + " and the full-size gradients before reduce-scatter "
                   "are not in the estimate")
