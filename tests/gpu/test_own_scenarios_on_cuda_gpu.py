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

import scenarios_on_cuda  # noqa: E402

# the cases the allocator source once named wrong (budgets and causes as the benchmark has them)
ONCE_WRONG = {
    ("leak_in_two_steps.py", ("reference",)),       # a kept 32 MiB output, a cuBLAS workspace's size
    ("retain_graph_stray.py", ()),
    ("dataset_through_dataloader.py", ()),          # data made before any model, no shape known
    ("batches_made_up_front.py", ()),
    ("eval_gathers_outputs.py", ()),                # outputs of passes under no_grad
    ("gan_two_optimizers.py", ()),                  # model states beside cuBLAS's workspaces
    ("foreach_adamw_many_layers.py", ()),
    ("two_towers_contrastive.py", ()),              # a loss outside the towers
    ("losses_summed_one_backward.py", ()),
}
CASES = [c for c in scenarios_on_cuda.all_cases() if (c[0], tuple(c[1])) in ONCE_WRONG]
assert len(CASES) == len(ONCE_WRONG), "a case above is not among the benchmark's"


@pytest.mark.parametrize("case", CASES, ids=[c[0] + "".join(c[1]) for c in CASES])
def test_named_on_the_gpu_as_on_the_cpu(case, tmp_path):
    wrapper = tmp_path / "on_cuda.py"
    wrapper.write_text(scenarios_on_cuda.ON_CUDA)
    row = scenarios_on_cuda.run_case(case, str(wrapper))
    assert "error" not in row, row.get("error")
    assert row["oom"], row
    assert row["first"] == case[3], (row["oom_phase"], row["oom_step"], row["findings"])
