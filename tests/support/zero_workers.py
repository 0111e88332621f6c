"""What tests/test_zero.py and tests/gpu/test_zero_gpu.py run on every rank: the small
models, data and training loops, the DDP reference, and the numerics and memory workers.
A worker takes a device, so the same code runs over gloo on CPU ranks and over NCCL.
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

import memdoctor
from memdoctor.remedies import Plan, prepare
from memdoctor.remedies.zero import apply_zero


# ----------------------------------------------------------------------------- models and steps
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + x


def small_model(device) -> nn.Module:
    """Blocks for FSDP2 to wrap, a 64x64 weight (a bucket of its own, reduced where it lies
    with a small bucket size) and odd sizes (padding)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 64), Block(64), Block(64), Block(64), nn.Linear(64, 5)).to(device)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def data(step: int, rank: int, device, n: int = 8, same: bool = False):
    g = torch.Generator().manual_seed(100 * step + (0 if same else rank + 1))
    return torch.randn(n, 13, generator=g).to(device), torch.randn(n, 5, generator=g).to(device)


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, device, steps: int, start: int = 0, same: bool = False) -> None:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        mse(model, data(step, rank, device, same=same)).backward()
        opt.step()


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()


def params(model) -> list[torch.Tensor]:
    return [full(p) for p in model.parameters()]


def ddp_reference(device, steps: int = 5, micro: int | None = None, same_first: int = 0,
                  precision: str | None = None) -> tuple[list[torch.Tensor], dict]:
    """DDP's parameters and AdamW state after `same_first` steps on the same data on every
    rank and `steps` more on each rank's own shard."""
    model = small_model(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = adamw(ddp)
    train(ddp, opt, device, same_first, same=True)
    if micro is None and precision is None:
        train(ddp, opt, device, steps, start=same_first)
    else:
        prepared = prepare(ddp, opt, Plan(precision=precision, micro_batch=micro), device_type=device.type)
        for step in range(same_first, same_first + steps):
            prepared.step(data(step, dist.get_rank(), device), mse)
    state = {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    return params(model), state


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The worst |a - b| / (1e-5 |b| + 1e-7) over all elements: <= 1 passes rtol=1e-5."""
    return max(((x - y).abs() / (1e-5 * y.abs() + 1e-7)).max().item() for x, y in zip(a, b))


def optimizer_phase_categories(run) -> dict[str, int]:
    """Bytes by category at the end of the last optimizer step of a traced run."""
    from memdoctor.attribution import breakdown_at
    marks = run.marks
    last = max(i for i, m in enumerate(marks) if m.phase == "optimizer")
    end = (marks[last + 1].seq if last + 1 < len(marks) else run.num_events) - 1
    return breakdown_at(run, end).by_category


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor in this process holds now (each once)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor and type(obj) is not nn.Parameter:
            continue        # DTensor wrappers hold no storage; their local tensors are counted
        try:
            storage = obj.untyped_storage()
        except Exception:
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


# ----------------------------------------------------------------------------- workers
def numerics_worker(device) -> dict:
    """ZeRO-2 and -3 against DDP in several ways; one spawn for all to save start-up time."""
    out: dict = {}
    rank = dist.get_rank()
    want, want_state = ddp_reference(device)

    # ZeRO-2, 5 steps of AdamW, small buckets: several buckets, one reduced in place
    model = small_model(device)
    opt = adamw(model)
    handle = apply_zero(model, opt, stage=2, bucket_bytes=16 * 1024)
    out["zero2_buckets"] = len(handle.buckets)
    out["zero2_direct_buckets"] = sum(b.direct for b in handle.buckets)
    out["zero2_same_optimizer"] = handle.optimizer is opt
    train(model, opt, device, 5)
    out["zero2"] = max_rel(params(model), want)
    out["zero2_local_bytes"] = (handle.local_param_bytes, handle.total_param_bytes)
    handle.undo()
    out["zero2_after_undo"] = max_rel(params(model), want)
    got_state = {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    out["zero2_undo_state"] = max(max_rel([got_state[n][k]], [want_state[n][k]])
                                  for n in want_state for k in ("exp_avg", "exp_avg_sq"))
    out["zero2_undo_own_storage"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                                        for p in model.parameters())
    out["zero2_undo_steps"] = [float(opt.state[p]["step"]) for p in model.parameters()]

    # ZeRO-1 is served by the same flat buckets
    model = small_model(device)
    opt = adamw(model)
    handle = apply_zero(model, opt, stage=1)
    train(model, opt, device, 5)
    out["zero1"] = max_rel(params(model), want)
    handle.undo()

    # ZeRO-3 (FSDP2), 5 steps; what a rank holds between steps; undo
    model = small_model(device)
    opt = adamw(model)
    handle = apply_zero(model, opt, stage=3)
    train(model, opt, device, 5)
    opt.zero_grad(set_to_none=True)
    out["zero3"] = max_rel(params(model), want)
    local = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    out["zero3_weights"] = (local, whole)
    handle.undo()
    out["zero3_after_undo"] = max_rel(params(model), want)
    out["zero3_undo_plain_modules"] = all(type(m).__module__.startswith("torch.nn") or type(m) in (Block,)
                                          for m in model.modules())
    got_state = {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    out["zero3_undo_state"] = max(max_rel([got_state[n][k]], [want_state[n][k]])
                                  for n in want_state for k in ("exp_avg", "exp_avg_sq"))

    # micro-batches through prepare(Plan(zero=2, micro_batch=3)) against DDP with no_sync
    want_micro, _ = ddp_reference(device, micro=3)
    for stage in (2, 3):
        model = small_model(device)
        opt = adamw(model)
        prepared = prepare(model, opt, Plan(zero=stage, micro_batch=3), device_type=device.type)
        for step in range(5):
            prepared.step(data(step, rank, device), mse)
        out[f"zero{stage}_micro"] = max_rel(params(model), want_micro)
        prepared.undo()

    # accumulation by hand, the first micro-batch under handle.no_sync()
    model = small_model(device)
    opt = adamw(model)
    handle = apply_zero(model, opt, stage=2)
    for step in range(5):
        x, y = data(step, rank, device)
        opt.zero_grad(set_to_none=True)
        with handle.no_sync():
            (mse(model, (x[:3], y[:3])) * 3 / 8).backward()
        (mse(model, (x[3:], y[3:])) * 5 / 8).backward()
        opt.step()
    out["zero2_no_sync"] = max_rel(params(model), want_micro)
    handle.undo()

    # ZeRO applied to a run under way: 2 steps before (same data everywhere), 3 after
    want_carry, _ = ddp_reference(device, steps=3, same_first=2)
    for stage in (2, 3):
        model = small_model(device)
        opt = adamw(model)
        train(model, opt, device, 2, same=True)
        handle = apply_zero(model, opt, stage=stage)
        train(model, opt, device, 3, start=2)
        out[f"zero{stage}_carry"] = max_rel(params(model), want_carry)
        handle.undo()

    # fp16 autocast with a loss scaler: prepare swaps in a ShardedGradScaler
    want_fp16, _ = ddp_reference(device, precision="fp16")
    model = small_model(device)
    opt = adamw(model)
    prepared = prepare(model, opt, Plan(precision="fp16", zero=2), device_type=device.type)
    out["fp16_scaler"] = type(prepared.scaler).__name__
    for step in range(5):
        prepared.step(data(step, rank, device), mse)
    out["zero2_fp16"] = max_rel(params(model), want_fp16)
    prepared.undo()

    # bf16-true: bf16 weights, each rank keeps fp32 masters of its shard only. On the same
    # data on every rank the mean gradient is the local one exactly (halving and summing two
    # equal bf16 values is exact), so it must follow one process's bf16-true training.
    ref = small_model(device)
    ref_prepared = prepare(ref, adamw(ref), Plan(precision="bf16-true"), device_type=device.type)
    for step in range(4):
        ref_prepared.step(data(step, 0, device, same=True), mse)
    model = small_model(device)
    opt = adamw(model)
    prepared = prepare(model, opt, Plan(precision="bf16-true", zero=2), device_type=device.type)
    for step in range(4):
        prepared.step(data(step, rank, device, same=True), mse)
    out["zero2_bf16_true"] = max_rel(params(model), params(ref))
    out["zero2_bf16_true_weights"] = sorted({str(p.dtype) for p in model.parameters()})
    stepped = [p for g in opt.param_groups for p in g["params"]]
    out["zero2_bf16_true_masters"] = (sorted({str(p.dtype) for p in stepped}), sum(p.numel() for p in stepped),
                                      sum(p.numel() for p in model.parameters()))
    prepared.undo()
    out["zero2_bf16_true_undo"] = sorted({str(p.dtype) for p in model.parameters()})

    # an optimizer that needs whole tensors is refused for ZeRO-2
    model = small_model(device)
    try:
        apply_zero(model, torch.optim.Adafactor(model.parameters()), stage=2)
        out["adafactor"] = "accepted"
    except ValueError as exc:
        out["adafactor"] = str(exc)
    return out


def s01_model(device) -> nn.Module:
    torch.manual_seed(0)
    width = 2048
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]).to(device)


def s01_steps(model, opt, device, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(dist.get_rank() + 1)
    for _ in range(steps):
        x = torch.randn(8, 2048, generator=g).to(device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def memory_worker(device) -> dict:
    """The s01 scenario per rank: ZeRO-2 under memdoctor.watch(budget="224MiB"), then DDP
    under the tracer with no budget, both read at the end of the optimizer step."""
    from memdoctor.capture.session import Tracer
    out: dict = {}
    model = s01_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    handle = apply_zero(model, opt, stage=2)
    oom = None
    try:
        with memdoctor.watch(model, opt, budget="224MiB") as doc:
            s01_steps(model, opt, device)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    out["zero2_oom"] = oom
    out["zero2_peak"] = doc.run.meta.get("peak_live_bytes")
    out["zero2_at_step"] = optimizer_phase_categories(doc.run)
    handle.undo()
    del model, opt, handle, doc
    gc.collect()

    model = s01_model(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=False)
    with Tracer([ddp], [opt], source="dispatch") as tracer:
        s01_steps(ddp, opt, device)
    out["ddp_peak"] = tracer.run.meta.get("peak_live_bytes")
    out["ddp_at_step"] = optimizer_phase_categories(tracer.run)
    del ddp, model, opt
    gc.collect()

    # ZeRO-3 against DDP between steps: every live tensor this process holds, weights and state
    baseline = live_tensor_bytes()
    model = s01_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    handle = apply_zero(model, opt, stage=3)
    s01_steps(model, opt, device, steps=2)
    out["zero3_live"] = live_tensor_bytes() - baseline
    out["model_states_plain"] = 3 * sum(p.numel() * p.element_size() for p in handle._old_to_new.values())
    handle.undo()
    del model, opt, handle
    gc.collect()

    # the tracer follows FSDP2: gathered weights freed with storage.resize_(0) and gathered
    # again into the same storage, DTensors counted by their local shard
    with Tracer(source="dispatch") as tracer:
        model = s01_model(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        handle = apply_zero(model, opt, stage=3)
        s01_steps(model, opt, device, steps=2)
        out["zero3_traced_live"] = tracer.recorder.live_bytes
    out["zero3_traced_peak"] = tracer.run.meta.get("peak_live_bytes")
    handle.undo()
    return out
