"""A fused AdamW: one Triton kernel launch updates many tensors in place.

How it runs
-----------
Tensors that share a dtype combination and a step count are one *bucket*. A bucket is
updated by one launch of `_adamw_multi_kernel` over a flat list of chunks (as apex's
`multi_tensor_apply`): program `i` reads chunk `i`'s tensor index and start offset from a
small device table, reads that tensor's pointers (parameter, gradient, states, scales),
numel and salt from a second table, and loops over its chunk. Nothing else is allocated:
the tables (a few int64 per tensor and two per chunk) are built once and kept while the
parameters and states stay where they are; only the gradients' row is re-sent when the
gradients move (`zero_grad(set_to_none=True)` frees them every step). Bias corrections are
computed on the host and passed as scalars.

The math is torch.optim.AdamW's (decoupled weight decay, `decoupled_weight_decay=False`
gives Adam's L2 decay), computed in fp32 whatever the parameter dtype (fp32, bf16, fp16):

    p *= 1 - lr * wd
    m += (1 - beta1) * (g - m)
    v  = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

State storage (`state_dtype`)
-----------------------------
- "fp32": exp_avg and exp_avg_sq in fp32 (8 bytes a parameter).
- "bf16": both in bf16 (4 bytes a parameter), stored with *stochastic rounding*: the fp32
  value's bits plus 16 random bits, truncated to bf16, so the rounding is unbiased and small
  updates (beta2 = 0.999 moves v by 0.1% a step, below bf16's 0.4% resolution) are not
  lost. The random bits are a counter-based hash of (seed, step, tensor salt, element
  index): no RNG state, reproducible, and the same in the kernel and the torch fallback.
- "int8": blockwise 8-bit states as in bitsandbytes' 8-bit optimizers, 256 elements a
  block with one fp32 absmax scale per block and state (about 2.03 bytes a parameter). The
  code is *sqrt-companded* rather than bitsandbytes' dynamic tree code:
      exp_avg     (signed):   q = round(127 * sign(m) * sqrt(|m| / s_m)),  m = s_m * q|q| / 127^2
      exp_avg_sq  (unsigned): q = round(255 * (v / s_v) ** 0.25),          v = s_v * (q / 255)^4
  i.e. m and sqrt(v) each get a square-root code, which spends its levels near zero where
  Adam's states live: the smallest non-zero sqrt(v) a block can hold is 1.5e-5 of the
  block's largest (6e-5 for m), against 1/255 for a linear code. The update itself uses
  the fp32 values computed in the step; only what is stored is quantized.

Where it runs
-------------
On CUDA tensors with Triton installed, the kernel. Anywhere else (CPU, or no Triton) the
same math in plain torch ops, one tensor at a time and in chunks of 2**18 elements so that
its temporaries stay small; the 8-bit and bf16 codes are computed there with torch ops
too. `backend="triton"` forces the kernel, which with TRITON_INTERPRET=1 (set before this
module is imported) also runs on CPU tensors, slowly: the tests use that.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import is_fake

from memdoctor.predict.cpu_standin import standing_in_for_cuda

try:  # triton is optional: without it everything runs on the torch fallback
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["FusedAdamW", "STATE_DTYPES", "QBLOCK", "HAVE_TRITON", "triton_usable", "state_bytes"]

STATE_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = 256            # elements per quantization block (int8 states)
REF_CHUNK = 1 << 18     # elements per slice in the torch fallback (a multiple of QBLOCK)

_M32 = 0xFFFFFFFF
# Hash constants, all below 2**31 so that (x < 2**32) * C never overflows int64.
_H1, _H2 = 0x7FEB352D, 0x1B873593      # the finalizer's multipliers
_HE, _HS = 0x2C1B3C6D, 0x5BD1E995      # element index, tensor salt
_HSEED, _HSTEP = 0x27D4EB2F, 0x165667B1

_STATE_CODE = {"fp32": 0, "bf16": 1, "int8": 2}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_FAST_OK = True     # False once the vectorized variant failed to compile here
log = logging.getLogger("memdoctor")

# (BLOCK, CHUNK, num_warps) per state mode: BLOCK elements per loop iteration, CHUNK
# elements per program. Picked from benchmarks/fused_adamw.py's sweeps on an H200 (torch
# 2.11, triton 3.6): within a few % of the best at 124M and 355M parameters in the runs
# that were not disturbed by the timing noise of that benchmark's first version; the
# benchmark can override them.
CONFIGS: dict[str, tuple[int, int, int]] = {
    "fp32": (1024, 8192, 4),
    "bf16": (1024, 8192, 4),
    "int8": (1024, 8192, 4),
}
_INTERPRET_CONFIG = (4096, 4096, 1)   # few, large blocks: the interpreter pays per op


# ------------------------------------------------------------------------ host helpers

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


def triton_usable(device: torch.device | str) -> bool:
    """Whether the kernel can run on tensors of `device` (CUDA, or any with the interpreter)."""
    if not HAVE_TRITON:
        return False
    device = torch.device(device)
    return device.type == "cuda" or INTERPRET


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in optimizer.state (each storage counted once)."""
    seen: dict[Any, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[(storage.data_ptr(), value.device)] = storage.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------ torch fallback

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


def _tensor_base(seed_step: int, salt: int) -> int:
    return _mix32(seed_step ^ (((salt & _M32) * _HS) & _M32))


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


def _dequant_m(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [nb, QB] + scale [nb] -> fp32."""
    qf = q.float()
    return qf * qf.abs() * (scale * _INV127SQ)[:, None]


def _dequant_v(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t = q.float() * (1.0 / 255.0)
    t = t * t
    return t * t * scale[:, None]


def _quant_m(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [nb, QB] -> (int8 codes, fp32 absmax per block)."""
    scale = m.abs().amax(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(_FLT_MIN), torch.zeros_like(scale))
    y = (m.abs() * inv[:, None]).sqrt_().mul_(127.0).add_(0.5)
    return torch.copysign(y, m).to(torch.int8), scale      # the cast truncates toward 0


def _quant_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = v.amax(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(_FLT_MIN), torch.zeros_like(scale))
    y = (v * inv[:, None]).sqrt_().sqrt_().mul_(255.0).add_(0.5)
    return y.to(torch.uint8), scale


def _pad_blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """1-D -> [nb, QBLOCK], zero padded."""
    pad = nb * QBLOCK - x.numel()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(nb, QBLOCK)


class _Hyper:
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


def _reference_update(p: torch.Tensor, g: torch.Tensor, state: dict, h: _Hyper, mode: str, salt: int) -> None:
    """One tensor's update in torch ops, slice by slice (the kernel's twin).

    fp32 parameters with fp32 states run torch.optim.AdamW's exact op sequence, in place.
    """
    pf_all = p.view(-1)
    gf_all = g.reshape(-1)
    m_all = state["exp_avg"].view(-1)
    v_all = state["exp_avg_sq"].view(-1)
    n = pf_all.numel()
    tbase = _tensor_base(h.seed_step, salt) if mode == "bf16" else 0
    for a in range(0, n, REF_CHUNK):
        b = min(a + REF_CHUNK, n)
        pc, gc = pf_all[a:b], gf_all[a:b]
        if mode == "int8":
            nb = -(-(b - a) // QBLOCK)
            blocks = slice(a // QBLOCK, a // QBLOCK + nb)
            m = _dequant_m(_pad_blocks(m_all[a:b], nb), state["exp_avg_scale"][blocks])
            v = _dequant_v(_pad_blocks(v_all[a:b], nb), state["exp_avg_sq_scale"][blocks])
            pw = _pad_blocks(pc.float(), nb)
            gw = _pad_blocks(gc.float(), nb)
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
            qm, sm = _quant_m(m)
            qv, sv = _quant_v(v)
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


# ------------------------------------------------------------------------ Triton kernels

if HAVE_TRITON:

    @triton.jit
    def _mix32_k(h):
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h = h ^ (h >> 15)
        h = (h * 0x1B873593) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _sr_bf16_k(x, r16):
        """fp32 -> bf16 with stochastic rounding by 16 random bits (int64 in [0, 65536))."""
        bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
        finite = (bits & 0x7F800000) != 0x7F800000
        rounded = ((bits + r16) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(finite, rounded, x.to(tl.bfloat16))

    @triton.jit
    def _cast_param(p, CODE: tl.constexpr):
        """fp32 -> the parameter dtype, rounding to nearest even (with integer ops for bf16,
        so that the interpreter, which truncates, rounds as the GPU does)."""
        if CODE == 1:
            bits = p.to(tl.uint32, bitcast=True).to(tl.int64)
            out = _sr_bf16_k(p, 0x7FFF + ((bits >> 16) & 1))
        elif CODE == 2:
            out = p.to(tl.float16)
        else:
            out = p
        return out

    @triton.jit
    def _as_ptr(addr, CODE: tl.constexpr):
        if CODE == 1:
            ptr = addr.to(tl.pointer_type(tl.bfloat16))
        elif CODE == 2:
            ptr = addr.to(tl.pointer_type(tl.float16))
        else:
            ptr = addr.to(tl.pointer_type(tl.float32))
        return ptr

    @triton.jit
    def _adam_math(p, g, m, v, lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                   DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr):
        if MAXIMIZE:
            g = -g
        if DECOUPLED:
            p = p * lr_decay
        else:
            g = g + l2 * p
        m = m + omb1 * (g - m)
        v = v * beta2 + omb2 * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        return p, m, v

    @triton.jit
    def _ld(ptrs, mask, MASKED: tl.constexpr):
        if MASKED:
            x = tl.load(ptrs, mask=mask, other=0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _st(ptrs, value, mask, MASKED: tl.constexpr):
        if MASKED:
            tl.store(ptrs, value, mask=mask)
        else:
            tl.store(ptrs, value)

    @triton.jit
    def _update_1d(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, tbase,
                   lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                   P_CODE: tl.constexpr, STATE: tl.constexpr, DECOUPLED: tl.constexpr,
                   MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
        p = _ld(p_ptr + offs, mask, MASKED).to(tl.float32)
        g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
        m = _ld(m_ptr + offs, mask, MASKED).to(tl.float32)
        v = _ld(v_ptr + offs, mask, MASKED).to(tl.float32)
        p, m, v = _adam_math(p, g, m, v, lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                             DECOUPLED, MAXIMIZE)
        _st(p_ptr + offs, _cast_param(p, P_CODE), mask, MASKED)
        if STATE == 1:
            r = _mix32_k(((offs & 0xFFFFFFFF) * 0x2C1B3C6D + tbase) & 0xFFFFFFFF)
            _st(m_ptr + offs, _sr_bf16_k(m, r & 0xFFFF), mask, MASKED)
            _st(v_ptr + offs, _sr_bf16_k(v, r >> 16), mask, MASKED)
        else:
            _st(m_ptr + offs, m, mask, MASKED)
            _st(v_ptr + offs, v, mask, MASKED)

    @triton.jit
    def _update_q8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, base, n,
                   lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                   P_CODE: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                   NB: tl.constexpr, QB: tl.constexpr, MASKED: tl.constexpr):
        rows = tl.arange(0, NB)
        offs = base + rows[:, None] * QB + tl.arange(0, QB)[None, :]
        mask = offs < n
        blk = base // QB + rows
        bmask = blk * QB < n
        sm = _ld(ms_ptr + blk, bmask, MASKED)
        sv = _ld(vs_ptr + blk, bmask, MASKED)
        qm = _ld(m_ptr + offs, mask, MASKED).to(tl.float32)
        qv = _ld(v_ptr + offs, mask, MASKED).to(tl.float32)
        p = _ld(p_ptr + offs, mask, MASKED).to(tl.float32)
        g = _ld(g_ptr + offs, mask, MASKED).to(tl.float32)
        m = qm * tl.abs(qm) * (sm * (1.0 / 16129.0))[:, None]
        t = qv * (1.0 / 255.0)
        t = t * t
        v = t * t * sv[:, None]
        p, m, v = _adam_math(p, g, m, v, lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                             DECOUPLED, MAXIMIZE)
        _st(p_ptr + offs, _cast_param(p, P_CODE), mask, MASKED)
        am = tl.abs(m)
        nsm = tl.max(am, axis=1)
        nsv = tl.max(v, axis=1)
        im = tl.where(nsm > 0, 1.0 / tl.maximum(nsm, 1.1754943508222875e-38), 0.0)
        iv = tl.where(nsv > 0, 1.0 / tl.maximum(nsv, 1.1754943508222875e-38), 0.0)
        ym = tl.sqrt(am * im[:, None]) * 127.0 + 0.5
        qm_new = tl.where(m < 0, -ym, ym).to(tl.int32)      # truncation: round half away from 0
        yv = tl.sqrt(tl.sqrt(v * iv[:, None])) * 255.0 + 0.5
        qv_new = yv.to(tl.int32)
        _st(m_ptr + offs, qm_new.to(tl.int8), mask, MASKED)
        _st(v_ptr + offs, qv_new.to(tl.uint8), mask, MASKED)
        _st(ms_ptr + blk, nsm, bmask, MASKED)
        _st(vs_ptr + blk, nsv, bmask, MASKED)

    @triton.jit
    def _adamw_multi_kernel(table, N, chunks, C, seed_step,
                            lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                            P_CODE: tl.constexpr, G_CODE: tl.constexpr, STATE: tl.constexpr,
                            DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                            CHUNK: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr,
                            FAST: tl.constexpr):
        """One program per chunk. table: int64 [8, N] = rows of addresses of parameters,
        gradients, exp_avg, exp_avg_sq, their two scales (int8), then numel and salt.
        chunks: int64 [2, C] = tensor index and start offset of each chunk.

        FAST (every address 16-byte aligned, checked on the host): the chunk's whole
        blocks run without masks and with alignment hints, so that loads and stores are
        vectorized; only a tensor's last, partial block is masked. Without FAST every
        block is masked (the compiler cannot see that table addresses are aligned)."""
        pid = tl.program_id(0)
        t = tl.load(chunks + pid)
        start = tl.load(chunks + C + pid)
        p_ptr = _as_ptr(tl.load(table + t), P_CODE)
        g_ptr = _as_ptr(tl.load(table + N + t), G_CODE)
        n = tl.load(table + 6 * N + t)
        end = tl.minimum(n - start, CHUNK)
        if STATE == 2:
            m_ptr = tl.load(table + 2 * N + t).to(tl.pointer_type(tl.int8))
            v_ptr = tl.load(table + 3 * N + t).to(tl.pointer_type(tl.uint8))
            ms_ptr = tl.load(table + 4 * N + t).to(tl.pointer_type(tl.float32))
            vs_ptr = tl.load(table + 5 * N + t).to(tl.pointer_type(tl.float32))
        elif STATE == 1:
            m_ptr = tl.load(table + 2 * N + t).to(tl.pointer_type(tl.bfloat16))
            v_ptr = tl.load(table + 3 * N + t).to(tl.pointer_type(tl.bfloat16))
            ms_ptr = m_ptr
            vs_ptr = v_ptr
        else:
            m_ptr = tl.load(table + 2 * N + t).to(tl.pointer_type(tl.float32))
            v_ptr = tl.load(table + 3 * N + t).to(tl.pointer_type(tl.float32))
            ms_ptr = m_ptr
            vs_ptr = v_ptr
        salt = tl.load(table + 7 * N + t)
        tbase = _mix32_k(seed_step ^ ((salt & 0xFFFFFFFF) * 0x5BD1E995 & 0xFFFFFFFF))
        if FAST:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            ms_ptr = tl.multiple_of(ms_ptr, 16)
            vs_ptr = tl.multiple_of(vs_ptr, 16)
            whole = end // BLOCK
            for j in range(0, whole):
                base = tl.multiple_of(start + j * BLOCK, BLOCK)
                if STATE == 2:
                    _update_q8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, base, n,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, DECOUPLED, MAXIMIZE, BLOCK // QB, QB, False)
                else:
                    offs = base + tl.arange(0, BLOCK)
                    _update_1d(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, tbase,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, STATE, DECOUPLED, MAXIMIZE, False)
            if whole * BLOCK < end:
                base = start + whole * BLOCK
                if STATE == 2:
                    _update_q8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, base, n,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, DECOUPLED, MAXIMIZE, BLOCK // QB, QB, True)
                else:
                    offs = base + tl.arange(0, BLOCK)
                    _update_1d(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, tbase,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, STATE, DECOUPLED, MAXIMIZE, True)
        else:
            for i in range(0, end, BLOCK):
                if STATE == 2:
                    _update_q8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, start + i, n,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, DECOUPLED, MAXIMIZE, BLOCK // QB, QB, True)
                else:
                    offs = start + i + tl.arange(0, BLOCK)
                    _update_1d(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, tbase,
                               lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                               P_CODE, STATE, DECOUPLED, MAXIMIZE, True)

    @triton.jit
    def _adamw_one_kernel(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, n, tbase,
                          lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                          P_CODE: tl.constexpr, STATE: tl.constexpr, DECOUPLED: tl.constexpr,
                          MAXIMIZE: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr):
        """One tensor, pointers as arguments (no tables): the in-backward step."""
        start = tl.program_id(0).to(tl.int64) * CHUNK
        end = tl.minimum(n - start, CHUNK)
        if STATE == 2:
            for i in range(0, end, BLOCK):
                _update_q8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, start + i, n,
                           lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                           P_CODE, DECOUPLED, MAXIMIZE, BLOCK // QB, QB, True)
        else:
            for i in range(0, end, BLOCK):
                offs = start + i + tl.arange(0, BLOCK)
                _update_1d(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, tbase,
                           lr_decay, l2, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
                           P_CODE, STATE, DECOUPLED, MAXIMIZE, True)


def _config(mode: str) -> tuple[int, int, int]:
    return _INTERPRET_CONFIG if INTERPRET else CONFIGS[mode]


def _scalars(h: _Hyper) -> tuple:
    return (h.decay, h.l2, h.omb1, h.beta2, h.omb2, h.eps, h.step_size, h.bc2_sqrt)


class _Bucket:
    """Tensors updated by one launch: same device, dtypes and step; tables kept on device."""

    def __init__(self, params: list[torch.Tensor], states: list[dict], salts: list[int], mode: str) -> None:
        self.params = params
        self.states = states
        self.steps = [s["step"] for s in states]
        self.step = int(states[0]["step"].item())
        self.mode = mode
        self.device = params[0].device
        self.p_code = _DTYPE_CODE[params[0].dtype]
        self.g_code = self.p_code
        block, chunk, _ = _config(mode)
        n = len(params)
        numels = [p.numel() for p in params]
        rows = [
            [p.data_ptr() for p in params],
            [0] * n,
            [s["exp_avg"].data_ptr() for s in states],
            [s["exp_avg_sq"].data_ptr() for s in states],
            [s["exp_avg_scale"].data_ptr() if mode == "int8" else 0 for s in states],
            [s["exp_avg_sq_scale"].data_ptr() if mode == "int8" else 0 for s in states],
            numels,
            salts,
        ]
        host = torch.tensor(rows, dtype=torch.int64)
        counts = torch.tensor([-(-k // chunk) for k in numels], dtype=torch.int64)
        index = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), counts)
        first = torch.cumsum(counts, 0) - counts
        starts = (torch.arange(index.numel(), dtype=torch.int64) - first[index]) * chunk
        self.table = host.to(self.device)
        self.chunks = torch.stack([index, starts]).to(self.device)
        self.n = n
        self.c = index.numel()
        self.grad_ptrs: list[int] | None = None
        self.aligned = all(a % 16 == 0 for row in rows[:6] for a in row)
        self.grads_aligned = False

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        ptrs = [g.data_ptr() for g in grads]
        if ptrs != self.grad_ptrs:
            row = torch.tensor(ptrs, dtype=torch.int64)
            if self.device.type == "cuda":
                row = row.pin_memory()
            self.table[1].copy_(row, non_blocking=True)
            self.grad_ptrs = ptrs
            self.grads_aligned = all(a % 16 == 0 for a in ptrs)
        self.g_code = _DTYPE_CODE[grads[0].dtype]

    def launch(self, h: _Hyper, decoupled: bool, maximize: bool) -> None:
        global _FAST_OK
        block, chunk, warps = _config(self.mode)
        fast = _FAST_OK and self.aligned and self.grads_aligned
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            while True:
                try:
                    _adamw_multi_kernel[(self.c,)](
                        self.table, self.n, self.chunks, self.c, h.seed_step, *_scalars(h),
                        P_CODE=self.p_code, G_CODE=self.g_code, STATE=_STATE_CODE[self.mode],
                        DECOUPLED=decoupled, MAXIMIZE=maximize, CHUNK=chunk, BLOCK=block, QB=QBLOCK,
                        FAST=fast, num_warps=warps,
                    )
                    return
                except Exception as exc:   # a compiler that rejects the hints: plain masked blocks
                    if not fast:
                        raise
                    _FAST_OK = fast = False
                    log.warning("memdoctor: FusedAdamW's vectorized kernel did not compile (%s); "
                                "using the masked one", exc)


def _launch_one(p: torch.Tensor, g: torch.Tensor, state: dict, h: _Hyper, mode: str, salt: int) -> None:
    block, chunk, warps = _config(mode)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    ms = state.get("exp_avg_scale", m)
    vs = state.get("exp_avg_sq_scale", v)
    n = p.numel()
    with torch.cuda.device(p.device) if p.device.type == "cuda" else contextlib.nullcontext():
        _adamw_one_kernel[(triton.cdiv(n, chunk),)](
            p, g, m, v, ms, vs, n, _tensor_base(h.seed_step, salt), *_scalars(h),
            P_CODE=_DTYPE_CODE[p.dtype], STATE=_STATE_CODE[mode], DECOUPLED=h.decoupled,
            MAXIMIZE=h.maximize,
            CHUNK=chunk, BLOCK=block, QB=QBLOCK, num_warps=warps,
        )


# ------------------------------------------------------------------------ the optimizer

def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (memdoctor.predict.estimate's shapes-only run): the step then only makes the
    state, exactly as the kernels would find it, and the device tables a real step keeps
    (FusedAdamW._fake_tables), and moves no data. The kernels allocate nothing else, so
    the estimate sees all the memory a real step uses."""
    return is_fake(t)


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
        self._buckets: dict[tuple, list[_Bucket]] = {}
        self._fake_buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
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
        return p.dtype in _DTYPE_CODE and p.is_contiguous()

    def _init_state(self, p: torch.Tensor) -> dict:
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
            if params and _is_fake(params[0]):
                for p in params:
                    self._init_state(p)
                self._fake_tables(index, params)
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
            if any(g.dtype != grads[0].dtype or g.dtype not in _DTYPE_CODE for g in grads):
                for p in bucket.params:      # odd gradient dtypes: one tensor at a time
                    self._update_one(p, group)
                bucket.step += 1
                continue
            bucket.set_grads(grads)
            bucket.step += 1
            torch._foreach_add_(bucket.steps, 1.0)
            h = _Hyper(group, bucket.step, self.seed)
            bucket.launch(h, h.decoupled, h.maximize)

    def _fake_tables(self, index: int, params: list[torch.Tensor]) -> None:
        """Make, once per bucket as _Bucket does, the device tables a real step keeps: 8
        int64 rows a tensor and 2 a chunk. They live as long as the optimizer, in a large
        segment's block, so the estimate must hold them too: on the H200, Llama 1B's 146
        tensors took 9,344 and 2,414,096 bytes there, and without them a plan that fitted
        two steps ran out of memory in the third (benchmarks/results/gpu/README.md, pass 27).
        A fake tensor on a CPU-only torch stands for a CUDA one, which would take the kernel."""
        on_gpu = [p for p in params if self.backend != "torch" and p.dtype in _DTYPE_CODE and p.is_contiguous()
                  and (p.device.type == "cuda" or standing_in_for_cuda())]
        key = (index, tuple(id(p) for p in on_gpu))
        if not on_gpu or key in self._fake_buckets:
            return
        chunk = CONFIGS[self.state_dtype][1]
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for p in on_gpu:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        self._fake_buckets[key] = [
            (torch.empty((8, len(ps)), dtype=torch.int64, device=ps[0].device),
             torch.empty((2, sum(-(-p.numel() // chunk) for p in ps)), dtype=torch.int64, device=ps[0].device))
            for ps in by_key.values()
        ]

    def device_tables(self) -> dict[str, torch.Tensor]:
        """The tables of pointers and chunks the fused steps keep on the device, by name:
        memdoctor's tracer counts them as optimizer state."""
        pairs = [(b.table, b.chunks) for buckets in self._buckets.values() for b in buckets]
        pairs += [pair for tables in self._fake_buckets.values() for pair in tables]
        out = {}
        for i, (table, chunks) in enumerate(pairs):
            out[f"FusedAdamW bucket {i}: table"] = table
            out[f"FusedAdamW bucket {i}: chunks"] = chunks
        return out

    def _make_buckets(self, params: list[torch.Tensor]) -> list[_Bucket]:
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            state = self._init_state(p)
            by_key.setdefault((p.device, p.dtype, int(state["step"].item())), []).append(p)
        return [
            _Bucket(ps, [self.state[p] for p in ps], [self._salt(p) for p in ps], self.state_dtype)
            for ps in by_key.values()
        ]

    @torch.no_grad()
    def update_param(self, p: torch.Tensor, group: dict | None = None) -> None:
        """Step one parameter from its `.grad`, alone (the in-backward step)."""
        if _is_fake(p):
            self._init_state(p)
            return
        self._update_one(p, self._group_of(p) if group is None else group)
        # a parameter stepped alone leaves the cached buckets' step counts behind
        if self._buckets:
            self._buckets = {}

    def _update_one(self, p: torch.Tensor, group: dict) -> None:
        state = self._init_state(p)
        g = self._check_grad(p)
        state["step"] += 1
        h = _Hyper(group, int(state["step"].item()), self.seed)
        if self._use_triton(p) and g.dtype in _DTYPE_CODE:
            _launch_one(p, g, state, h, self.state_dtype, self._salt(p))
        else:
            _reference_update(p, g, state, h, self.state_dtype, self._salt(p))

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
            m = _dequant_m(_pad_blocks(m.view(-1), nb), state["exp_avg_scale"]).view(-1)[:n].view(p.shape)
            v = _dequant_v(_pad_blocks(v.view(-1), nb), state["exp_avg_sq_scale"]).view(-1)[:n].view(p.shape)
        else:
            m, v = m.float().clone(), v.float().clone()
        return {"step": state["step"].clone(), "exp_avg": m, "exp_avg_sq": v}

    @torch.no_grad()
    def load_fp32_state(self, p: torch.Tensor, step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Take over a parameter's AdamW state (quantized to this optimizer's state dtype)."""
        self.state.pop(p, None)
        state = self._init_state(p)
        state["step"].fill_(float(step))
        m = exp_avg.detach().to(p.device, torch.float32).reshape(-1)
        v = exp_avg_sq.detach().to(p.device, torch.float32).reshape(-1)
        if self.state_dtype == "int8":
            nb = state["exp_avg_scale"].numel()
            qm, sm = _quant_m(_pad_blocks(m, nb))
            qv, sv = _quant_v(_pad_blocks(v, nb))
            state["exp_avg"].view(-1).copy_(qm.view(-1)[: p.numel()])
            state["exp_avg_sq"].view(-1).copy_(qv.view(-1)[: p.numel()])
            state["exp_avg_scale"].copy_(sm)
            state["exp_avg_sq_scale"].copy_(sv)
        else:
            state["exp_avg"].view(-1).copy_(m)
            state["exp_avg_sq"].view(-1).copy_(v)
        self._buckets = {}
