"""The allocator source pauses Python stacks between its first steps and the steps near the
budget: a block made while they were paused takes the line of the block made at the same
place in a stacked step (memdoctor.capture.allocator._lines_from_earlier_steps). Checked here
on a run built by hand; tests/gpu/test_allocator_gpu.py checks it on an H200's history."""
from memdoctor.capture.allocator import _lines_from_earlier_steps
from memdoctor.run import Block, Run


def _step(run: Run, first_id: int, stacked: bool) -> None:
    """One step: in forward, module `mlp`, a 4 MiB and then two 16 MiB blocks; stacked or not."""
    for turn, (nbytes, name, source) in enumerate(((4 << 20, "model.py:10 fc", 0),
                                                   (16 << 20, "model.py:11 act", 1),
                                                   (16 << 20, "model.py:12 out", 2))):
        bid = first_id + turn
        run.blocks[bid] = Block(bid, nbytes, "temporaries", name if stacked else "", phase="forward",
                                module="mlp", alloc_seq=bid, source=source if stacked else -1)


def test_a_paused_step_takes_the_lines_of_the_stacked_one_turn_by_turn():
    run = Run(source="allocator")
    _step(run, 0, stacked=True)
    _step(run, 3, stacked=False)
    mark_of_block = {bid: (1 if bid < 3 else 5, "mlp") for bid in run.blocks}
    _lines_from_earlier_steps(run, mark_of_block)
    paused = [run.blocks[i] for i in (3, 4, 5)]
    assert [(b.name, b.source) for b in paused] == [("model.py:10 fc", 0), ("model.py:11 act", 1),
                                                    ("model.py:12 out", 2)]


def test_a_block_made_nowhere_a_stacked_step_made_one_keeps_no_line():
    run = Run(source="allocator")
    _step(run, 0, stacked=True)
    run.blocks[3] = Block(3, 8 << 20, "temporaries", "", phase="forward", module="mlp", alloc_seq=3)
    run.blocks[4] = Block(4, 4 << 20, "temporaries", "", phase="backward", module="mlp", alloc_seq=4)
    _lines_from_earlier_steps(run, {0: (1, "mlp"), 1: (1, "mlp"), 2: (1, "mlp"), 3: (5, "mlp"), 4: (6, "mlp")})
    assert [(run.blocks[i].name, run.blocks[i].source) for i in (3, 4)] == [("", -1), ("", -1)]
