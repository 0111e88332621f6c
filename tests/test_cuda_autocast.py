"""CUDA autocast's casting rules and CUDA's dropout on a CPU-only torch standing in for CUDA
(memdoctor.predict.cuda_autocast, memdoctor.predict.cuda_dropout): the dtypes, casts and
saved tensors a GPU makes, and CPU autocast as it was once the block ends."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memdoctor.predict import cuda_autocast as ca
from memdoctor.predict.cpu_standin import cuda_kernels
from memdoctor.predict.cuda_autocast import cuda_autocast

bf16 = torch.bfloat16


class Ops(TorchDispatchMode):
    """The aten ops run, with their first output's dtype."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        self.seen.append((func.overloadpacket.__name__, getattr(first, "dtype", None)))
        return out


def run(fn, *args):
    with Ops() as ops:
        out = fn(*args)
    return out, ops.seen


def test_cuda_lists_run_as_on_cuda_under_cpu_autocast():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with cuda_autocast(), torch.autocast("cpu", dtype=bf16):
        assert torch.mm(x, w).dtype == bf16                           # lower precision, as on CPU
        xb = x.to(bf16)
        assert torch.softmax(xb, -1).dtype == torch.float32           # fp32_set_opt_dtype (CPU: bf16)
        assert torch.softmax(xb, -1, dtype=bf16).dtype == bf16        # a dtype given is kept
        assert xb.sum().dtype == torch.float32
        assert F.layer_norm(xb, (8,)).dtype == torch.float32          # fp32 (CPU: bf16)
        assert xb.pow(2).dtype == torch.float32 and xb.rsqrt().dtype == torch.float32
        assert torch.norm(xb).dtype == torch.float32                  # fp32_append_dtype
        assert torch.addcmul(xb, x, xb).dtype == torch.float32        # promote
        # cat is not cast on CUDA (CPU autocast promotes it by copying first): no _to_copy
        out, ops = run(torch.cat, [xb, x])
        assert out.dtype == torch.float32 and [n for n, _ in ops] == ["cat"]
        # cross-entropy: log_softmax in the logits' dtype, an fp32 copy for nll_loss (CPU: fp32 first)
        t = torch.randint(0, 8, (4,))
        loss, ops = run(F.cross_entropy, xb, t)
        assert loss.dtype == torch.float32
        assert [(n, d) for n, d in ops if n != "detach"] == [
            ("_log_softmax", bf16), ("_to_copy", torch.float32), ("nll_loss_forward", torch.float32)]
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(x), torch.rand(4, 8))


def test_cpu_autocast_is_the_cpus_again_afterwards():
    xb = torch.randn(4, 8).to(bf16)
    with cuda_autocast():
        pass
    with torch.autocast("cpu", dtype=bf16):
        assert torch.softmax(xb, -1).dtype == bf16
        assert F.layer_norm(xb, (8,)).dtype == bf16
        assert torch.mm(torch.randn(4, 8), torch.randn(8, 8)).dtype == bf16
        F.binary_cross_entropy(torch.sigmoid(xb.float()), torch.rand(4, 8))     # fp32 on the CPU


def test_parameter_casts_are_cached_until_autocast_exits_and_made_bias_first():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def twice(x):
        return lin(x) + lin(x)
    with cuda_autocast():
        with torch.autocast("cpu", dtype=bf16):
            _, ops = run(twice, x)
            # one cast of the bias, one of the weight (made in this order, as the H200 made
            # them), then the input's cast for each call
            copies = [n for n, _ in ops if n == "_to_copy"]
            assert len(copies) == 4
        with torch.autocast("cpu", dtype=bf16):
            _, ops = run(twice, x)           # a new region: the parameters are cast again
            assert sum(n == "_to_copy" for n, _ in ops) == 4

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy":
                self.sizes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))
    with cuda_autocast(), torch.autocast("cpu", dtype=bf16), Sizes() as sizes:
        lin(x)
    assert sizes.sizes == [(8,), (8, 8), (4, 8)]


def test_every_op_cuda_autocast_registers_has_its_policy():
    """The lists follow autocast_mode.h; an op this torch's CUDA autocast registers that they
    lack would run uncast here."""
    registered = [n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")]
    assert registered and [n for n in registered if ca.policy_of(n) is None] == []


def test_dropout_runs_cudas_fused_kernel_and_saves_a_boolean_mask():
    x = torch.randn(64, 64, requires_grad=True)
    with cuda_kernels():
        out, ops = run(F.dropout, x, 0.1, True)
        names = [n for n, _ in ops]
        assert "native_dropout" in names and "bernoulli" not in names
        saved = {t.dtype for t in (out.grad_fn._saved_result1,)}
        assert saved == {torch.bool}
        # in place, feature and evaluation dropout run what the CPU runs on CUDA too
        _, ops = run(F.dropout, x.detach().clone(), 0.1, True, True)
        assert "native_dropout" not in [n for n, _ in ops]
        _, ops = run(F.dropout, x, 0.1, False)
        assert ops == []
    _, ops = run(F.dropout, x, 0.1, True)
    assert "native_dropout" not in [n for n, _ in ops]
