"""Runs traced on the H200 by the allocator source (benchmarks/results), diagnosed here.

nanoGPT (GPT-2 124M, bf16) at batch 64 under 24 GiB runs out in its first evaluation asking
for the fp32 copy of its logits; the same evaluation at batch 16 runs whole. Blocks there have
no shapes but those the hooks claim: logits are told by their size over the vocabulary."""
from pathlib import Path

from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.run import Run

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
AT_64 = RESULTS / "nanogpt_eval_b64_allocator_run_h200_2026-12-05.memrun.json.gz"
AT_16 = RESULTS / "nanogpt_eval_b16_allocator_run_h200_2026-12-05.memrun.json.gz"


def test_only_the_head_and_its_loss_are_logits_not_what_a_position_table_divides():
    """The position table's 1024 rows divide the size of any power-of-two tensor (the batch of
    token ids, the blocks' activations, the weights' bf16 copies): no vocabulary; nor is the
    head's weight cast to bf16 by autocast any logits."""
    f = facts_from_run(Run.load(AT_64))
    assert f.vocab == 50304
    assert sorted(b.nbytes for b in f.logits) == [64 * 1024 * 50304 * 2] * 2


def test_a_quarter_of_the_evaluation_batch_is_predicted_with_the_output_the_loop_keeps():
    """nanoGPT's estimate_loss binds each pass's logits, which stay alive through the next
    split's pass: the batch-16 evaluation peaks with two passes' logits, beyond where the
    batch-64 one ran out. The prediction may err high, never low."""
    run = Run.load(AT_64)
    first = diagnose(facts_from_run(run))[0]
    assert first.rule == "large-logits"
    quarter = next(r.predicted_peak_bytes for r in first.remedies if r.title == "smaller evaluation batch")
    measured = Run.load(AT_16)
    peak = facts_from_run(measured).peak_bytes
    assert measured.ooms == [] and peak <= quarter <= run.budget_bytes, (peak, quarter)


def test_a_loss_cut_short_between_forward_and_backward_holds_what_the_backward_awaits():
    """Our two-tower contrastive scenario on the H200 ran out making its loss (the similarity
    matrices' softmaxes, outside both towers), before the backward: what is alive of the loss
    is saved for that backward, as the allocator source labels it when the trace stops."""
    from memdoctor.capture.allocator import _freed_by_backward_are_activations
    run = Run.load(RESULTS / "two_towers_contrastive_out_in_its_loss_allocator_run_h200_2026-12-05.memrun.json.gz")
    assert run.ooms[0].phase == "other" and run.ooms[0].step == 1
    _freed_by_backward_are_activations(run)
    f = facts_from_run(run)
    assert f.focus.by_category["temporaries"] == 0
    assert diagnose(f)[0].rule == "activations"
