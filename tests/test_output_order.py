"""Outputs a CUDA kernel allocates in another order than the op returns them
(memdoctor.cuda.output_order): dropout's mask before its output, as Dropout.cu makes them and
as the H200's allocator traces show; the estimate's Run records them in the kernel's order."""
import gzip
import json

import torch
from torch import nn

from memdoctor.cuda.allocator_model import CachingAllocatorModel
from memdoctor.cuda.output_order import cuda_output_order
from memdoctor.predict.estimate import estimate
from memdoctor.predict.events import reorder_allocations
from memdoctor.predict.replay import replay
from memdoctor.run import Action, Block, Run
from tests.support.paths import ROOT

aten = torch.ops.aten
FIXTURES = ROOT / "tests" / "fixtures" / "zoo_traces"


def meta(*shape):
    return torch.empty(*shape, device="meta")


def test_dropout_makes_its_mask_first_when_training():
    x = meta(16, 512)
    assert cuda_output_order(aten.native_dropout.default, (x, 0.1, True), {}) == (1, 0)
    assert cuda_output_order(aten.native_dropout.default, (x, 0.1, None), {}) == (1, 0)
    assert cuda_output_order(aten._fused_dropout.default, (x, 0.9), {}) == (1, 0)
    # train=False clones the input, then makes the mask; p == 1 makes zeros, then the mask
    assert cuda_output_order(aten.native_dropout.default, (x, 0.1, False), {}) is None
    assert cuda_output_order(aten.native_dropout.default, (x, 1.0, True), {}) is None
    assert cuda_output_order(aten.native_layer_norm.default, (x, [512], None, None, 1e-5), {}) is None


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        return torch.native_dropout(self.lin(x), 0.1, True)[0]


def _dropout_blocks():
    est = estimate(_Dropped, None, lambda: torch.randn(64, 256), lambda m, x: m(x).pow(2).mean(),
                   device="cuda")
    run = est.run
    blocks = sorted((b for b in run.blocks.values() if b.name == "aten.native_dropout"), key=lambda b: b.alloc_seq)
    for b in blocks:
        assert run.actions[b.alloc_seq] == Action.ALLOC and run.event_blocks[b.alloc_seq] == b.id
        assert run.event_bytes[b.alloc_seq] == b.nbytes
    return blocks


def test_the_estimate_allocates_dropouts_mask_before_its_output():
    blocks = _dropout_blocks()
    assert [(b.dtype, b.nbytes) for b in blocks] == [("bool", 64 * 256), ("float32", 64 * 256 * 4)] * 2
    for mask, out in zip(blocks[::2], blocks[1::2]):
        assert out.alloc_seq == mask.alloc_seq + 1


def test_a_span_that_is_not_the_blocks_allocations_is_left_alone():
    run = Run(actions=[Action.ALLOC, Action.ALLOC, Action.FREE], event_blocks=[1, 2, 1], event_bytes=[8, 4, 8],
              blocks={1: Block(1, 8, alloc_seq=0, free_seq=2), 2: Block(2, 4, alloc_seq=1)})
    assert reorder_allocations(run, [(0, 2, [2, 3])]) == 0
    assert run.event_blocks == [1, 2, 1]
    assert reorder_allocations(run, [(0, 2, [2, 1])]) == 1
    assert run.event_blocks == [2, 1, 1] and run.event_bytes == [4, 8, 8]
    assert (run.blocks[2].alloc_seq, run.blocks[1].alloc_seq) == (0, 1)


def _run_of(trace: dict) -> tuple[Run, list]:
    """A zoo trace's request sequence as a Run (blocks named by the estimate's labels), and
    the spans of its dropouts (output, then mask) with their blocks in CUDA's order."""
    run, spans, made = Run(), [], 0
    for seq, (kind, n, nbytes) in enumerate(trace["events"]):
        if kind == 1:
            label = trace["labels"][made]
            made += 1
            run.blocks[n] = Block(n, nbytes, name=label.split(" ")[0], dtype=label.rsplit(" ", 1)[-1],
                                  device="cuda:0", alloc_seq=seq)
            run.actions.append(Action.ALLOC)
            before = run.blocks.get(run.event_blocks[-1]) if seq and run.actions[-2] == Action.ALLOC else None
            if run.blocks[n].name == "aten.native_dropout" and run.blocks[n].dtype == "bool" and before is not None \
                    and before.name == "aten.native_dropout" and before.alloc_seq == seq - 1:
                spans.append((seq - 1, seq + 1, [n, before.id]))
        else:
            run.blocks[n].free_seq = seq
            run.actions.append(Action.FREE)
        run.event_blocks.append(n)
        run.event_bytes.append(run.blocks[n].nbytes)
    return run, spans


def test_dropouts_mask_first_makes_the_h200s_reserved_peak_of_gpt_bigcode():
    """GPT-BigCode in fp32, batch 4, on the H200 (tests/fixtures/zoo_traces/gpt-bigcode_fp32_b4.json.gz,
    benchmarks/zoo/zoo_traces.py): the GPU's dropouts allocate the bool mask, then the output.
    The H200's own estimate, output first, replayed to 14 MiB more reserved than the GPU;
    with each dropout's two allocations in the kernel's order it replays to the GPU's
    reserved peak to the byte."""
    doc = json.loads(gzip.decompress((FIXTURES / "gpt-bigcode_fp32_b4.json.gz").read_bytes()))
    real, predicted = doc["real"], doc["predicted"]
    dropouts = [(a[2], b[2]) for a, b, la, lb in zip(real["events"], real["events"][1:], _alloc_labels(real),
                                                     _alloc_labels(real)[1:])
                if a[0] == b[0] == 1 and la.startswith("dropout") and lb.startswith("dropout")]
    assert dropouts and all(out == 4 * mask for mask, out in dropouts)
    run, spans = _run_of(predicted)
    counted = set(run.blocks)
    before = replay(run, counted, CachingAllocatorModel())
    assert before.peak_reserved > real["max_reserved"]
    assert reorder_allocations(run, spans) == len(spans) == 39
    after = replay(run, counted, CachingAllocatorModel())
    assert after.peak_reserved == real["max_reserved"]
    assert abs(after.peak_allocated - real["max_allocated"]) <= 1024


def _alloc_labels(trace: dict) -> list:
    """Each event's allocation label ('' for a free)."""
    labels, made = [], 0
    for e in trace["events"]:
        if e[0] == 1:
            labels.append(trace["labels"][made])
            made += 1
        else:
            labels.append("")
    return labels
