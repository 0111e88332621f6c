"""FusedAdamW: torch.optim.AdamW's step with fp32, bf16 or blockwise 8-bit states, fused into
one Triton launch for many tensors.

The math is torch.optim.AdamW's (decoupled weight decay, `decoupled_weight_decay=False`
gives Adam's L2 decay), computed in fp32 whatever the parameter dtype (fp32, bf16, fp16):

    p *= 1 - lr * wd
    m += (1 - beta1) * (g - m)
    v  = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

Where it runs: on CUDA tensors with Triton installed, the kernels
(memdoctor.cuda.kernels.adamw_triton); anywhere else (CPU, or no Triton) the same math in
plain torch ops, one tensor at a time (memdoctor.cuda.kernels.adamw_math, which also
describes the state formats). `backend="triton"` forces the kernel, which with
TRITON_INTERPRET=1 also runs on CPU tensors.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import is_fake

from memdoctor.cuda.kernels.adamw_math import (
    QBLOCK,
    STATE_DTYPES,
    Hyper,
    dequant_m,
    dequant_v,
    pad_blocks,
    quant_m,
    quant_v,
    reference_update,
    state_bytes_per_param,
)
from memdoctor.cuda.kernels.adamw_triton import (
    DTYPE_CODE,
    HAVE_TRITON,
    INTERPRET,
    Bucket,
    launch_one,
    triton_usable,
)

__all__ = ["FusedAdamW", "STATE_DTYPES", "QBLOCK", "HAVE_TRITON", "triton_usable", "state_bytes",
           "state_bytes_per_param"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in optimizer.state (each storage counted once)."""
    seen: dict[Any, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[(storage.data_ptr(), value.device)] = storage.nbytes()
    return sum(seen.values())


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with fused multi-tensor steps and fp32, bf16 or blockwise 8-bit states.

    `state_dtype`: "fp32", "bf16" (stochastic rounding) or "int8" (blockwise, 256 a
    block). `decoupled_weight_decay=False` is Adam's L2 decay (for replacing
    torch.optim.Adam). `backend`: "auto" (the Triton kernel on CUDA when Triton is
    installed, torch ops elsewhere), "triton" or "torch". `seed` feeds the stochastic
    rounding's counter hash.

    The state per parameter is `step` (a 0-dim fp32 CPU tensor, as torch's), `exp_avg`
    and `exp_avg_sq` (shaped like the parameter, in the state dtype: int8 and uint8 codes
    for "int8"), and for "int8" `exp_avg_scale` and `exp_avg_sq_scale` (fp32, one per
    block). Not supported: amsgrad, sparse and complex gradients, capturable/CUDA graphs.

    On fake tensors (FakeTensorMode) a step makes the state, as the kernels would find it,
    and moves no data; the device tables a real fused step keeps
    (adamw_triton.bucket_table_shapes) are left to the caller that runs it shapes-only.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: str = "fp32",
        decoupled_weight_decay: bool = True,
        maximize: bool = False,
        backend: str = "auto",
        seed: int = 0,
    ) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, not {state_dtype!r}")
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', not {backend!r}")
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError("backend='triton' needs triton installed")
        if not 0.0 <= float(lr):
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize)
        self.state_dtype = state_dtype
        self.backend = backend
        self.seed = int(seed)
        self._buckets: dict[tuple, list[Bucket]] = {}
        self._salts: dict[int, int] = {}
        super().__init__(params, defaults)

    # -- bookkeeping ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._salts.setdefault(id(p), len(self._salts))
        self._buckets = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts floating state to the parameter's dtype: undo it.
        for p, state in self.state.items():
            self._fix_state_dtypes(p, state)
        self._buckets = {}

    def _fix_state_dtypes(self, p: torch.Tensor, state: dict) -> None:
        want = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
                "int8": (torch.int8, torch.uint8)}[self.state_dtype]
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), want):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state[key] = value.to(dtype).contiguous()
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
                state[key] = value.float()
        step = state.get("step")
        if isinstance(step, torch.Tensor) and (step.device.type != "cpu" or step.dtype != torch.float32):
            state["step"] = step.detach().to("cpu", torch.float32)

    def _use_triton(self, p: torch.Tensor) -> bool:
        if self.backend == "torch" or not HAVE_TRITON:
            return False
        if p.device.type != "cuda" and not (INTERPRET and self.backend == "triton"):
            return False
        return p.dtype in DTYPE_CODE and p.is_contiguous()

    def init_state(self, p: torch.Tensor) -> dict:
        """The parameter's state, made (zeros, step 0) if it has none yet."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if self.state_dtype == "int8":
                nb = -(-p.numel() // QBLOCK)
                state["exp_avg"] = torch.zeros(p.shape, dtype=torch.int8, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                state["exp_avg_scale"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
                state["exp_avg_sq_scale"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            else:
                dtype = torch.float32 if self.state_dtype == "fp32" else torch.bfloat16
                state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    def _salt(self, p: torch.Tensor) -> int:
        return self._salts.setdefault(id(p), len(self._salts))

    @staticmethod
    def _check_grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("FusedAdamW does not support sparse gradients")
        if torch.is_complex(p):
            raise RuntimeError("FusedAdamW does not support complex parameters")
        return g if g.is_contiguous() else g.contiguous()

    # -- stepping ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params and is_fake(params[0]):      # shapes only: make the state, move no data
                for p in params:
                    self.init_state(p)
            elif params:
                self._step_group(index, group, params)
        return loss

    def _step_group(self, index: int, group: dict, params: list[torch.Tensor]) -> None:
        fast = [p for p in params if self._use_triton(p)]
        for p in params:
            if not self._use_triton(p):
                self._update_one(p, group)
        if not fast:
            return
        key = (index, tuple(id(p) for p in fast), tuple(p.data_ptr() for p in fast))
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = self._make_buckets(fast)
        for bucket in buckets:
            grads = [self._check_grad(p) for p in bucket.params]
            if any(g.dtype != grads[0].dtype or g.dtype not in DTYPE_CODE for g in grads):
                for p in bucket.params:      # odd gradient dtypes: one tensor at a time
                    self._update_one(p, group)
                bucket.step += 1
                continue
            bucket.set_grads(grads)
            bucket.step += 1
            torch._foreach_add_(bucket.steps, 1.0)
            h = Hyper(group, bucket.step, self.seed)
            bucket.launch(h, h.decoupled, h.maximize)

    def device_tables(self) -> dict[str, torch.Tensor]:
        """The tables of pointers and chunks the fused steps keep on the device, by name:
        memdoctor's tracer counts them as optimizer state."""
        pairs = [(b.table, b.chunks) for buckets in self._buckets.values() for b in buckets]
        out = {}
        for i, (table, chunks) in enumerate(pairs):
            out[f"FusedAdamW bucket {i}: table"] = table
            out[f"FusedAdamW bucket {i}: chunks"] = chunks
        return out

    def _make_buckets(self, params: list[torch.Tensor]) -> list[Bucket]:
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            state = self.init_state(p)
            by_key.setdefault((p.device, p.dtype, int(state["step"].item())), []).append(p)
        return [
            Bucket(ps, [self.state[p] for p in ps], [self._salt(p) for p in ps], self.state_dtype)
            for ps in by_key.values()
        ]

    @torch.no_grad()
    def update_param(self, p: torch.Tensor, group: dict | None = None) -> None:
        """Step one parameter from its `.grad`, alone (the in-backward step)."""
        if is_fake(p):
            self.init_state(p)
            return
        self._update_one(p, self._group_of(p) if group is None else group)
        # a parameter stepped alone leaves the cached buckets' step counts behind
        if self._buckets:
            self._buckets = {}

    def _update_one(self, p: torch.Tensor, group: dict) -> None:
        state = self.init_state(p)
        g = self._check_grad(p)
        state["step"] += 1
        h = Hyper(group, int(state["step"].item()), self.seed)
        if self._use_triton(p) and g.dtype in DTYPE_CODE:
            launch_one(p, g, state, h, self.state_dtype, self._salt(p))
        else:
            reference_update(p, g, state, h, self.state_dtype, self._salt(p))

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    # -- moving state in and out --------------------------------------------------------
    @torch.no_grad()
    def fp32_state(self, p: torch.Tensor) -> dict | None:
        """The parameter's state as torch.optim.AdamW keeps it (fp32 exp_avg/exp_avg_sq,
        shaped like the parameter), or None before its first step."""
        state = self.state.get(p)
        if not state:
            return None
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.state_dtype == "int8":
            nb = state["exp_avg_scale"].numel()
            n = p.numel()
            m = dequant_m(pad_blocks(m.view(-1), nb), state["exp_avg_scale"]).view(-1)[:n].view(p.shape)
            v = dequant_v(pad_blocks(v.view(-1), nb), state["exp_avg_sq_scale"]).view(-1)[:n].view(p.shape)
        else:
            m, v = m.float().clone(), v.float().clone()
        return {"step": state["step"].clone(), "exp_avg": m, "exp_avg_sq": v}

    @torch.no_grad()
    def load_fp32_state(self, p: torch.Tensor, step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Take over a parameter's AdamW state (quantized to this optimizer's state dtype)."""
        self.state.pop(p, None)
        state = self.init_state(p)
        state["step"].fill_(float(step))
        m = exp_avg.detach().to(p.device, torch.float32).reshape(-1)
        v = exp_avg_sq.detach().to(p.device, torch.float32).reshape(-1)
        if self.state_dtype == "int8":
            nb = state["exp_avg_scale"].numel()
            qm, sm = quant_m(pad_blocks(m, nb))
            qv, sv = quant_v(pad_blocks(v, nb))
            state["exp_avg"].view(-1).copy_(qm.view(-1)[: p.numel()])
            state["exp_avg_sq"].view(-1).copy_(qv.view(-1)[: p.numel()])
            state["exp_avg_scale"].copy_(sm)
            state["exp_avg_sq_scale"].copy_(sv)
        else:
            state["exp_avg"].view(-1).copy_(m)
            state["exp_avg_sq"].view(-1).copy_(v)
        self._buckets = {}
