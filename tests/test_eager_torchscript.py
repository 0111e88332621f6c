"""TorchScript functions in a model (transformers' DeBERTa-v2 scripts its relative-position
buckets) run as fused kernels once profiled, and a fused kernel reads its inputs' memory:
on fake tensors there is none (an illegal memory access on a GPU, a crash on the CPU).
memdoctor.predict.eager_libraries.eager() runs the Python functions they were scripted from
instead, op by op on fake tensors, also after real runs earlier in the process cached a
fused plan. The CPU's TorchScript fuser is turned
on here (its interpreter backend) to make the fused kernel run as it does on a GPU; each
case runs in a subprocess because the unprotected one crashes."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import ROOT

SCRIPT = textwrap.dedent("""
    import contextlib, sys, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memdoctor.predict.eager_libraries import eager

    @torch.jit.script
    def bucket(pos, mid: int):
        sign = torch.sign(pos)
        far = torch.ceil(torch.log(torch.abs(pos) / mid + 1.0) * mid)
        return torch.where(torch.abs(pos) <= mid, pos, far * sign)

    torch._C._jit_override_can_fuse_on_cpu(True)
    torch._C._jit_set_te_must_use_llvm_cpu(False)
    protect, real_first = sys.argv[1] == "eager", sys.argv[2] == "real-first"
    if real_first:
        for _ in range(4):
            real = bucket(torch.linspace(-300, 300, 600).reshape(20, 30), 128)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with (eager() if protect else contextlib.nullcontext()):
            for _ in range(4):
                out = bucket(torch.empty(20, 30), 128)
            print("inside", type(bucket).__name__)
    print("after", type(bucket).__name__)
    print("shape", tuple(out.shape), type(out).__name__)
    if real_first:      # real runs after the estimate fuse again and give the same values
        again = bucket(torch.linspace(-300, 300, 600).reshape(20, 30), 128)
        print("same", bool(torch.equal(real, again)))
""")


def _run(tmp_path, *args):
    script = tmp_path / "scripted.py"       # TorchScript compiles from the source file
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("history", ["fresh", "real-first"])
def test_scripted_functions_run_op_by_op_on_fake_tensors(tmp_path, history):
    proc = _run(tmp_path, "eager", history)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shape (20, 30) FakeTensor" in proc.stdout
    # the Python function it was scripted from runs inside, the scripted one again after
    assert "inside function" in proc.stdout and "after ScriptFunction" in proc.stdout
    if history == "real-first":
        assert "same True" in proc.stdout


def test_without_eager_the_fused_kernel_reads_fake_memory(tmp_path):
    """The case above is real: unprotected, the fused kernel runs on memory that is not there."""
    proc = _run(tmp_path, "bare", "fresh")
    assert proc.returncode != 0 or "FakeTensor" not in proc.stdout
