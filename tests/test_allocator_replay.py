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
