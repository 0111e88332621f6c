"""The Triton kernels of the fused AdamW step, and their launches: a bucket of tensors in one
launch through device tables, or one tensor alone.

Tensors that share a dtype combination and a step count are one *bucket*. A bucket is
updated by one launch of `_adamw_multi_kernel` over a flat list of chunks (as apex's
`multi_tensor_apply`): program `i` reads chunk `i`'s tensor index and start offset from a
small device table, reads that tensor's pointers (parameter, gradient, states, scales),
numel and salt from a second table, and loops over its chunk. Nothing else is allocated:
the tables (a few int64 per tensor and two per chunk) are built once and kept while the
parameters and states stay where they are; only the gradients' row is re-sent when the
gradients move (`zero_grad(set_to_none=True)` frees them every step). Bias corrections are
computed on the host and passed as scalars. The math and the state codes are
memdoctor.cuda.kernels.adamw_math's.

With TRITON_INTERPRET=1 (set before this module is imported) the kernels also run on CPU
tensors, slowly: the tests use that.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from memdoctor.cuda.kernels.adamw_math import QBLOCK, Hyper, tensor_base

try:  # triton is optional: without it everything runs on the torch fallback
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "INTERPRET", "CONFIGS", "DTYPE_CODE", "Bucket", "bucket_table_shapes", "launch_one",
           "triton_usable"]

_STATE_CODE = {"fp32": 0, "bf16": 1, "int8": 2}
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_FAST_OK = True     # False once the vectorized variant failed to compile here
log = logging.getLogger("memdoctor")

# (BLOCK, CHUNK, num_warps) per state mode: BLOCK elements per loop iteration, CHUNK
# elements per program. Picked from benchmarks/fused_adamw.py's sweeps on an H200 (torch
# 2.11, triton 3.6): within a few % of the best at 124M and 355M parameters; the benchmark
# can override them.
CONFIGS: dict[str, tuple[int, int, int]] = {
    "fp32": (1024, 8192, 4),
    "bf16": (1024, 8192, 4),
    "int8": (1024, 8192, 4),
}
_INTERPRET_CONFIG = (4096, 4096, 1)   # few, large blocks: the interpreter pays per op


def triton_usable(device: torch.device | str) -> bool:
    """Whether the kernel can run on tensors of `device` (CUDA, or any with the interpreter)."""
    if not HAVE_TRITON:
        return False
    device = torch.device(device)
    return device.type == "cuda" or INTERPRET


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


def _scalars(h: Hyper) -> tuple:
    return (h.decay, h.l2, h.omb1, h.beta2, h.omb2, h.eps, h.step_size, h.bc2_sqrt)


class Bucket:
    """Tensors updated by one launch: same device, dtypes and step; tables kept on device."""

    def __init__(self, params: list[torch.Tensor], states: list[dict], salts: list[int], mode: str) -> None:
        self.params = params
        self.states = states
        self.steps = [s["step"] for s in states]
        self.step = int(states[0]["step"].item())
        self.mode = mode
        self.device = params[0].device
        self.p_code = DTYPE_CODE[params[0].dtype]
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
        self.g_code = DTYPE_CODE[grads[0].dtype]

    def launch(self, h: Hyper, decoupled: bool, maximize: bool) -> None:
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


def bucket_table_shapes(numels: list[int], mode: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of the two int64 tables a Bucket of tensors of `numels` elements keeps on
    the device: 8 rows a tensor (addresses, numel, salt) and 2 a chunk (tensor, start)."""
    chunk = CONFIGS[mode][1]
    return (8, len(numels)), (2, sum(-(-n // chunk) for n in numels))


def launch_one(p: torch.Tensor, g: torch.Tensor, state: dict, h: Hyper, mode: str, salt: int) -> None:
    """One tensor's update in one launch, its pointers as arguments (the in-backward step)."""
    block, chunk, warps = _config(mode)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    ms = state.get("exp_avg_scale", m)
    vs = state.get("exp_avg_sq_scale", v)
    n = p.numel()
    with torch.cuda.device(p.device) if p.device.type == "cuda" else contextlib.nullcontext():
        _adamw_one_kernel[(triton.cdiv(n, chunk),)](
            p, g, m, v, ms, vs, n, tensor_base(h.seed_step, salt), *_scalars(h),
            P_CODE=DTYPE_CODE[p.dtype], STATE=_STATE_CODE[mode], DECOUPLED=h.decoupled,
            MAXIMIZE=h.maximize,
            CHUNK=chunk, BLOCK=block, QB=QBLOCK, num_warps=warps,
        )

