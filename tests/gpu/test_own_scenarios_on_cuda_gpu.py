"""Our own scenarios on the GPU, at the pressure their CPU budgets set (the CPU budget plus
what the GPU's traced peak adds to the CPU's: benchmarks/scenarios_on_cuda.py, which runs
them all): the cases the allocator source once named wrong, each still named as on the CPU.
Each case traces its script on the CPU and the GPU, then diagnoses it on the GPU."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = [
    # a kept 32 MiB output (a cuBLAS workspace's size), beside a large frozen model
    ("leak_in_two_steps.py", ["reference"], "372MiB", "leak"),
    # the last step's logits still bound to a variable: no backward kept a graph
    ("head_outside_blocks.py", [], "180MiB", "activations"),
    ("retain_graph_stray.py", [], "56MiB", "retained-graph"),
    # data made on the device before any model, no shape known
    ("dataset_through_dataloader.py", [], "180MiB", "data-on-device"),
    ("batches_made_up_front.py", [], "200MiB", "data-on-device"),
    # an evaluation under no_grad gathering its logits
    ("eval_gathers_outputs.py", [], "160MiB", "leak"),
    ("gan_two_optimizers.py", [], "56MiB", "model-states"),
    ("foreach_adamw_many_layers.py", [], "248MiB", "optimizer-step-temporaries"),
    ("two_towers_contrastive.py", [], "192MiB", "activations"),
    ("losses_summed_one_backward.py", [], "160MiB", "activations"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] + "".join(c[1]) for c in CASES])
def test_named_on_the_gpu_as_on_the_cpu(case, tmp_path):
    import scenarios_on_cuda
    wrapper = tmp_path / "on_cuda.py"
    wrapper.write_text(scenarios_on_cuda.ON_CUDA)
    row = scenarios_on_cuda.run_case(case, str(wrapper))
    assert "error" not in row, row.get("error")
    assert row["oom"], row
    assert row["first"] == case[3], (row["oom_phase"], row["oom_step"], row["findings"])
