"""The step-time model (memdoctor.predict.step_time): the work an estimate counts, and the H200
constants against the step times measured on the GPU."""
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memdoctor.predict.config import estimate_config
from memdoctor.predict.estimate import estimate
from memdoctor.predict.step_time import H200, Work, step_seconds

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x):
        return nn.functional.gelu(self.fc(x))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(64, 256), nn.Linear(256, 10)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def mlp() -> nn.Module:
    return MLP()


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def counted(plan=None):
    est = estimate(mlp, None, data(), loss_fn, plan=plan, device="cpu")
    return Work.from_dict(est.work["compute"]), Work.from_dict(est.work["optimizer"]), est


def test_flops_match_torchs_flop_counter_on_a_real_step():
    model = mlp()
    with FlopCounterMode(display=False) as fc:
        loss_fn(model, data()).backward()
    compute, _, _ = counted()
    assert compute.flops32 == fc.get_total_flops() > 0
    assert compute.flops16 == 0


def test_bf16_moves_the_matmul_flops_to_the_16_bit_rate():
    plain, _, _ = counted()
    bf16, _, _ = counted("bf16")
    assert bf16.flops16 == plain.flops32 and bf16.flops32 == 0
    assert bf16.ops > plain.ops            # autocast's casts


def test_micro_batches_issue_the_ops_again_for_the_same_flops():
    plain, opt, _ = counted()
    micro, opt_micro, _ = counted("micro=8")       # four micro-batches
    assert micro.flops32 == plain.flops32
    # plus each micro-batch's slicing and loss scaling, and three more gradient sums
    assert 4 * plain.ops <= micro.ops <= 4.5 * plain.ops
    assert opt_micro.ops == opt.ops
    assert step_seconds(micro, opt_micro) > step_seconds(plain, opt)


def test_checkpointing_counts_the_recomputed_forward():
    plain, _, _ = counted()
    full, _, _ = counted("ckpt=full")
    selective, _, _ = counted("ckpt=selective")
    block_forward = 2 * 2 * BATCH * 256 * 256          # the two blocks' matmuls, once more
    assert full.flops32 == plain.flops32 + block_forward and full.ops > plain.ops
    assert selective.mode_ops > 0 and full.mode_ops == 0 and plain.mode_ops == 0


def test_a_fused_swap_counts_its_kernel_from_the_parameters():
    _, opt, est = counted("opt=adamw-bf16")
    params = sum(p.numel() for p in mlp().parameters())
    assert (opt.ops, opt.launches) == (0, 1)
    assert opt.bytes == params * (4 + 4)    # fp32 weights written, bf16 moments
    compute, opt_ib, _ = counted("opt=in-backward")
    assert opt_ib.bytes == 0 and compute.launches == len(list(mlp().parameters()))


def test_the_h200_constants_reproduce_the_measured_step_times():
    """Step times of GPT-2 1.5B plans measured on an H200 (benchmarks/results/plan_apply_h200_*.json),
    with the work counted on this machine."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_time_fit
    finally:
        sys.path.pop(0)
    cache = step_time_fit.cached_work()
    rows = step_time_fit.measured_rows()
    assert len(rows) >= 20
    errors = sorted(abs(step_time_fit.predict(cache[f"{r['model']}/b{r['batch']}/s{r['seq']}/{r['plan']}"], H200,
                                              r["plan"]) / r["measured_s"] - 1) for r in rows)
    assert errors[len(errors) // 2] <= 0.07 and errors[-1] <= 0.25      # the fit's own: 5% and 22%


def test_counted_work_of_a_known_model_is_stable():
    """The cached work counts the fit uses are what an estimate counts today."""
    newest = max((ROOT / "benchmarks" / "results").glob("step_time_fit_*.json"), key=lambda p: p.stem[-10:])
    cache = json.loads(newest.read_text())["work"]
    est = estimate_config("gpt2-1.5b", batch=2, seq=1024, plan="ckpt=full,opt=in-backward-8bit")
    cached = cache["gpt2-1.5b/b2/s1024/ckpt=full,opt=in-backward-8bit"]
    assert est.work["compute"]["ops"] == pytest.approx(cached["compute"]["ops"], rel=0.02)
    assert est.work["compute"]["flops32"] == pytest.approx(cached["compute"]["flops32"], rel=1e-6)
