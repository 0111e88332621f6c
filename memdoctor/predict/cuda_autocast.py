"""CUDA autocast's casting rules on a CPU-only torch, for fake CPU tensors standing in for CUDA
ones: the CPU's own autocast casts other ops than CUDA's does, and what an op casts, and to
what, is memory (a bf16 copy of its input, or an fp32 output twice the size).

CUDA autocast (aten/src/ATen/autocast_mode.h and autocast_mode.cpp, the AutocastCUDA
registrations) runs matmuls and convolutions in the lower precision, a list of ops in fp32
(pow, exp, rsqrt, layer_norm, group_norm, upsampling, the losses), softmax, log_softmax, sum,
cumsum, prod and the vector/matrix norms with an fp32 output dtype when none is given, a few
ops in the widest input dtype, refuses binary_cross_entropy, and lets every other op run in
its inputs' dtype. CPU autocast has other lists: no fp32 for layer_norm, softmax or pow; fp32
for cross_entropy_loss (so logits are cast before log_softmax), the 3-d pools and pads;
cat/stack promoted by copying. `cuda_autocast()` registers, while it is active, CUDA's policy
as the AutocastCPU kernel of every op in CUDA's lists that this torch's CUDA autocast
registers, and a fallthrough for the ops only CPU autocast lists. Casts of fp32 leaf tensors
that require grad (the parameters) to the lower precision are cached until the outermost
autocast region exits, as CUDA autocast caches them.

The registrations are process-wide while active: CPU autocast in another thread of the same
process casts the CUDA way meanwhile.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

__all__ = ["cuda_autocast", "LOWER_PRECISION", "FP32", "FP32_SET_OPT_DTYPE", "FP32_APPEND_DTYPE", "PROMOTE",
           "BANNED", "policy_of"]

aten = torch.ops.aten
_KEY = "AutocastCPU"

# autocast_mode.h's AT_FORALL_* lists (CUDA registers each; ops a release lacks are skipped).
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose")
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList")
FP32_APPEND_DTYPE = {             # the overload without a dtype -> the one CUDA redispatches to
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)
_BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on CUDA "
                   "(CUDA autocast refuses them); use binary_cross_entropy_with_logits or BCEWithLogitsLoss")


def policy_of(name: str) -> str | None:
    """CUDA autocast's policy for an aten op ("mm", "softmax.int"), or None: it runs uncast."""
    for policy, names in (("lower_precision_fp", LOWER_PRECISION), ("fp32", FP32),
                          ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("fp32_append_dtype", FP32_APPEND_DTYPE),
                          ("promote", PROMOTE), ("banned", BANNED)):
        if name in names:
            return policy
    return None


def _op(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _registered(name: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + name, key)
    except RuntimeError:
        return False


def _eligible(t) -> bool:
    """autocast_mode.h's is_eligible for the device standing in: a floating tensor, not double."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == "cpu"


class _Casts:
    """cached_cast: casts to the lower precision of fp32 leaves that require grad are kept
    until the outermost autocast region exits (torch.clear_autocast_cache)."""

    def __init__(self):
        self.cache: dict[int, tuple] = {}

    def cast(self, t, to):
        if not _eligible(t) or t.dtype == to:
            return t
        if to == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32 and t.requires_grad \
                and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled():
            hit = self.cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            out = t.to(to)
            self.cache[id(t)] = (weakref.ref(t), out)
            return out
        return t.to(to)

    def tree(self, value, to):
        if isinstance(value, torch.Tensor):
            return self.cast(value, to)
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree(v, to) for v in value)
        return value

    def clear(self):
        self.cache.clear()


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _promote_type(args, kwargs):
    """autocast_mode.h's promote_type: the lower precision unless an eligible input is fp32."""
    lower = torch.get_autocast_dtype("cpu")
    current = lower
    for t in _tensors(list(args) + list(kwargs.values())):
        if not _eligible(t):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif not (current == lower and t.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _no_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _with_defaults(op, args):
    """The positional arguments with the schema's defaults filled in for those not given."""
    args = list(args)
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    for a in positional[len(args):]:
        args.append(a.default_value)
    return args


def _kernel(name: str, policy: str, casts: _Casts):
    op = _op(name)
    if policy == "banned":
        def banned(*args, **kwargs):
            raise RuntimeError(_BANNED_MESSAGE)
        return banned
    if policy == "fp32_set_opt_dtype":
        schema_args = op._schema.arguments
        index = [a.name for a in schema_args].index("dtype")
        kwarg_only = schema_args[index].kwarg_only

        def set_opt_dtype(*args, **kwargs):
            with _no_autocast():
                if args and _eligible(args[0]):
                    if kwarg_only or len(args) <= index:
                        if kwargs.get("dtype") is None:
                            kwargs["dtype"] = torch.float32
                    elif args[index] is None:
                        args = args[:index] + (torch.float32,) + args[index + 1:]
                return op(*args, **kwargs)
        return set_opt_dtype
    if policy == "fp32_append_dtype":
        target = _op(FP32_APPEND_DTYPE[name])

        def append_dtype(*args, **kwargs):
            with _no_autocast():
                out = torch.float32 if _eligible(args[0]) else args[0].dtype
                return target(*_with_defaults(op, args), dtype=out, **kwargs)
        return append_dtype

    def cast_inputs(*args, **kwargs):
        with _no_autocast():
            to = torch.get_autocast_dtype("cpu") if policy == "lower_precision_fp" else \
                torch.float32 if policy == "fp32" else _promote_type(args, kwargs)
            # the wrapper's cached_cast(args)... pack: GCC evaluates a call's arguments last to
            # first, so the H200 casts a linear's bias, then its weight, then its input
            kw = {k: casts.tree(v, to) for k, v in reversed(kwargs.items())}
            cast = [casts.tree(a, to) for a in reversed(args)][::-1]
            return op(*cast, **kw)
    return cast_inputs


def _cpu_only_ops() -> list[str]:
    """Ops CPU autocast casts and CUDA autocast does not (they fall through on CUDA)."""
    out = []
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        name = full[len("aten::"):]
        if policy_of(name) is None and _registered(name, _KEY) and not _registered(name, "AutocastCUDA"):
            out.append(name)
    return out


@contextlib.contextmanager
def cuda_autocast():
    """CPU autocast casting as CUDA autocast does, until the block ends (entered again inside,
    it changes nothing)."""
    if getattr(torch.clear_autocast_cache, "cuda_way", False):
        yield
        return
    casts = _Casts()
    lib = torch.library.Library("aten", "IMPL")
    clear0 = torch.clear_autocast_cache

    def clear_autocast_cache():
        clear0()
        casts.clear()
    clear_autocast_cache.cuda_way = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # "overriding a previously registered kernel"
            for names in (LOWER_PRECISION, FP32, FP32_SET_OPT_DTYPE, tuple(FP32_APPEND_DTYPE), PROMOTE, BANNED):
                for name in names:
                    if _op(name) is not None and _registered(name, "AutocastCUDA"):
                        lib.impl(name, _kernel(name, policy_of(name), casts), _KEY)
            for name in _cpu_only_ops():
                lib.impl(name, torch.library.fallthrough_kernel, _KEY)
        torch.clear_autocast_cache = clear_autocast_cache
        yield
    finally:
        torch.clear_autocast_cache = clear0
        casts.clear()
        lib._destroy()
