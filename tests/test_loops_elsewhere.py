"""Training loops shaped as public code writes them, where a diagnosis once went wrong: a GAN
(two models, two optimizers, G back-propagated through D's later pass), a frozen backbone
whose every parameter is handed to AdamW (peft's examples), an LM whose head and loss hold
more than its blocks, a flat stack of single layers. Bytes are checked against counts made
here and predicted peaks against what `--try` measures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).parent / "scenarios"


def _memdoctor(*args, cwd) -> dict:
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _linear(i: int, o: int, bias: bool = True) -> int:
    return i * o + (o if bias else 0)


def test_a_gan_step_is_no_evaluation_and_both_optimizers_states_count(tmp_path):
    out = _memdoctor("diagnose", SCENARIOS / "gan_two_optimizers.py", "--budget", "56MiB", "--json", cwd=tmp_path)
    rules = [f["rule"] for f in out["findings"]]
    assert "eval-without-no-grad" not in rules, rules       # G(z) is back-propagated through D(fake)
    params = (_linear(64, 1024) + _linear(1024, 1024) + _linear(1024, 784)          # G
              + _linear(784, 1024) + _linear(1024, 1024) + _linear(1024, 1))        # D
    assert rules[0] == "model-states", rules
    # fp32 weights, gradients and Adam's two moments, of both models, though G's optimizer had
    # not stepped in the step that ran out
    assert out["findings"][0]["accounts_for_bytes"] == 16 * params
    fits = _memdoctor("diagnose", SCENARIOS / "gan_two_optimizers.py", "--budget", "1GiB", "--json", cwd=tmp_path)
    assert not fits["oom"] and fits["findings"] == []


def test_frozen_parameters_handed_to_the_optimizer_change_nothing(tmp_path):
    script = SCENARIOS / "frozen_backbone.py"
    every = _memdoctor("diagnose", script, "--budget", "40MiB", "--json", "--", "all", cwd=tmp_path)
    head_only = _memdoctor("diagnose", script, "--budget", "40MiB", "--json", "--", "head", cwd=tmp_path)
    assert every["findings"] == head_only["findings"]
    first = every["findings"][0]
    weights = 4 * (4 * (_linear(512, 2048) + _linear(2048, 512)) + _linear(512, 10))
    trained = 4 * _linear(512, 10)
    assert first["rule"] == "model-states"
    assert first["accounts_for_bytes"] == weights + 3 * trained       # a gradient and two moments, the head's
    plans = [r["plan"] for r in first["remedies"]]
    assert "opt=adamw-8bit" not in plans and "zero=2" not in plans     # they save next to nothing here
    assert any(r["title"] == "frozen weights in bf16" for r in first["remedies"])


@pytest.mark.parametrize("budget", ["180MiB", "120MiB"])      # out in backward at the head, in steps 1 and 0
def test_checkpointing_is_predicted_with_the_head_it_leaves(budget, tmp_path):
    script = SCENARIOS / "head_outside_blocks.py"
    out = _memdoctor("diagnose", script, "--budget", budget, "--json", cwd=tmp_path)
    # the head's logits and their log-softmax are most of it; the blocks' activations come next
    assert [f["rule"] for f in out["findings"]][:2] == ["large-logits", "activations"]
    acts = out["findings"][1]
    predicted = next(r["predicted_peak_bytes"] for r in acts["remedies"] if r["plan"] == "ckpt=full")
    real = _memdoctor("diagnose", script, "--budget", "1GiB", "--try", "ckpt=full", "--json",
                      cwd=tmp_path)["after"]["peak_bytes"]
    assert real <= predicted <= 1.12 * real, (predicted, real)


def test_micro_batches_offered_for_the_logits_and_the_activations_are_one_prediction(tmp_path):
    """Both findings offer micro-batches: one change to the run, one prediction, that of the
    activations (the logits among them), at least what a quarter of the batch measures."""
    script = SCENARIOS / "head_outside_blocks.py"
    out = _memdoctor("diagnose", script, "--budget", "180MiB", "--json", cwd=tmp_path)
    micro = {f["rule"]: r["predicted_peak_bytes"] for f in out["findings"] for r in f["remedies"]
             if r["plan"] == "micro=auto"}
    assert set(micro) == {"large-logits", "activations"} and len(set(micro.values())) == 1, micro
    quarter = _memdoctor("trace", script, "--json", "--", "1", cwd=tmp_path)["peak_bytes"]
    assert quarter <= micro["activations"] <= 1.2 * quarter, (micro, quarter)


def test_a_flat_stack_of_single_layers_lists_the_fixes_that_fit_first(tmp_path):
    """Checkpointing a flat nn.Sequential keeps each segment's input: little is saved, and the
    run still runs out; micro-batches fit."""
    script = SCENARIOS / "activations_deep_batch.py"
    out = _memdoctor("diagnose", script, "--budget", "128MiB", "--json", cwd=tmp_path)
    remedies = {r["plan"]: r for r in out["findings"][0]["remedies"]}
    assert out["findings"][0]["remedies"][0]["plan"] == "micro=auto"
    assert remedies["ckpt=full"]["predicted_peak_bytes"] > out["budget_bytes"]
    tried = _memdoctor("diagnose", script, "--budget", "128MiB", "--try", "ckpt=full", "--json", cwd=tmp_path)
    assert tried["after"]["oom"]


@pytest.mark.parametrize("mode, budget", [("non-reentrant", "100MiB"), ("reentrant", "100MiB"),
                                          ("transformers", "40MiB")])
def test_checkpointing_the_model_turned_on_itself_is_seen_in_the_first_forward(mode, budget, tmp_path):
    if mode == "transformers":
        pytest.importorskip("transformers")
    out = _memdoctor("diagnose", SCENARIOS / "checkpointed_blocks.py", "--budget", budget, "--json", "--", mode,
                     cwd=tmp_path)
    assert out["ooms"][0]["phase"] == "forward" and out["ooms"][0]["step"] == 0
    first = out["findings"][0]
    assert first["rule"] == "activations"
    assert any(e.startswith("checkpointed already") for e in first["evidence"]), first["evidence"]
    assert not [r for r in first["remedies"] if (r["plan"] or "").startswith("ckpt")], first["remedies"]


def test_passes_of_one_model_from_several_lines_share_one_loss(tmp_path):
    """A triplet loss over three calls of one embedding net: their graphs wait for one backward,
    but no pass has a loss of its own, so no backward per pass is offered (a loop over
    micro-batches summing their losses gets one: tests/test_rules.py)."""
    out = _memdoctor("diagnose", SCENARIOS / "triplet_one_loss.py", "--budget", "120MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations"
    assert any("called from different lines" in e for e in first["evidence"]), first["evidence"]
    assert "backward per micro-batch" not in [r["title"] for r in first["remedies"]]


def test_a_leak_through_kept_graphs_names_the_list_that_holds_the_graphs(tmp_path):
    """Of two loss histories, the one whose losses kept their graphs (retain_graph=True) holds
    the leak; the other's losses hold 4 bytes each. Each list holds scalars directly, so the
    line is found through what their graphs save."""
    out = _memdoctor("diagnose", SCENARIOS / "leak_through_retained_graph.py", "--budget", "40MiB", "--json",
                     cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "leak"
    assert first["source"]["text"] == "aux_losses.append(loss_aux)", first["source"]


@pytest.mark.parametrize("backbone", ["frozen", "nograd"])
def test_a_frozen_backbones_forward_is_its_working_set_not_saved_activations(backbone, tmp_path):
    """A backbone that saves nothing (no parameter of it trains; or run under no_grad): what its
    blocks hold at the OOM is their ops' working set, gone as each ends, and checkpointing it
    changes nothing. A quarter of the batch is predicted from above."""
    script = SCENARIOS / "frozen_backbone.py"
    args = ["head"] + (["nograd"] if backbone == "nograd" else [])
    out = _memdoctor("diagnose", script, "--budget", "68MiB", "--json", "--", *args, cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "working-set", [f["rule"] for f in out["findings"]]
    assert not [r for r in first["remedies"] if (r["plan"] or "").startswith("ckpt")]
    quarter = next(r["predicted_peak_bytes"] for r in first["remedies"] if r["plan"] == "micro=auto")
    real = _memdoctor("trace", script, "--json", "--", *args, "512", cwd=tmp_path)["peak_bytes"]
    assert real <= quarter <= 1.2 * real, (quarter, real)


def test_try_checkpointing_checkpoints_every_model_of_the_class_that_saved_most(tmp_path):
    """CycleGAN's two generators of one class, chained: checkpointing one of them leaves the
    other's activations, and the run out of memory."""
    out = _memdoctor("diagnose", SCENARIOS / "two_generators.py", "--budget", "300MiB", "--try", "ckpt=full",
                     "--json", cwd=tmp_path)
    assert out["before"]["oom"] and not out["after"]["oom"]
    assert len([line for line in out["after"]["injected"] if "of Generator" in line]) == 2, out["after"]["injected"]


def test_a_second_model_of_one_class_is_named_by_its_variable(tmp_path):
    """Two generators of one class: the second's modules are `g_ba.blocks.k`, not the first's
    `blocks.k` again, so each one's bytes are its own."""
    out = _memdoctor("trace", SCENARIOS / "two_generators.py", "--json", cwd=tmp_path)
    by_module = out["by_module"]
    for k in range(6):
        assert by_module[f"g_ba.blocks.{k}.0"] == by_module[f"blocks.{k}.0"] >= 4096 * 1024 * 4, by_module


def test_accumulated_gradients_are_no_leftovers_and_sgd_gets_no_adam_fixes(tmp_path):
    """Out of memory in the second micro-batch, before SGD's first step: the gradients are being
    accumulated (no "gradients kept from the last step"), and model states (weights, gradients,
    momentum: 12 bytes a parameter) pass the budget; Plan's 8-bit, bf16 and in-backward
    optimizers replace Adam only, so they are not offered for SGD."""
    out = _memdoctor("diagnose", SCENARIOS / "accumulate_then_step.py", "--budget", "44MiB", "--json", cwd=tmp_path)
    rules = [f["rule"] for f in out["findings"]]
    assert "grads-during-forward" not in rules, rules
    assert rules[0] == "model-states"
    params = 4 * _linear(1024, 1024) + _linear(1024, 10)
    assert out["findings"][0]["accounts_for_bytes"] == 12 * params
    plans = {r["plan"] for f in out["findings"] for r in f["remedies"]}
    assert not plans & {"opt=adamw-8bit", "opt=adamw-bf16", "opt=in-backward"}, plans


def test_the_no_grad_fix_for_validation_keeps_the_training_peak_before_it(tmp_path):
    """Validation without no_grad after training: its graphs are the OOM's cause, but the fix
    leaves the training step's peak as it was, and the prediction cannot go below it (the
    no_grad version's traced peak, 128 MiB; the validation alone would predict 56 MiB)."""
    script = SCENARIOS / "validation_sums_loss_tensors.py"
    out = _memdoctor("diagnose", script, "--budget", "150MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "eval-without-no-grad"
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    fixed = _memdoctor("trace", script, "--json", "--", "nograd", cwd=tmp_path)
    assert fixed["peak_bytes"] <= predicted <= 1.05 * fixed["peak_bytes"], (predicted, fixed["peak_bytes"])
    assert predicted < out["budget_bytes"]


def test_try_checkpointing_takes_the_run_of_blocks_that_saved_most(tmp_path):
    """Of a triplet net's two lists, `--try ckpt=full` checkpoints the convolutions that saved
    nearly everything (two segments), not the head's three Linears (the longer run): the
    budget that ran out as written then fits (64 MiB -> 49 MiB; with the head checkpointed,
    still out of memory)."""
    out = _memdoctor("diagnose", SCENARIOS / "triplet_conv_embedding.py", "--budget", "64MiB", "--try", "ckpt=full",
                     "--json", cwd=tmp_path)
    assert out["before"]["oom"]
    assert any("embedding_net.convnet" in line for line in out["after"]["injected"]), out["after"]["injected"]
    assert not out["after"]["oom"] and out["after"]["peak_bytes"] < 0.85 * out["before"]["peak_bytes"]


def test_an_oom_while_the_data_is_made_names_the_data(tmp_path):
    """Out of memory making a float copy of a uint8 dataset, before any model ran: the data
    is the cause (12 MiB made and the 48 MiB asked for), not a model's working set."""
    out = _memdoctor("diagnose", SCENARIOS / "dataset_converted_on_device.py", "--budget", "56MiB", "--json",
                     cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "data-on-device", [f["rule"] for f in out["findings"]]
    assert first["accounts_for_bytes"] == 4096 * 3 * 32 * 32 * (1 + 4)
    assert "working-set" not in [f["rule"] for f in out["findings"]]


def test_an_oom_the_script_catches_and_skips_still_exits_3_with_micro_batches_first(tmp_path):
    """fairseq-style: the OOM is caught and the batch skipped, so the script ends well; the
    run still ran out (exit 3). On a flat stack of Linears and ReLUs checkpointing saves
    nothing (its segments keep what the layers save): micro-batches come first, and
    checkpointing is not predicted to fit."""
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", str(SCENARIOS / "oom_caught_batch_skipped.py"),
                           "--budget", "200MiB", "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    first = out["findings"][0]
    assert first["rule"] == "activations"
    remedies = {r["plan"]: r for r in first["remedies"]}
    assert first["remedies"][0]["plan"] == "micro=auto"
    assert remedies["ckpt=full"]["predicted_peak_bytes"] > out["budget_bytes"]


def test_bf16_is_not_offered_to_a_step_under_autocast_already(tmp_path):
    """Under bf16 autocast a loss's fp32 log-softmax over a vocabulary is most of what is
    saved; autocast is on all the same, and bf16 changes nothing (nanoGPT's loop)."""
    out = _memdoctor("diagnose", SCENARIOS / "autocast_lm_big_vocab.py", "--budget", "450MiB", "--json", cwd=tmp_path)
    plans = [r["plan"] for f in out["findings"] for r in f["remedies"]]
    assert out["findings"] and "bf16" not in plans, plans


def test_a_leak_that_runs_out_in_the_third_step_is_named(tmp_path):
    """Too few steps for a slope: the logits kept from each of the two steps before the OOM's
    (8 MiB each, `all_logits.append(logits)`) are the leak, and its fix is predicted at the
    fixed script's traced peak."""
    script = SCENARIOS / "leak_in_three_steps.py"
    out = _memdoctor("diagnose", script, "--budget", "140MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "leak", [f["rule"] for f in out["findings"]]
    assert first["accounts_for_bytes"] == 2 * 256 * 8192 * 4
    assert first["source"]["text"].startswith("all_logits.append(")
    fixed = _memdoctor("trace", script, "--json", "--", "fixed", cwd=tmp_path)["peak_bytes"]
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    assert abs(predicted - fixed) <= 0.05 * fixed and predicted < out["budget_bytes"], (predicted, fixed)


def test_a_contrastive_loss_keeps_its_batch_whole(tmp_path):
    """CLIP's loss scores each sample against the batch's others: micro-batches would change
    it. Gradient caching is offered in their place, predicted no lower than a run that does
    it, which trains to the same losses."""
    script = SCENARIOS / "contrastive_two_towers.py"
    out = _memdoctor("diagnose", script, "--budget", "230MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations"
    assert "micro=auto" not in [r["plan"] for r in first["remedies"]], first["remedies"]
    assert any("compares the batch's samples" in e for e in first["evidence"]), first["evidence"]
    cached = next(r for r in first["remedies"] if r["title"].startswith("gradient caching"))
    traced = _memdoctor("trace", script, "--json", "--", "gradcache", "4", cwd=tmp_path)["peak_bytes"]
    assert traced <= cached["predicted_peak_bytes"] <= 1.1 * traced, (cached, traced)
    losses = [subprocess.run([sys.executable, script, *extra], capture_output=True, text=True, check=True,
                             timeout=300).stdout.split("done")[0] for extra in ([], ["gradcache", "4"])]
    plain, gradcache = ([float(line.split()[-1]) for line in text.splitlines()] for text in losses)
    assert plain == pytest.approx(gradcache, abs=1e-5)


@pytest.mark.parametrize("extra, budget", [([], "240MiB"), (["reference"], "372MiB")])
def test_a_leak_that_runs_out_in_the_second_step_is_named(extra, budget, tmp_path):
    """One step before the OOM's: its reconstruction, held by a list the script appends to, is
    the leak (the step's outputs in a plain variable would be in use still). Beside a large
    frozen reference model the one step's 32 MiB is 8% of what is alive, but without it the
    request that failed would fit."""
    script = SCENARIOS / "leak_in_two_steps.py"
    out = _memdoctor("diagnose", script, "--budget", budget, "--json", "--", *extra, cwd=tmp_path)
    assert out["ooms"][0]["step"] == 1
    first = out["findings"][0]
    assert first["rule"] == "leak", [f["rule"] for f in out["findings"]]
    assert first["accounts_for_bytes"] == 2048 * 4096 * 4
    assert first["source"]["text"].startswith("reconstructions.append(")
    fixed = _memdoctor("trace", script, "--json", "--", *extra, "fixed", cwd=tmp_path)["peak_bytes"]
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    assert abs(predicted - fixed) <= 0.05 * fixed and predicted < out["budget_bytes"], (predicted, fixed)


@pytest.mark.parametrize("extra, how, cls, built", [
    ([], "built", "Linear", 3 * _linear(4096, 4096) * 4),           # three of five made
    (["data"], "built", "Linear", 0),
    (["convert"], "moved", "Sequential", 0)])
def test_a_model_that_does_not_fit_while_it_is_built_is_named(extra, how, cls, built, tmp_path):
    """The OOM comes while the model's weights are made (or converted): that is the model not
    fitting, not data made before any model ran."""
    out = _memdoctor("diagnose", SCENARIOS / "model_too_big_to_build.py", "--budget", "200MiB", "--json", "--",
                     *extra, cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "model-states", [(f["rule"], f["title"]) for f in out["findings"]]
    assert (first["details"]["how"], first["details"]["building"]) == (how, cls)
    asked = 4096 * 4096 * (8 if how == "moved" else 4)
    assert (first["details"]["built"], first["details"]["requested"]) == (built, asked)
    assert "data-on-device" not in [f["rule"] for f in out["findings"]]
    plans = [r["title"] for r in first["remedies"]]
    assert plans[0] == ("keep the data on the host" if extra == ["data"] else "shard the parameters (ZeRO-3 / FSDP)")


def test_a_graph_retained_into_the_next_step_is_named(tmp_path):
    """`backward(retain_graph=True)` with the loss still bound: the last step's saved tensors
    live through the next forward. Their bytes are what one forward saves, counted by
    torch's saved-tensor hooks (less the batch and its targets, which are inputs); the fix
    is predicted no lower than the fixed script's traced peak, which fits."""
    script = SCENARIOS / "retain_graph_stray.py"
    out = _memdoctor("diagnose", script, "--budget", "56MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "retained-graph", [(f["rule"], f["title"]) for f in out["findings"]]
    saved = int(subprocess.run([sys.executable, script, "count"], capture_output=True, text=True, check=True,
                               timeout=120).stdout.split()[-1])
    batch, targets = 64 * 28 * 28 * 4, 64 * 8
    assert abs(first["accounts_for_bytes"] - (saved - batch - targets)) <= 64, (first["accounts_for_bytes"], saved)
    fixed = _memdoctor("trace", script, "--json", "--", "fixed", cwd=tmp_path)["peak_bytes"]
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    assert fixed <= predicted <= 1.15 * fixed and fixed < out["budget_bytes"], (predicted, fixed)


@pytest.mark.parametrize("mode, budget", [("loss-net", "40MiB"), ("loss-net", "44MiB"), ("teacher", "24MiB")])
def test_a_network_no_optimizer_trains_left_requiring_grad_is_named(mode, budget, tmp_path):
    """A perceptual loss network or a teacher whose parameters still require grad: its passes
    save activations for gradients nothing uses (and, once backward ran, hold them). The fix
    (`requires_grad_(False)`) is predicted within 5% of the fixed script's traced peak."""
    script = SCENARIOS / "frozen_network_requires_grad.py"
    out = _memdoctor("diagnose", script, "--budget", budget, "--json", "--", mode, cwd=tmp_path)
    rules = [f["rule"] for f in out["findings"]]
    assert rules[0] == "grads-never-stepped", rules
    assert "eval-without-no-grad" not in rules, rules        # the loss net's passes feed the loss
    fixed = _memdoctor("trace", script, "--json", "--", mode, "fixed", cwd=tmp_path)["peak_bytes"]
    predicted = out["findings"][0]["remedies"][0]["predicted_peak_bytes"]
    assert fixed <= out["budget_bytes"] and abs(predicted - fixed) <= 0.05 * fixed, (predicted, fixed)


def test_a_teacher_without_no_grad_out_in_its_first_pass_is_an_evaluation(tmp_path):
    """Out of memory in the teacher's first pass, before any backward: in eval mode with grad
    on and nothing awaiting a backward, run under no_grad is its fix (what a teacher needs)."""
    out = _memdoctor("diagnose", SCENARIOS / "frozen_network_requires_grad.py", "--budget", "20MiB", "--json",
                     "--", "teacher", cwd=tmp_path)
    assert out["findings"][0]["rule"] == "eval-without-no-grad", [f["rule"] for f in out["findings"]]


def test_gradients_zeroed_in_place_under_accumulation_are_no_cause(tmp_path):
    """With micro-batches accumulating, `zero_grad(set_to_none=True)` leaves the peak where it
    is (traced: the same bytes), so keeping the gradients allocated is not named."""
    script = SCENARIOS / "accumulate_grads_zeroed_in_place.py"
    out = _memdoctor("diagnose", script, "--budget", "106MiB", "--json", cwd=tmp_path)
    assert out["oom"] and "grads-during-forward" not in [f["rule"] for f in out["findings"]], out["findings"]
    in_place = _memdoctor("trace", script, "--json", cwd=tmp_path)["peak_bytes"]
    to_none = _memdoctor("trace", script, "--json", "--", "none", cwd=tmp_path)["peak_bytes"]
    assert in_place == to_none


def test_an_averaged_model_predicting_in_training_mode_without_no_grad_is_an_evaluation(tmp_path):
    """torch's SWA recipe ends with `swa_model(test_input)`, the AveragedModel in training mode
    and grad mode on: no optimizer trains that model and its input needs no gradient, so the
    pass the OOM cut short is an evaluation; no_grad is predicted no lower than it measures."""
    script = SCENARIOS / "swa_predict_without_no_grad.py"
    out = _memdoctor("diagnose", script, "--budget", "140MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "eval-without-no-grad", [(f["rule"], f["title"]) for f in out["findings"]]
    fixed = _memdoctor("trace", script, "--json", "--", "fixed", cwd=tmp_path)["peak_bytes"]
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    assert fixed <= predicted <= out["budget_bytes"], (predicted, fixed)


@pytest.mark.parametrize("budget", ["60MiB", "84MiB"])
def test_a_gradient_penalty_step_is_no_evaluation(budget, tmp_path):
    """WGAN-GP: `autograd.grad` runs a backward of its own between the critic's passes and
    the critic's loss's backward; out of memory in that backward (or between the passes), the
    critic's passes await it: a cause is named, and it is no evaluation without no_grad."""
    out = _memdoctor("diagnose", SCENARIOS / "gradient_penalty.py", "--budget", budget, "--json", cwd=tmp_path)
    rules = [f["rule"] for f in out["findings"]]
    assert out["oom"] and rules and "eval-without-no-grad" not in rules, rules


def test_a_foreach_step_out_at_its_first_scratch_tensor_is_the_optimizers_scratch(tmp_path):
    """Just room for the model states: the foreach step runs out making the first output of a
    list as large as the parameters (on CUDA the allocator's partly used segments leave that
    little room). The whole list is what the step needs, not the one tensor it got to."""
    script = SCENARIOS / "foreach_adamw_many_layers.py"
    out = _memdoctor("diagnose", script, "--budget", "222MiB", "--json", cwd=tmp_path)
    assert out["ooms"][0]["phase"] == "optimizer"
    first = out["findings"][0]
    params = 24 * _linear(768, 768) * 4
    assert first["rule"] == "optimizer-step-temporaries" and first["accounts_for_bytes"] >= params, first
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    states = 4 * params         # weights, gradients and AdamW's two moments, in fp32
    assert states < predicted < out["budget_bytes"], predicted


def test_gradients_never_zeroed_by_a_hand_written_update_are_what_ran_out(tmp_path):
    """An update by hand without `model.zero_grad()` (pytorch/examples' word_language_model
    with its zero_grad dropped): the gradients are under a tenth of what is alive beside the
    logits, but without them the request would fit. The fix names the model's zero_grad (there
    is no optimizer) and predicts the peak the fixed loop measures."""
    script = SCENARIOS / "grads_never_zeroed_manual_sgd.py"
    out = _memdoctor("diagnose", script, "--budget", "262MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "grads-during-forward", [f["rule"] for f in out["findings"]]
    live = sum(out["breakdown"].values())
    assert first["accounts_for_bytes"] < 0.1 * live
    assert first["remedies"][0]["how"].startswith("model.zero_grad(set_to_none=True)")
    fixed = _memdoctor("diagnose", script, "--budget", "262MiB", "--json", "--", "--zero-grad", cwd=tmp_path)
    assert not fixed["oom"]
    assert abs(first["remedies"][0]["predicted_peak_bytes"] - fixed["peak_bytes"]) <= 0.02 * fixed["peak_bytes"]


def test_a_gradient_asked_for_in_backward_is_not_counted_twice_in_zeros_prediction(tmp_path):
    """SGD, no state: out of memory in backward asking for a large weight's gradient. That
    request is the gradients the model states count already; ZeRO-2's shard of them is half."""
    script = tmp_path / "wide_sgd.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(20, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),\n"
        "                            torch.nn.ReLU(), torch.nn.Linear(4096, 1))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "for step in range(2):\n"
        "    optimizer.zero_grad()\n"
        "    torch.nn.functional.mse_loss(model(torch.randn(32, 20)), torch.randn(32, 1)).backward()\n"
        "    optimizer.step()\n")
    out = _memdoctor("diagnose", script, "--budget", "128MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "model-states" and out["ooms"][0]["phase"] == "backward"
    weights = 4 * (_linear(20, 4096) + _linear(4096, 4096) + _linear(4096, 1))
    zero2 = next(r for r in first["remedies"] if r["plan"] == "zero=2")
    assert weights + weights // 2 < zero2["predicted_peak_bytes"] < weights + weights // 2 + 4 * 2**20


def test_a_recurrent_forwards_own_list_of_outputs_is_not_what_keeps_its_activations(tmp_path):
    """time_sequence_prediction's forward gathers each time step's output in a local list and
    joins it at the end: the cells' saved tensors are kept by the graph, not by that list. The
    activations' line is the cell's call."""
    script = tmp_path / "unrolled.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Sequence(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.cell = nn.LSTMCell(1, 256)\n"
        "        self.linear = nn.Linear(256, 1)\n"
        "    def forward(self, x):\n"
        "        outputs = []\n"
        "        h = c = torch.zeros(x.size(0), 256)\n"
        "        for x_t in x.split(1, dim=1):\n"
        "            h, c = self.cell(x_t, (h, c))\n"
        "            outputs += [self.linear(h)]\n"
        "        return torch.cat(outputs, dim=1)\n"
        "model = Sequence()\n"
        "optimizer = torch.optim.Adam(model.parameters())\n"
        "for step in range(2):\n"
        "    x = torch.randn(64, 200)\n"
        "    loss = (model(x) - x).pow(2).mean()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n")
    out = _memdoctor("diagnose", script, "--budget", "48MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations", [f["rule"] for f in out["findings"]]
    assert first["source"]["text"].strip() == "h, c = self.cell(x_t, (h, c))", first["source"]


def test_a_prediction_pass_left_in_training_mode_with_grad_on_is_evaluation_without_no_grad(tmp_path):
    """time_sequence_prediction's prediction after each training step, from its own line, left
    without no_grad and in training mode: the pass the OOM cuts short is no training pass (its
    line was never back-propagated; the model was trained from another), and the fix's peak
    is the training's, with the optimizer state made after the first step's peak."""
    script = SCENARIOS / "prediction_pass_in_training_mode.py"
    out = _memdoctor("diagnose", script, "--budget", "200MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "eval-without-no-grad", [f["rule"] for f in out["findings"]]
    predicted = first["remedies"][0]["predicted_peak_bytes"]
    fixed = _memdoctor("trace", script, "--json", "--", "fixed", cwd=tmp_path)["peak_bytes"]
    # the fixed run also keeps each prediction's 70 KB output into the next training step
    assert 0.995 * fixed <= predicted <= 1.05 * fixed, (predicted, fixed)
