"""Scratch memory that PyTorch's CUDA reduction kernel allocates (sum, mean, ...).

A pure-Python port of the launch-configuration part of PyTorch's
``aten/src/ATen/native/cuda/Reduce.cuh`` (PyTorch ~2.11, CUDA build): ``ReduceConfig``
(``set_block_dimension``, ``grid()``, ``values_per_thread()``, ``global_memory_size()``,
``semaphore_size()``, ``should_global_reduce()``), ``get_output_vec_size``,
``setReduceConfig``, and the part of ``gpu_reduce_kernel`` that allocates through the
caching allocator: the ``AccumulationBuffer``, the 32-bit-indexing split
(``TensorIterator::with_32bit_indexing``), and the global-reduction staging ``buffer`` and
``semaphores``. The reduction's ``TensorIterator`` is rebuilt for a contiguous input:
reduced dimensions first, each group fastest-moving first, size-1 dimensions dropped and
adjacent dimensions coalesced.

When a reduction has many inputs per output and few outputs, ``setReduceConfig`` splits
each output's inputs across ``ctas_per_output`` thread blocks; the blocks write partial
results to a global staging buffer (``acc_bytes * num_outputs * ctas_per_output``, times
``block.x * output_vec_size`` when block.x is not a reduction axis), and the last block of
each output (counted with one int semaphore per ``grid.x``) combines them. Both
allocations are freed when the launch returns.

Defaults follow ``sum_functor`` (``ReduceSumProdKernel.cu``): ``vt0=4``, and
``input_vec_size=8`` for 16-bit inputs, else 4. Mean (``MeanOps``) and most other
reductions use ``vt0=4, input_vec_size=4``: pass ``input_vec_size=4``.

Left out: ROCm's branches; non-contiguous or offset inputs (the base pointer is assumed
aligned, which ``get_output_vec_size`` and vectorized loads care about); complex double
(256 threads a block instead of 512); the jiterated reductions (complex half); reductions
that do not go through ``gpu_reduce_kernel`` (cub-based ones, softmax, norms with their own
kernels); the allocator's rounding of the sizes (they are the requested bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

__all__ = ["ReduceConfig", "reduction_scratch_bytes", "div_up"]

INT32_MAX = 2**31 - 1
MAX_NUM_THREADS = 512          # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex<double>)
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256


def div_up(a: int, b: int) -> int:
    """a / b rounded up, as CUDA code sizes grids and tiles (at::ceil_div)."""
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    """floor to a power of two (at least 1), as Reduce.cuh's last_pow2."""
    return 1 << (n.bit_length() - 1) if n > 0 else 1


@dataclass
class _Iter:
    """The parts of a reduction's TensorIterator that the launch config reads."""
    shape: list[int]          # iterator order: reduced dims first, fastest first
    in_strides: list[int]     # bytes
    out_strides: list[int]    # bytes, 0 on reduced dims
    in_bytes: int             # the input's element size
    in_offset: int = 0        # elements from an aligned base (moved by the 32-bit split)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.out_strides if s == 0)

    @property
    def num_outputs(self) -> int:
        return prod(n for n, s in zip(self.shape, self.out_strides) if s != 0)

    def can_use_32bit_indexing(self) -> bool:
        if self.numel > INT32_MAX:
            return False
        return all(1 + sum((n - 1) * s for n, s in zip(self.shape, strides)) <= INT32_MAX
                   for strides in (self.out_strides, self.in_strides))

    def split(self) -> tuple["_Iter", "_Iter"]:
        """TensorIteratorBase::get_dim_to_split + split: (first half, second half)."""
        best, dim = -1, -1
        for d in range(len(self.shape) - 1, -1, -1):
            for strides in (self.out_strides, self.in_strides):
                extent = (self.shape[d] - 1) * abs(strides[d])
                if extent > best:
                    best, dim = extent, d
        n = self.shape[dim]
        first_size = n // 2

        def narrow(start: int, size: int) -> _Iter:
            shape = list(self.shape)
            shape[dim] = size
            return _Iter(shape, self.in_strides, self.out_strides, self.in_bytes,
                         self.in_offset + start * self.in_strides[dim] // self.in_bytes)

        return narrow(0, first_size), narrow(first_size, n - first_size)


def _make_iter(shape, dims, in_bytes: int, out_bytes: int) -> _Iter:
    """TensorIterator::reduce_op over a contiguous input (reorder_dimensions + coalesce)."""
    ndim = len(shape)
    if dims is None:
        dims = range(ndim)
    elif isinstance(dims, int):
        dims = (dims,)
    reduced = {d % ndim for d in dims} if ndim else set()
    if not reduced:                       # sum(dim=[]) reduces everything
        reduced = set(range(ndim))
    in_stride = [prod(shape[i + 1:]) * in_bytes for i in range(ndim)]
    kept = [i for i in range(ndim) if i not in reduced]
    out_stride = {i: prod(shape[j] for j in kept if j > i) * out_bytes for i in kept}
    # (size, in_stride, out_stride); size-1 dims coalesce away
    dims_ = [(shape[i], in_stride[i], 0 if i in reduced else out_stride[i])
             for i in range(ndim) if shape[i] != 1]
    dims_.sort(key=lambda t: (t[2] != 0, t[1]))      # reduced first, then by input stride
    merged: list[list[int]] = []
    for n, si, so in dims_:
        if merged and merged[-1][0] * merged[-1][1] == si and merged[-1][0] * merged[-1][2] == so:
            merged[-1][0] *= n
        else:
            merged.append([n, si, so])
    if not merged:                        # one element: a 1-d iterator of size 1
        merged = [[1, in_bytes, out_bytes]]
    return _Iter([m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged], in_bytes)


@dataclass
class ReduceConfig:
    """Reduce.cuh's ReduceConfig, host side."""
    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    step_input: int = 1
    step_output: int = 1
    ctas_per_output: int = 1
    input_mult: list[int] = field(default_factory=lambda: [0, 0, 0])
    output_mult: list[int] = field(default_factory=lambda: [0, 0])
    block_width: int = 1
    block_height: int = 1
    num_threads: int = 1
    vectorize_input: bool = False
    output_vec_size: int = 1

    def set_block_dimension(self, dim0: int, dim1: int, warp_size: int) -> None:
        max_num_threads = MAX_NUM_THREADS // self.output_vec_size
        dim0_pow2 = _last_pow2(dim0) if dim0 < max_num_threads else max_num_threads
        dim1_pow2 = _last_pow2(dim1) if dim1 < max_num_threads else max_num_threads
        self.block_width = min(dim0_pow2, warp_size)
        self.block_height = min(dim1_pow2, max_num_threads // self.block_width)
        self.block_width = min(dim0_pow2, max_num_threads // self.block_height)
        self.num_threads = self.block_width * self.block_height

    def split_input(self, parallelism: int) -> int:
        step, self.step_input = self.step_input, self.step_input * parallelism
        return step

    def split_output(self, parallelism: int) -> int:
        step, self.step_output = self.step_output, self.step_output * parallelism
        return step

    def grid(self) -> tuple[int, int]:
        return div_up(self.num_outputs // self.output_vec_size, self.step_output), self.ctas_per_output

    def should_block_x_reduce(self) -> bool:
        return self.input_mult[0] != 0

    def should_global_reduce(self) -> bool:
        return self.input_mult[2] != 0

    def values_per_thread(self) -> int:
        return div_up(self.num_inputs, self.step_input)

    def global_memory_size(self) -> int:
        if not self.should_global_reduce():
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if not self.should_block_x_reduce():
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        return 4 * self.grid()[0] if self.should_global_reduce() else 0   # sizeof(int)


def _output_vec_size(it: _Iter) -> int:
    """get_output_vec_size: 4, halved until it divides the base address (in elements),
    the output dimension's size and every other input stride (in elements)."""
    vec = 4
    out_index = it.num_reduce_dims
    for n in [it.in_offset, it.shape[out_index]] + [
            s // it.in_bytes for j, s in enumerate(it.in_strides) if j != out_index]:
        while n % vec:
            vec //= 2
    return vec


def _set_reduce_config(it: _Iter, acc_bytes: int, vt0: int, input_vec_size: int,
                       sm_count: int, max_threads_per_sm: int, warp_size: int) -> ReduceConfig:
    """setReduceConfig (CUDA branches)."""
    num_outputs = it.num_outputs
    config = ReduceConfig(acc_bytes, num_outputs, it.numel // num_outputs)
    nred = it.num_reduce_dims
    ndim = len(it.shape)
    on_fastest = nred == ndim or it.in_strides[0] < it.in_strides[nred]
    if on_fastest:        # block.x walks the reduced, fastest dim: block_x_reduce
        dim0, dim1, fastest_stride = config.num_inputs, num_outputs, it.in_strides[0]
    else:                 # block.x walks the outputs
        dim0, dim1, fastest_stride = num_outputs, config.num_inputs, it.in_strides[nred]

    if fastest_stride == it.in_bytes:
        if on_fastest and dim0 > 128 and nred == 1 and vt0 >= input_vec_size:
            config.vectorize_input = True            # "vectorize along input"
            dim0 //= input_vec_size
        elif not on_fastest:                         # "vectorize along output"
            config.output_vec_size = _output_vec_size(it)
            dim0 //= config.output_vec_size

    config.set_block_dimension(dim0, dim1, warp_size)
    if on_fastest:
        config.input_mult[0] = config.split_input(config.block_width)
    else:
        config.output_mult[0] = config.split_output(config.block_width)

    warp_split_threshold = min(config.block_height * 16, MAX_VALUES_PER_THREAD)
    if config.values_per_thread() >= warp_split_threshold:
        config.input_mult[1] = config.split_input(config.block_height)
    else:
        config.output_mult[1] = config.split_output(config.block_height)

    blocks_per_sm = max_threads_per_sm // config.num_threads
    target_grid_size = sm_count * blocks_per_sm
    grid = config.grid()[0]
    if (config.input_mult[1] != 0 and config.values_per_thread() >= MAX_VALUES_PER_THREAD
            and grid <= target_grid_size):
        # Split each output's inputs across blocks: a reduction through global memory.
        ctas1 = div_up(target_grid_size, grid)
        ctas2 = div_up(config.values_per_thread(), MIN_VALUES_PER_THREAD)
        ctas3 = div_up(config.values_per_thread(), MAX_VALUES_PER_THREAD)
        config.ctas_per_output = max(min(ctas1, ctas2), ctas3)
        if config.ctas_per_output > 1:
            config.input_mult[2] = config.split_input(config.ctas_per_output)
    return config


def _launch_iters(it: _Iter):
    """gpu_reduce_kernel's recursion over iter.with_32bit_indexing(), in launch order."""
    if it.can_use_32bit_indexing():
        yield it
        return
    for half in it.split():
        yield from _launch_iters(half)


def reduction_scratch_bytes(shape, dims, dtype_bytes: int, acc_bytes: int = 4,
                            out_bytes: int | None = None, *, sm_count: int = 132,
                            max_threads_per_sm: int = 2048, warp_size: int = 32,
                            vt0: int = 4, input_vec_size: int | None = None) -> list[int]:
    """Byte sizes of the caching-allocator blocks gpu_reduce_kernel takes, in order.

    shape: the contiguous input's shape; dims: the reduced dims (an int, a sequence, or
    None / () for all); dtype_bytes: the input's element size; acc_bytes: the accumulator's
    (``arg_t``: 4 for fp32/bf16/fp16 sums, 8 for fp64/int64); out_bytes: the output's
    (default: dtype_bytes). vt0 / input_vec_size: the kernel's template arguments (default:
    sum's, i.e. input_vec_size 8 for 16-bit inputs, else 4).

    A single launch gives ``[buffer, semaphores]`` when it reduces across blocks, else ``[]``.
    An input too large for 32-bit indexing is reduced in several launches; then the list is
    an AccumulationBuffer (``num_outputs * acc_bytes``, only when the output cannot hold
    the partial sums: 16-bit input and output with a wider accumulator), live for the whole
    reduction, followed by each launch's ``buffer, semaphores``; each launch frees its pair
    before the next allocates.
    """
    out_bytes = dtype_bytes if out_bytes is None else out_bytes
    if input_vec_size is None:
        input_vec_size = 8 if dtype_bytes == 2 else 4
    shape = [int(n) for n in shape]
    if prod(shape) == 0:
        return []                         # empty input: no kernel launch
    it = _make_iter(shape, dims, dtype_bytes, out_bytes)
    sizes: list[int] = []
    if not it.can_use_32bit_indexing():
        can_accumulate_in_output = not (dtype_bytes == 2 and out_bytes == 2)   # half/bf16 -> same
        if not can_accumulate_in_output and out_bytes < acc_bytes:
            output_memory_size = max([out_bytes] + [n * s for n, s in zip(it.shape, it.out_strides)])
            sizes.append(output_memory_size // out_bytes * acc_bytes)
    for sub in _launch_iters(it):
        config = _set_reduce_config(sub, acc_bytes, vt0, input_vec_size,
                                    sm_count, max_threads_per_sm, warp_size)
        if config.should_global_reduce():
            sizes += [config.global_memory_size(), config.semaphore_size()]
    return sizes
