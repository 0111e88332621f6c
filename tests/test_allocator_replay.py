"""The allocator model against the real CUDA caching allocator: allocation traces recorded
on an H200 (torch.cuda.memory._record_memory_history during two training steps; made by
benchmarks/allocator_replay.py --fixtures), replayed through CachingAllocatorModel, give the
GPU's own peaks and segment count."""
import gzip
import json
from pathlib import Path

import pytest

from memdoctor.cuda.allocator_model import replay_trace

TRACES = sorted((Path(__file__).parent / "fixtures" / "allocator_traces").glob("*.json.gz"))


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_replayed_gpu_trace_gives_the_gpu_peaks(path):
    rec = json.loads(gzip.decompress(path.read_bytes()))
    model = replay_trace(rec["events"])
    assert model.peak_allocated == rec["max_allocated"]
    assert model.num_segment_allocs == rec["segments"]
    assert model.peak_reserved == rec["max_reserved"]


def test_fixtures_are_there():
    assert len(TRACES) >= 3


def test_the_drivers_segment_addresses_decide_between_equal_free_blocks():
    """A whole 24 MiB segment and the free half of a 48 MiB one tie for a 4.5 MiB request:
    the allocator takes the lower address. In the driver's slots the later segment is the
    lower (they go downwards); given the driver's addresses the model follows them, and which
    block is split decides whether a 48 MiB request finds the 48 MiB segment whole again. A
    process's first segments go upwards, side by side in its first chunk of addresses."""
    from memdoctor.cuda.allocator_model import DriverSpace
    MiB = 1024 * 1024
    events = [[1, 0, 48 * MiB], [1, 1, 24 * MiB], [0, 0, 0], [1, 2, 24 * MiB], [0, 1, 0],
              [1, 3, 4 * MiB + MiB // 2], [0, 2, 0], [1, 4, 48 * MiB]]
    downwards = replay_trace(events, driver=DriverSpace(first_chunk=0))
    assert downwards.num_segment_allocs == 2        # the 24 MiB segment was split
    upwards = replay_trace(events, [1 << 40, 2 << 40])
    assert upwards.num_segment_allocs == 3          # the 48 MiB one was, and 48 MiB more is reserved
    assert upwards.peak_reserved - downwards.peak_reserved == 48 * MiB
    first_chunk = replay_trace(events)
    assert (first_chunk.num_segment_allocs, first_chunk.peak_reserved) == (3, upwards.peak_reserved)


def test_the_driver_maps_segments_in_32_mib_slots_downwards_and_fills_a_slots_unused_top():
    """As the H200's driver placed MobileViT's segments (tests/test_zoo_estimate.py): a
    16 MiB segment at the bottom of a 32 MiB slot, the next 16 MiB one above it; a 64 MiB
    one in a slot of its own below; a 2 MiB one in the top of a 20 MiB segment's slot."""
    from memdoctor.cuda.allocator_model import MiB, DriverSpace
    space = DriverSpace(top=1024 * MiB, first_chunk=0)
    first, second = space.place(16 * MiB), space.place(16 * MiB)
    assert (first, second) == (992 * MiB, 1008 * MiB)
    assert space.place(64 * MiB) == 928 * MiB
    twenty = space.place(20 * MiB)
    assert twenty == 896 * MiB and space.place(2 * MiB) == 916 * MiB
    space.release(first, 16 * MiB)                  # a segment given back: its place is reused
    assert space.place(16 * MiB) == first


def test_a_processs_first_segments_go_upwards_in_its_first_chunk_and_larger_ones_below():
    """As the H200's driver placed DeBERTa-v2's, BERT's and HuBERT's segments (recorded by
    benchmarks/zoo/zoo_traces.py): 20 MiB segments side by side upwards from the bottom of the
    first chunk; a 376 MiB one in a slot below it; a small one later in the lowest place that
    fits, the unused top of that slot; one that no longer fits in the chunk in a slot below."""
    from memdoctor.cuda.allocator_model import FIRST_CHUNK, MiB, DriverSpace
    top = 4096 * MiB
    space = DriverSpace(top=top)
    bottom = top - FIRST_CHUNK
    assert [space.place(20 * MiB) for _ in range(3)] == [bottom, bottom + 20 * MiB, bottom + 40 * MiB]
    assert space.place(376 * MiB) == bottom - 384 * MiB
    assert space.place(2 * MiB) == bottom - 8 * MiB                 # the 376 MiB slot's top, below the chunk
    assert space.place(300 * MiB) == bottom - 384 * MiB - 320 * MiB
    assert space.place(200 * MiB) == bottom + 60 * MiB
    assert space.place(FIRST_CHUNK - 260 * MiB) == bottom + 260 * MiB   # the chunk's last free bytes
    assert space.place(20 * MiB) == bottom - 404 * MiB              # the chunk is full: the 300 MiB slot's top
    assert space.place(20 * MiB) == bottom - 704 * MiB - 32 * MiB   # and then a slot below
    space.release(bottom + 20 * MiB, 20 * MiB)
    assert space.place(20 * MiB) == bottom + 20 * MiB               # a freed place in the chunk is reused
