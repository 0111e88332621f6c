"""AdamW's update in plain torch ops, and the formats its states are stored in: the Triton
kernels' twin (memdoctor.cuda.kernels.adamw_triton), and the step wherever they cannot run.

State storage (`state_dtype`)
-----------------------------
- "fp32": exp_avg and exp_avg_sq in fp32 (8 bytes a parameter).
- "bf16": both in bf16 (4 bytes a parameter), stored with *stochastic rounding*: the fp32
  value's bits plus 16 random bits, truncated to bf16, so the rounding is unbiased and small
  updates (beta2 = 0.999 moves v by 0.1% a step, below bf16's 0.4% resolution) are not
  lost. The random bits are a counter-based hash of (seed, step, tensor salt, element
  index): no RNG state, reproducible, and the same in the kernel and here.
- "int8": blockwise 8-bit states as in bitsandbytes' 8-bit optimizers, 256 elements a
  block with one fp32 absmax scale per block and state (2 + 8/256 = 2.03125 bytes a
  parameter). The code is *sqrt-companded* rather than bitsandbytes' dynamic tree code:
      exp_avg     (signed):   q = round(127 * sign(m) * sqrt(|m| / s_m)),  m = s_m * q|q| / 127^2
      exp_avg_sq  (unsigned): q = round(255 * (v / s_v) ** 0.25),          v = s_v * (q / 255)^4
  i.e. m and sqrt(v) each get a square-root code, which spends its levels near zero where
  Adam's states live: the smallest non-zero sqrt(v) a block can hold is 1.5e-5 of the
  block's largest (6e-5 for m), against 1/255 for a linear code. The update itself uses
  the fp32 values computed in the step; only what is stored is quantized.

Here the update runs one tensor at a time, in slices of 2**18 elements so that its
temporaries stay small.
"""
from __future__ import annotations

import torch

__all__ = ["STATE_DTYPES", "QBLOCK", "state_bytes_per_param", "Hyper", "reference_update", "tensor_base",
           "dequant_m", "dequant_v", "quant_m", "quant_v", "pad_blocks"]

STATE_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = 256            # elements per quantization block (int8 states)
REF_CHUNK = 1 << 18     # elements per slice in the torch fallback (a multiple of QBLOCK)


_M32 = 0xFFFFFFFF
# Hash constants, all below 2**31 so that (x < 2**32) * C never overflows int64.
_H1, _H2 = 0x7FEB352D, 0x1B873593      # the finalizer's multipliers
_HE, _HS = 0x2C1B3C6D, 0x5BD1E995      # element index, tensor salt
_HSEED, _HSTEP = 0x27D4EB2F, 0x165667B1


def state_bytes_per_param(state_dtype: str) -> float:
    """The bytes of a parameter's two moments in `state_dtype`: 8 (fp32), 4 (bf16), or the
    8-bit codes plus two fp32 scales a QBLOCK (int8)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, not {state_dtype!r}")
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4.0 / QBLOCK}[state_dtype]


# ------------------------------------------------------------------------ the counter hash

def _mix32(h: int) -> int:
    """The 32-bit finalizer of the counter hash, on Python ints (the kernel's twin)."""
    h ^= h >> 16
    h = (h * _H1) & _M32
    h ^= h >> 15
    h = (h * _H2) & _M32
    h ^= h >> 16
    return h


def _seed_step(seed: int, step: int) -> int:
    return _mix32(((seed & _M32) * _HSEED + (step & _M32) * _HSTEP) & _M32)


def _mix32_t(h: torch.Tensor) -> torch.Tensor:
    """The finalizer on an int64 tensor holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _H1) & _M32
    h = h ^ (h >> 15)
    h = (h * _H2) & _M32
    return h ^ (h >> 16)


def _random_bits(start: int, stop: int, tbase: int, device) -> torch.Tensor:
    """32 random bits for elements start..stop-1 of a tensor (int64 tensor)."""
    offs = torch.arange(start, stop, dtype=torch.int64, device=device)
    return _mix32_t(((offs & _M32) * _HE + tbase) & _M32)


def tensor_base(seed_step: int, salt: int) -> int:
    """The hash's start for one tensor in one step: its elements' random bits follow from it."""
    return _mix32(seed_step ^ (((salt & _M32) * _HS) & _M32))


# ------------------------------------------------------------------------ state codes

def _round_bf16(x: torch.Tensor, r16: torch.Tensor | None) -> torch.Tensor:
    """fp32 -> bf16: stochastic with 16 random bits `r16` (int32), to nearest without.

    On the int32 view: adding r16 and shifting right by 16 keeps the same top 16 bits as
    the unsigned sum would, for negative values too; only NaN patterns can wrap, and
    non-finite values are rounded plainly.
    """
    if r16 is None:
        return x.to(torch.bfloat16)
    y = ((x.view(torch.int32) + r16) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(x), y, x.to(torch.bfloat16))


_INV127SQ = 1.0 / (127.0 * 127.0)
_FLT_MIN = 1.1754943508222875e-38


def dequant_m(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [nb, QB] + scale [nb] -> fp32."""
    qf = q.float()
    return qf * qf.abs() * (scale * _INV127SQ)[:, None]


def dequant_v(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = q.float() * (1.0 / 255.0)
    t = t * t
    return t * t * scale[:, None]


def quant_m(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [nb, QB] -> (int8 codes, fp32 absmax per block)."""
    scale = m.abs().amax(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(_FLT_MIN), torch.zeros_like(scale))
    y = (m.abs() * inv[:, None]).sqrt_().mul_(127.0).add_(0.5)
    return torch.copysign(y, m).to(torch.int8), scale      # the cast truncates toward 0


def quant_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = v.amax(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(_FLT_MIN), torch.zeros_like(scale))
    y = (v * inv[:, None]).sqrt_().sqrt_().mul_(255.0).add_(0.5)
    return y.to(torch.uint8), scale


def pad_blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """1-D -> [nb, QBLOCK], zero padded."""
    pad = nb * QBLOCK - x.numel()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(nb, QBLOCK)


# ------------------------------------------------------------------------ the update

class Hyper:
    """One step's scalars for one bucket, computed on the host."""

    __slots__ = ("lr", "wd", "beta1", "beta2", "eps", "step", "decoupled", "maximize",
                 "step_size", "bc2_sqrt", "decay", "l2", "omb1", "omb2", "seed_step")

    def __init__(self, group: dict, step: int, seed: int) -> None:
        self.lr = float(group["lr"])
        self.wd = float(group["weight_decay"])
        beta1, beta2 = group["betas"]
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.eps = float(group["eps"])
        self.decoupled = bool(group.get("decoupled_weight_decay", True))
        self.maximize = bool(group.get("maximize", False))
        self.step = step
        self.step_size = self.lr / (1 - self.beta1 ** step)
        self.bc2_sqrt = (1 - self.beta2 ** step) ** 0.5
        self.decay = 1 - self.lr * self.wd if self.decoupled else 1.0
        self.l2 = 0.0 if self.decoupled else self.wd
        self.omb1 = 1 - self.beta1
        self.omb2 = 1 - self.beta2
        self.seed_step = _seed_step(seed, step)


def reference_update(p: torch.Tensor, g: torch.Tensor, state: dict, h: Hyper, mode: str, salt: int) -> None:
    """One tensor's update in torch ops, slice by slice (the kernel's twin).

    fp32 parameters with fp32 states run torch.optim.AdamW's exact op sequence, in place.
    """
    pf_all = p.view(-1)
    gf_all = g.reshape(-1)
    m_all = state["exp_avg"].view(-1)
    v_all = state["exp_avg_sq"].view(-1)
    n = pf_all.numel()
    tbase = tensor_base(h.seed_step, salt) if mode == "bf16" else 0
    for a in range(0, n, REF_CHUNK):
        b = min(a + REF_CHUNK, n)
        pc, gc = pf_all[a:b], gf_all[a:b]
        if mode == "int8":
            nb = -(-(b - a) // QBLOCK)
            blocks = slice(a // QBLOCK, a // QBLOCK + nb)
            m = dequant_m(pad_blocks(m_all[a:b], nb), state["exp_avg_scale"][blocks])
            v = dequant_v(pad_blocks(v_all[a:b], nb), state["exp_avg_sq_scale"][blocks])
            pw = pad_blocks(pc.float(), nb)
            gw = pad_blocks(gc.float(), nb)
        else:
            m, v = m_all[a:b], v_all[a:b]
            if mode == "bf16":
                m, v = m.float(), v.float()
            pw = pc if pc.dtype == torch.float32 else pc.float()
            gw = gc if gc.dtype == torch.float32 else gc.float()
        if h.maximize:
            gw = -gw
        if h.wd != 0:
            if h.decoupled:
                pw.mul_(h.decay)
            else:
                gw = gw.add(pw, alpha=h.l2)
        m.lerp_(gw, h.omb1)
        v.mul_(h.beta2).addcmul_(gw, gw, value=h.omb2)
        denom = (v.sqrt() / h.bc2_sqrt).add_(h.eps)
        pw.addcdiv_(m, denom, value=-h.step_size)
        del denom
        if mode == "int8":
            qm, sm = quant_m(m)
            qv, sv = quant_v(v)
            m_all[a:b].copy_(qm.view(-1)[: b - a])
            v_all[a:b].copy_(qv.view(-1)[: b - a])
            state["exp_avg_scale"][blocks].copy_(sm)
            state["exp_avg_sq_scale"][blocks].copy_(sv)
            pc.copy_(pw.view(-1)[: b - a])
        else:
            if mode == "bf16":
                r = _random_bits(a, b, tbase, p.device)
                m_all[a:b].copy_(_round_bf16(m, (r & 0xFFFF).to(torch.int32)))
                v_all[a:b].copy_(_round_bf16(v, (r >> 16).to(torch.int32)))
                del r
            if pw is not pc:
                pc.copy_(pw)
