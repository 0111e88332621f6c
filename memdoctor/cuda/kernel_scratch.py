"""Scratch memory that CUDA kernels take from the caching allocator inside one call and give
back before returning.

A fake-tensor run never sees it (fake kernels only make outputs), yet on a GPU it counts in
`max_memory_allocated()` when it lands on the peak, and it shapes how the allocator's
segments fill. `scratch_for(func, args, kwargs, gpu)` says what one aten op takes, in the
order the kernel allocates it. Sizes follow the kernels' launch code (PyTorch 2.11) and
match, byte for byte, the allocator's traces of training steps recorded on an H200:

- reductions (sum, mean, norm over some dims): the global staging buffer and semaphores of
  Reduce.cuh, when the reduction is split across blocks (memdoctor.cuda.reduce_scratch);
- memory-efficient attention backward: a contiguous copy of the output gradient (when it
  is not already laid out as the kernel reads it); `delta` (fp32, one value per query),
  which fp16/bf16 kernels compute themselves and fp32 ones get from ATen ops,
  (grad_out * out).sum(-1).transpose(-2, -1).contiguous(), with an fp32 product as large as
  the output and the sum as temporaries; and the split-key workspace for grad_q (a lock
  header and a 64 x 64 fp32 tile per 64 queries, per batch and head; head dims over 64,
  measured on none, take tiles as wide as the head dim rounded up to 64). Checked on the
  H200 for four q/k/v layouts (tests/test_kernel_scratch.py);
- cuDNN attention: 256 bytes in forward; in backward an fp32 grad_q accumulator plus one
  fp32 value per query, and 256 bytes, per batch and head;
- the math attention's softmax (`_safe_softmax`): its masks of -inf scores and rows;
- softmax and log-softmax forward: a contiguous copy of an input that is not contiguous,
  after the output (SoftMax.cu's host_softmax, `input_.contiguous()`): SegFormer's logits
  keep the channels-last layout of its decode head, and the cross-entropy's log-softmax of
  the upsampled logits copies all of them (2.4 GiB at batch 16 on the H200);
- softmax backward (`_softmax_backward_data`, every eager attention's): `grad * output`,
  as large as the gradient, after the output (SoftMax.cu's softmax_backward_cuda_out);
- embedding backward (more than 3072 indices): the sort, segment and per-segment gradient
  buffers, sized for the worst case as the kernel sizes them (cub's temporaries
  approximately);
- topk (the gather path: more than 10 slices, or slices under 100,000 elements): a
  contiguous copy of an input that is not contiguous, after the values and indices
  (launch_gather_topk_kernel's `self.contiguous()`): Faster R-CNN's RPN takes the top 2000
  of each feature level, a column slice of its objectness scores;
- advanced indexing with two or more index tensors whose strides differ once broadcast
  (`x[rows[:, None], cols]`): a contiguous int64 copy of each that is not contiguous in the
  broadcast shape, before the output (make_info in TensorAdvancedIndexing.cpp, on CUDA);
- roll over several dimensions: one intermediate per dimension but the last, as large as
  the input, before the output (roll_common), and a contiguous copy of a non-contiguous
  input;
- layer norm (forward and backward): a contiguous copy of an input that is not contiguous
  (layer_norm_kernel.cu's `expect_contiguous`), which fake kernels never make: Whisper's
  encoder keeps its hidden states in the transposed layout of its convolutions' output, so
  each of its layer norms copies them, in forward, in checkpointing's recompute and in
  backward.

Not here: cuDNN convolution workspaces (chosen by cuDNN's heuristics per shape, GPU and
cuDNN version: measured on the GPU by memdoctor.predict.op_probe when there is one), and
flash-attention backward's accumulators (not measured).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memdoctor.cuda.reduce_scratch import div_up, reduction_scratch_bytes

aten = torch.ops.aten


@dataclass(frozen=True)
class Gpu:
    """What the launch code reads from the device properties."""
    sm_count: int = 132                 # H100 SXM / H200
    max_threads_per_sm: int = 2048

    @classmethod
    def local(cls) -> "Gpu":
        """This machine's GPU when there is one, else an H100/H200."""
        try:
            if torch.cuda.is_available():
                p = torch.cuda.get_device_properties(torch.cuda.current_device())
                return cls(p.multi_processor_count, p.max_threads_per_multi_processor)
        except Exception:
            pass
        return cls()


@dataclass(frozen=True)
class Scratch:
    """One allocation a kernel makes and frees within its call."""
    nbytes: int
    label: str
    before_outputs: bool = False    # allocated before the op's outputs (else after them)
    outlives: int | None = None     # how many of the op's next scratch allocations are made
                                    # before it is freed (None: kept until the op returns)


def _acc_bytes(dtype: torch.dtype) -> int:
    """Reductions of floating tensors accumulate in float32, float64 ones in float64."""
    return 8 if dtype == torch.float64 else 4


def _reduction(args, kwargs, gpu: Gpu, full: bool, vec: int | None) -> list[Scratch]:
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or not x.is_contiguous():
        return []
    if not x.is_floating_point():
        return []
    if full:
        dims = list(range(x.dim()))
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(x.dim()))
        elif isinstance(dims, int):
            dims = [dims]
        dims = [d % max(x.dim(), 1) for d in dims]
    sizes = reduction_scratch_bytes(list(x.shape), dims, x.element_size(), acc_bytes=_acc_bytes(x.dtype),
                                    sm_count=gpu.sm_count, max_threads_per_sm=gpu.max_threads_per_sm,
                                    input_vec_size=vec)
    return [Scratch(n, "reduction staging buffer and semaphores") for n in sizes if n > 0]


def _norm(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """norm and linalg_vector_norm reduce through gpu_reduce_kernel (NormOps, vt0 4 and
    input_vec_size 4 for every dtype): the staging of a sum over the same dims. weight_norm's
    norm over all but one dim of a large weight takes twice the weight (wav2vec2's positional
    convolution: 36 MiB)."""
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    return _reduction([args[0], dims], {}, gpu, False, 4)


def _contiguous_as_bmhk(t: torch.Tensor) -> bool:
    """Whether a [B, H, M, K] tensor is laid out as a contiguous [B, M, H, K] (what
    `t.transpose(1, 2).is_contiguous()` says, without running an op)."""
    b, h, m, k = t.shape
    sb, sh, sm, sk = t.stride()
    expected = {"k": 1, "h": k, "m": h * k, "b": m * h * k}
    return all(size == 1 or stride == expected[name]
               for name, size, stride in (("b", b, sb), ("m", m, sm), ("h", h, sh), ("k", k, sk)))


def _efficient_attention_backward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    grad_out, query = args[0], args[1]
    if not (isinstance(grad_out, torch.Tensor) and isinstance(query, torch.Tensor)) or query.dim() != 4:
        return []
    b, h, m, k = query.shape
    out = []
    if not _contiguous_as_bmhk(grad_out):
        out.append(Scratch(grad_out.numel() * grad_out.element_size(), "attention: contiguous output gradient",
                           before_outputs=True))
    per_query = b * h * m * 4
    if grad_out.dtype not in (torch.float16, torch.bfloat16):
        # C++ temporaries: the product and the sum are freed at the end of the expression
        out.append(Scratch(grad_out.numel() * 4, "attention backward: grad_out * out for delta", outlives=2))
        out.append(Scratch(per_query, "attention backward: delta before transposing", outlives=1))
    out.append(Scratch(per_query, "attention backward: delta"))
    kmax = 64 if k <= 64 else div_up(k, 64) * 64
    tile = 64 * kmax
    out.append(Scratch(b * h * div_up(m, 64) * (4 + tile) * 4, "attention backward: grad_q workspace"))
    return out


def _cudnn_attention_backward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    query = args[1]
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return []
    b, h, m, d = query.shape
    return [Scratch(b * h * m * (d + 1) * 4 + 256, "cuDNN attention backward workspace")]


def _cudnn_attention_forward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    return [Scratch(256, "cuDNN attention workspace")]


def _embedding_backward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """EmbeddingBackwardKernel.cu's sort-based path (more than 3072 indices, or
    scale_grad_by_freq): sorted and original indices, segment bookkeeping sized by the
    worst case (min(indices, rows) segments, indices / 10 + segments partial segments, as
    it sizes them to avoid a device sync), cub's temporaries, and the per-partial-segment
    fp32 gradient rows. Checked on the H200 for 8192 and 4096 indices into large tables and
    16384 indices into BERT's 30522 words and 2 token types."""
    grad, indices, num_weights = args[0], args[1], args[2]
    scale = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
    n = indices.numel()
    if n <= 3072 and not scale:
        return []           # embedding_backward_feature_kernel: no scratch
    idx = indices.element_size()
    segments = min(n, int(num_weights))
    partial = n // 10 + segments
    acc = 8 if grad.dtype == torch.float64 else 4
    label = "embedding backward: "
    return [Scratch(n * idx, label + "sorted indices", before_outputs=True),
            Scratch(n * idx, label + "original indices", before_outputs=True),
            Scratch(n * idx, label + "index range", before_outputs=True, outlives=0),
            Scratch(2 * n * idx + 18432, label + "cub sort temporary", before_outputs=True, outlives=0),
            Scratch(n * idx, label + "segment offsets"),
            Scratch(8, label + "segment count"),
            Scratch(segments * idx, label + "partials per segment"),
            Scratch(1279, label + "cub scan temporary", outlives=0),
            Scratch(segments * idx, label + "partial offsets per segment"),
            Scratch(n * idx, label + "segment sizes"),
            Scratch(1279, label + "cub scan temporary", outlives=0),
            Scratch(8, label + "partial segment count"),
            Scratch(partial * idx, label + "partial segment offsets"),
            Scratch(partial * grad.size(-1) * acc, label + "gradient rows per partial segment", outlives=0)]


def _safe_softmax(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """The math attention's softmax (`_safe_softmax`, rows all -inf give 0): after its
    output, a bool per score (`self == -inf`), a bool per row (all of them), and the 0 to
    write where a whole row is masked, freed last first. Seen on the H200 for fp32
    batch 4 x 16 heads x 1024 x 1024: 64 MiB, 64 KiB and 4 bytes after the 256 MiB output."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    dtype = (args[2] if len(args) > 2 else kwargs.get("dtype")) or x.dtype
    n = x.numel()
    rows = n // max(x.size(dim), 1) if x.dim() else 1
    label = "safe softmax: "
    return [Scratch(n, label + "scores equal to -inf"), Scratch(rows, label + "rows all -inf"),
            Scratch(torch.empty((), dtype=dtype, device="meta").element_size(), label + "zero")]


def _softmax_backward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """softmax_backward_cuda_out computes `tmp = grad * output` before its kernel: a tensor
    as large as the gradient, in the two's promoted dtype, after the output. Seen on the H200
    in a Llama's math attention in fp32 (8 x 16 x 1024 x 1024: a third 512 MiB block)."""
    grad, output = args[0], args[1]
    size = torch.empty((), dtype=torch.promote_types(grad.dtype, output.dtype), device="meta").element_size()
    return [Scratch(grad.numel() * size, "softmax backward: grad * output")]


def _softmax_forward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """softmax_cuda_out / log_softmax_cuda_out: host_softmax makes `input_.contiguous()` after
    the (structured) output, released when the call returns."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_contiguous() or x.numel() == 0:
        return []
    return [Scratch(x.numel() * x.element_size(), "softmax: contiguous copy of the input")]


def _topk(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """topk_out_cuda: where it does not sort the whole slice (at most 10 slices of 100,000
    elements or more, TensorTopK.cpp's should_use_sort, not modelled), the gather kernel's
    launch makes `self.contiguous()` after the values and indices, released when the call
    returns. Seen on the H200 in Faster R-CNN's filter_proposals (bf16, [8, 9375] and
    [8, 2535] column slices, k = 2000): 150000 and 40560 bytes after the outputs."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_contiguous() or x.numel() == 0 or x.dim() == 0:
        return []
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    slice_size = x.shape[dim]
    if slice_size and x.numel() // slice_size <= 10 and slice_size >= 100_000:
        return []
    return [Scratch(_nbytes(x), "topk: contiguous copy of the input")]


def _index(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """index (x[i, j]): make_info broadcasts the index tensors to one shape and, on CUDA,
    makes each contiguous when two or more of them differ in strides, before the output;
    the copies are released when the call returns. Seen on the H200 in Faster R-CNN's
    filter_proposals: `objectness[batch_idx, top_n_idx]` with batch_idx [8, 1] and top_n_idx
    [8, 6000] made a 384000-byte copy of batch_idx expanded, then the output. Boolean masks
    (turned into positions first) are left out."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    tensors = [t for t in indices or () if isinstance(t, torch.Tensor)]
    if len(tensors) < 2 or any(t.dtype in (torch.bool, torch.uint8) for t in tensors):
        return []
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return []
    expanded = [t.expand(shape) for t in tensors]
    if all(e.stride() == expanded[0].stride() for e in expanded):
        return []
    return [Scratch(shape.numel() * e.element_size(), "index: contiguous copy of an index", before_outputs=True)
            for e in expanded if not e.is_contiguous()]


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layer_norm(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """layer_norm_cuda: `input.expect_contiguous()` before Y, mean and rstd are made, the copy
    released when the call returns. Seen on the H200 for Whisper's encoder (fp32, 4 x 1500 x
    512 transposed): 12288000 bytes before the output, freed after mean and rstd."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_contiguous() or _nbytes(x) == 0:
        return []
    return [Scratch(_nbytes(x), "layer norm: contiguous copy of the input", before_outputs=True)]


def _layer_norm_backward(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """layer_norm_backward_cuda: the input made contiguous before dX, dgamma and dbeta, then
    `dY.contiguous()` for the kernels (freed first), the input's copy when the call returns."""
    grad_out, x = args[0], args[1]
    if not (isinstance(grad_out, torch.Tensor) and isinstance(x, torch.Tensor)) or x.numel() == 0:
        return []
    out = []
    if not x.is_contiguous():
        out.append(Scratch(_nbytes(x), "layer norm backward: contiguous copy of the input", before_outputs=True))
    if not grad_out.is_contiguous():
        out.append(Scratch(_nbytes(grad_out), "layer norm backward: contiguous output gradient"))
    return out


def _roll(args, kwargs, gpu: Gpu) -> list[Scratch]:
    """roll_cuda (TensorTransformations.cu) rolls one dimension at a time: with several,
    roll_common rolls the first into a new tensor and rolls that by the rest, so k
    dimensions make k - 1 intermediates as large as the input before the output, released
    last first when the call returns; a non-contiguous input is first copied
    (`self.contiguous()`), freed once the first roll is made (with no dims: flattened, the
    copy kept to the end). The H200's trace of Swin's cyclic shift (two dims): an
    intermediate, then the output, then the intermediate freed."""
    x = args[0]
    shifts = args[1] if len(args) > 1 else kwargs.get("shifts")
    dims = args[2] if len(args) > 2 else kwargs.get("dims", ())
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return []
    shifts = [shifts] if isinstance(shifts, int) else list(shifts or ())
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    nbytes = _nbytes(x)
    copy = [] if x.is_contiguous() else [Scratch(nbytes, "roll: contiguous copy of the input", before_outputs=True)]
    if len(dims) <= 1:
        return copy
    if copy:
        copy = [Scratch(nbytes, copy[0].label, before_outputs=True, outlives=1)]
    return copy + [Scratch(nbytes, "roll: one dimension rolled", before_outputs=True)
                   for _ in range(len(dims) - 1)]


def _rules() -> dict:
    rules = {}
    # sum vectorizes 16-bit inputs by 8 (its default), mean by 4 (Reduce.cuh's MeanOps)
    for name, overload, full, vec in (("sum", "dim_IntList", False, None), ("sum", "default", True, None),
                                      ("mean", "dim", False, 4), ("mean", "default", True, 4)):
        op = getattr(getattr(aten, name), overload, None)
        if op is not None:
            rules[op] = (lambda full, vec: lambda a, kw, g: _reduction(a, kw, g, full, vec))(full, vec)
    for name, overload in (("norm", "ScalarOpt_dim"), ("norm", "ScalarOpt_dim_dtype"), ("norm", "Scalar"),
                           ("linalg_vector_norm", "default")):
        op = getattr(getattr(aten, name), overload, None)
        if op is not None:
            rules[op] = _norm
    for name, rule in (("_scaled_dot_product_efficient_attention_backward", _efficient_attention_backward),
                       ("_scaled_dot_product_cudnn_attention_backward", _cudnn_attention_backward),
                       ("_scaled_dot_product_cudnn_attention", _cudnn_attention_forward),
                       ("embedding_dense_backward", _embedding_backward),
                       ("_safe_softmax", _safe_softmax),
                       ("_softmax_backward_data", _softmax_backward),
                       ("_softmax", _softmax_forward),
                       ("_log_softmax", _softmax_forward),
                       ("native_layer_norm", _layer_norm),
                       ("native_layer_norm_backward", _layer_norm_backward),
                       ("roll", _roll),
                       ("topk", _topk)):
        packet = getattr(aten, name, None)
        if packet is not None:
            rules[packet.default] = rule
    index = getattr(getattr(aten, "index", None), "Tensor", None)
    if index is not None:
        rules[index] = _index
    return rules


_RULES = _rules()


def scratch_for(func, args, kwargs, gpu: Gpu) -> list[Scratch]:
    """The scratch allocations `func(*args, **kwargs)` makes on a GPU, in order ([] for most ops)."""
    rule = _RULES.get(func)
    if rule is None:
        return []
    try:
        return rule(args, kwargs or {}, gpu)
    except Exception:
        return []
