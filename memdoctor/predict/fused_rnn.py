"""cuDNN's fused RNNs (nn.LSTM, nn.GRU, nn.RNN on a GPU) in the fake step: each call made
with what cuDNN allocates, since fake tensors cannot run it.

On a GPU, `torch._VF.lstm` (and gru, rnn_tanh, rnn_relu) runs the whole stack of layers in
one cuDNN call (aten/src/ATen/native/cudnn/RNN.cpp). Its fake kernel says nothing true about
memory: it returns an empty reserve, and without the flat weight buffer (fake parameters
all share data pointer 0, so nn.RNNBase never flattens them) it fails with "Expected a
proper Tensor but got None for argument #3 'weight_buf'". So while the fake step runs,
`cudnn_rnns()` puts in its place one autograd function that allocates as the kernel does,
and gathers each RNN's weights into one buffer when they are made, as nn.RNNBase does on a
GPU (the separate storages freed; with it the H200's own requests replay to its reserved
peak, tests/test_data_dependent.py):

- forward: a seq-major contiguous copy of a batch-first input (freed at return); the output,
  h_n (and c_n); cuDNN's workspace (freed at return) and its reserve space, which the
  backward reads and so lives until then;
- backward: the copies of the input and of the output gradient, dx, dh_0 (dc_0) and the
  data workspace; then the input copy again, one zeroed weight-gradient buffer that every
  parameter's gradient is a view of, and the weight workspace;
- under autocast, the input and states cast to the autocast dtype and a flat copy of all
  weights in it (aten/src/ATen/cudnn/AutocastRNN.cpp), kept for the backward;
- with dropout in training: cuDNN's dropout generator states, made by the first such call
  on a GPU and cached by torch, made anew by the first call after the random state was set
  (RNN.cpp get_dropout_state: with checkpointing, at every call); the reserve then holds the
  masks too, so the probe runs with the same dropout.
- a packed sequence's call (`_VF.lstm(data, batch_sizes, hx, ...)`): the output and the input
  gradient hold its tokens, no batch-first copies; cuDNN sizes its reserve and workspaces by
  the batch sizes (a batch of short sentences takes less than the padded one), so the probe
  runs the packed call with the same batch sizes; where they are unknown, or without a GPU,
  they are taken as for the padded batch (its longest sequence at its largest batch), an
  upper bound.

The reserve and workspace sizes are cuDNN's choice (cudnnGetRNNTempSpaceSizes): on a machine
with a CUDA GPU each distinct RNN is run once there, uninitialised, and measured; without
one they are bounded from above (noted): the reserve and each workspace by (gates + 4)
values per hidden unit, time step, sample, layer and direction. That bound holds on all
eight LSTM and GRU shapes measured on an H200 (3 layers of 1024, 256 steps, batch 16 and
32, fp32 and bf16; benchmarks/results/zoo_rnn_check_h200_2026-12-01.json, "checks"), where
the workspaces were 34-68% of it and the reserves 81-95%; a tighter one (the reserve at
gates + 3, the workspaces at one layer's input projection) failed there.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from memdoctor.predict.vf_patches import vf_replaced
from memdoctor.predict.kernel_watch import note_cudnn_call

__all__ = ["cudnn_rnns", "RnnShape", "RnnSizes", "bound", "measure", "NOTE_BOUND"]

# cuDNN's modes (cudnnRNNMode_t) and gates per mode
_MODES = {"rnn_relu": (0, 1), "rnn_tanh": (1, 1), "lstm": (2, 4), "gru": (3, 3)}

NOTE_BOUND = ("cuDNN RNN ({names}): its reserve space and workspaces are cuDNN's choice; without a GPU to measure "
              "them on they are bounded from above, so the allocated peak errs high by up to the reserve's size; "
              "the reserved peak can be off either way, the cache split otherwise (the zoo's GRU bf16 batch 32: "
              "13% under an H200's)")
NOTE_MEASURED = "cuDNN RNN ({names}): reserve space and workspaces measured on this machine's GPU ({gpu})"


@dataclass(frozen=True)
class RnnShape:
    """What cuDNN's sizes depend on."""
    mode: str
    input_size: int
    hidden: int
    proj: int
    layers: int
    directions: int
    batch: int
    seq: int
    dtype: torch.dtype
    bias: bool
    batch_sizes: tuple[int, ...] = ()      # a packed call's, time step by time step
    dropout: float = 0.0                   # between layers, in training: cuDNN's reserve holds the masks

    @property
    def gates(self) -> int:
        return _MODES[self.mode][1]


@dataclass(frozen=True)
class RnnSizes:
    """Bytes cuDNN takes for one call: kept from forward to backward, and freed inside each call."""
    reserve: int
    forward_workspace: int
    backward_data_workspace: int
    backward_weight_workspace: int
    measured: bool = False
    dropout_state: int = 0      # cuDNN's dropout generator states (torch makes and caches them)


def bound(shape: RnnShape) -> RnnSizes:
    """Upper bounds for a machine without a GPU (module docstring)."""
    elem = torch.empty((), dtype=shape.dtype).element_size()
    per_step = shape.batch * shape.hidden * elem
    whole = shape.layers * shape.directions * shape.seq * per_step * (shape.gates + 4)
    return RnnSizes(whole, whole, whole, whole)


# (GPU index, RnnShape) -> sizes measured there, for this process's lifetime
MEASURED: dict[tuple, RnnSizes] = {}


def measure(shape: RnnShape, device: str | torch.device = "cuda") -> RnnSizes:
    """Run cuDNN's RNN once forward and backward on uninitialised tensors of `shape` and read
    its reserve (an output) and the workspaces (allocated and freed inside each call)."""
    from memdoctor.predict.op_probe import recorded_trace
    device = torch.device(device)
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    if (gpu, shape) in MEASURED:
        return MEASURED[(gpu, shape)]
    mode, _ = _MODES[shape.mode]
    module = _module(shape).to(device=device, dtype=shape.dtype)
    weights = module._flat_weights
    stride0 = len(weights) // (shape.layers * shape.directions)
    rows = (sum(shape.batch_sizes),) if shape.batch_sizes else (shape.seq, shape.batch)
    x = torch.empty(*rows, shape.input_size, device=device, dtype=shape.dtype)
    out_size = shape.proj or shape.hidden
    hx = torch.zeros(shape.layers * shape.directions, shape.batch, out_size, device=device, dtype=shape.dtype)
    cx = torch.zeros(shape.layers * shape.directions, shape.batch, shape.hidden, device=device,
                     dtype=shape.dtype) if shape.mode == "lstm" else None
    with torch.no_grad():
        weight_buf = torch._cudnn_rnn_flatten_weight(weights, stride0, shape.input_size, mode, shape.hidden,
                                                     shape.proj, shape.layers, False, shape.directions == 2)
    batch_sizes = list(shape.batch_sizes)
    state = torch._cudnn_init_dropout_state(shape.dropout, True, 0, dtype=torch.uint8, device=device) \
        if shape.dropout > 0 else None
    args = (x, weights, stride0, weight_buf, hx, cx, mode, shape.hidden, shape.proj, shape.layers, False,
            shape.dropout, True, shape.directions == 2, batch_sizes, state)
    result: dict = {}

    def forward():
        with torch.no_grad():
            result["out"] = torch._cudnn_rnn(*args)
        return result["out"]
    forward_trace = recorded_trace(forward, device)
    out, hy, cy, reserve, _ = result["out"]
    grads = (torch.empty_like(out), torch.empty_like(hy), torch.empty_like(cy) if cx is not None else None)

    def backward():
        with torch.no_grad():
            return torch.ops.aten._cudnn_rnn_backward(x, weights, stride0, weight_buf, hx, cx, out, *grads, mode,
                                                      shape.hidden, shape.proj, shape.layers, False,
                                                      shape.dropout, True, shape.directions == 2, batch_sizes,
                                                      state, reserve,
                                                      [True, True, cx is not None, True])
    backward_trace = recorded_trace(backward, device)
    freed_f = _freed(forward_trace)
    freed_b = _freed(backward_trace)
    sizes = RnnSizes(reserve.numel(), max(freed_f, default=0), max(freed_b[:1], default=0),
                     max(freed_b[1:], default=0), measured=True,
                     dropout_state=state.numel() if state is not None else 0)
    del module, weights, x, hx, cx, weight_buf, out, hy, cy, reserve, grads, result, state
    torch.cuda.empty_cache()
    MEASURED[(gpu, shape)] = sizes
    return sizes


def _freed(trace: list[dict]) -> list[int]:
    """Sizes of the allocations a trace made and freed, in order."""
    live, out = {}, []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            out.append(live.pop(e["addr"]))
    return out


def _module(shape: RnnShape) -> torch.nn.Module:
    kinds = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}
    kwargs = dict(num_layers=shape.layers, bias=shape.bias, bidirectional=shape.directions == 2)
    if shape.mode == "lstm" and shape.proj:
        kwargs["proj_size"] = shape.proj
    if shape.mode in kinds:
        return kinds[shape.mode](shape.input_size, shape.hidden, **kwargs)
    return torch.nn.RNN(shape.input_size, shape.hidden, nonlinearity=shape.mode[4:], **kwargs)


# ----------------------------------------------------------------------- the fake call
def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _Sizes:
    """The sizes of each distinct RNN, measured on the GPU or bounded, and which were which."""

    def __init__(self, probe: bool):
        self.probe = probe
        self.seen: dict[RnnShape, RnnSizes] = {}
        self.dropout_state: torch.Tensor | None = None      # made at the first call with dropout, kept
        self.rng_set = False                    # the random state was set since the last one was made

    def make_dropout_state(self, sizes: RnnSizes, like: torch.Tensor) -> None:
        """cuDNN's dropout states, made by the first training call with dropout on this GPU
        (before its output) and cached by torch, made anew (the old ones freed after) by the
        first such call after the generator's state was set: a seed, or
        torch.utils.checkpoint restoring the state to recompute, and again after."""
        if sizes.dropout_state and (self.dropout_state is None or self.rng_set):
            self.dropout_state = _empty(sizes.dropout_state, like)
            self.rng_set = False

    def of(self, shape: RnnShape) -> RnnSizes:
        if shape not in self.seen:
            sizes = None
            if self.probe:
                try:
                    with _outside_fake():
                        sizes = measure(shape)
                except Exception:            # no room, or cuDNN refuses the shape: fall back to the bound
                    sizes = None
            self.seen[shape] = sizes or bound(shape)
        return self.seen[shape]

    def notes(self) -> list[str]:
        out = []
        bounded = sorted({s.mode for s, z in self.seen.items() if not z.measured})
        measured = sorted({s.mode for s, z in self.seen.items() if z.measured})
        if bounded:
            out.append(NOTE_BOUND.format(names=", ".join(bounded)))
        if measured:
            out.append(NOTE_MEASURED.format(names=", ".join(measured), gpu=torch.cuda.get_device_name()))
        return out


@contextlib.contextmanager
def _outside_fake():
    """Real CUDA tensors inside the fake step: no dispatch or function mode, no autocast."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction(), \
            torch.autocast("cuda", enabled=False):
        yield


def _empty(nbytes: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(max(int(nbytes), 0), dtype=torch.uint8, device=like.device)


class _FusedRNN(torch.autograd.Function):
    """One cuDNN RNN call on fake tensors: outputs, reserve and workspaces as cuDNN makes them."""

    @staticmethod
    def forward(ctx, meta, x, hx, cx, *weights):
        shape, sizes, batch_first, lowp, packed = meta
        ctx.meta = meta
        rows = (x.shape[0],) if packed else (shape.seq, shape.batch)      # a packed batch: its tokens
        work_dtype = lowp or x.dtype
        xs = x.to(work_dtype) if lowp else x
        h0 = hx.to(work_dtype) if lowp else hx
        c0 = cx.to(work_dtype) if (lowp and cx is not None) else cx
        flat = None
        if lowp:                    # autocast: one flat copy of all weights in the autocast dtype
            flat = torch.zeros(sum(w.numel() for w in weights), dtype=work_dtype, device=x.device)
        copy = xs.transpose(0, 1).contiguous() if batch_first else None
        out_size = (shape.proj or shape.hidden) * shape.directions
        out = torch.empty(*rows, out_size, dtype=work_dtype, device=x.device)
        hy = torch.empty(tuple(h0.shape), dtype=work_dtype, device=x.device)
        cy = torch.empty(tuple(c0.shape), dtype=work_dtype, device=x.device) if c0 is not None else None
        workspace = _empty(sizes.forward_workspace, x)
        reserve = _empty(sizes.reserve, x)
        del workspace, copy
        ctx.save_for_backward(xs, h0, c0, out, reserve, flat, *weights)
        out = out.transpose(0, 1) if batch_first else out
        return out, hy, (cy if cy is not None else torch.empty(0, dtype=work_dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad_out, grad_hy, grad_cy):
        shape, sizes, batch_first, lowp, packed = ctx.meta
        note_cudnn_call()
        xs, h0, c0, out, reserve, flat, *weights = ctx.saved_tensors
        rows = (xs.shape[0],) if packed else (shape.seq, shape.batch)
        dev = xs.device
        work_dtype = xs.dtype
        x_copy = xs.transpose(0, 1).contiguous() if batch_first else None
        dy = grad_out.transpose(0, 1).contiguous() if batch_first else grad_out.contiguous()
        dx = torch.empty(*rows, shape.input_size, dtype=work_dtype, device=dev)
        dhx = torch.empty(tuple(h0.shape), dtype=work_dtype, device=dev)
        dcx = torch.empty(tuple(c0.shape), dtype=work_dtype, device=dev) if c0 is not None else None
        workspace = _empty(sizes.backward_data_workspace, xs)
        del workspace, x_copy, dy
        x_copy = xs.transpose(0, 1).contiguous() if batch_first else None
        dw = torch.zeros(sum(w.numel() for w in weights), dtype=work_dtype, device=dev)
        workspace = _empty(sizes.backward_weight_workspace, xs)
        del workspace, x_copy
        grads, start = [], 0
        for w in weights:
            grads.append(dw[start:start + w.numel()].view(w.shape))
            start += w.numel()
        dx = dx.transpose(0, 1) if batch_first else dx
        return (None, dx, dhx, dcx, *grads)


def _flatten_as_cudnn(module, device_type: str) -> bool:
    """On a GPU, nn.RNNBase gathers its weights into one buffer as soon as they are there (at
    construction, and again after every .to(), even one that moves nothing):
    torch._cudnn_rnn_flatten_weight allocates a new buffer each time, every weight becomes a
    view of it and the storages they had are freed. On fake tensors (data pointer 0 for all)
    nn.RNNBase never does, and on the CPU standing in for CUDA neither: done here for those,
    with the same allocation and frees. Whether it was done."""
    weights = module._flat_weights
    if not weights or not all(isinstance(w, torch.Tensor) for w in weights):
        return False
    first = weights[0]
    if not (is_fake(first) or (device_type == "cpu" and first.device.type == "cpu")):
        return False
    if any(w.dtype != first.dtype or w.device != first.device for w in weights):
        return False
    with torch.no_grad():
        flat = torch.empty(sum(w.numel() for w in weights), dtype=first.dtype, device=first.device)
        offset = 0
        for w in weights:
            n = w.numel()
            view = flat[offset:offset + n].view_as(w)
            view.copy_(w)
            w.data = view
            offset += n
    return True


def _layout(args, kinds: str):
    """(input, batch_sizes, hx, cx, weights, has_biases, layers, dropout, train, bidirectional,
    batch_first) of a `_VF.<kind>` call, or None for a call of another form. A packed sequence's
    call has the batch sizes second and no batch_first (its data is time-major already)."""
    if len(args) != 9:
        return None
    if isinstance(args[3], (list, tuple)):          # packed: (data, batch_sizes, hx, weights, ...)
        x, batch_sizes, hx, weights, has_biases, layers, dropout, train, bidirectional = args
        batch_first = False
        if not isinstance(batch_sizes, torch.Tensor):
            return None
    else:
        x, hx, weights, has_biases, layers, dropout, train, bidirectional, batch_first = args
        batch_sizes = None
    if not isinstance(hx, (torch.Tensor, tuple, list)) or not isinstance(weights, (list, tuple)):
        return None
    if kinds == "lstm":
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    return x, batch_sizes, h0, c0, list(weights), has_biases, layers, dropout, train, bidirectional, batch_first


@contextlib.contextmanager
def cudnn_rnns(probe: bool = False, notes: list[str] | None = None, device_type: str = "cuda"):
    """torch._VF's fused RNNs as cuDNN runs them (module docstring), until the block ends;
    `probe`: measure cuDNN's sizes on this machine's GPU; `notes` gets what was measured or
    bounded. `device_type`: where autocast is read (the CPU's when it stands in for CUDA)."""
    sizes = _Sizes(probe)

    def make(name, original):
        def run(*args, **kwargs):
            layout = _layout(args, name) if not kwargs else None
            if layout is None or layout[0].dim() != (2 if layout[1] is not None else 3):
                return original(*args, **kwargs)
            x, batch_sizes, h0, c0, weights, has_biases, layers, dropout, train, bidirectional, batch_first = layout
            packed = batch_sizes is not None
            directions = 2 if bidirectional else 1
            gates = _MODES[name][1]
            per = len(weights) // (layers * directions)
            w_hh = weights[1]
            hidden = w_hh.shape[0] // gates
            proj = weights[per - 1].shape[0] if name == "lstm" and per in (3, 5) else 0
            lowp = _autocast_dtype(device_type)
            lowp = lowp if lowp is not None and lowp != x.dtype else None
            steps: tuple[int, ...] = ()
            if packed:              # the padded batch's longest sequence and largest batch bound it
                seq, batch = batch_sizes.shape[0], h0.shape[1]
                steps = tuple(int(v) for v in batch_sizes.tolist())
                steps = steps if steps and min(steps) > 0 else ()     # unknown sizes read as 0
            else:
                seq, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
            training = bool(train) and torch.is_grad_enabled()
            shape = RnnShape(name, int(x.shape[-1]), int(hidden), int(proj), int(layers), directions, int(batch),
                             int(seq), lowp or x.dtype, bool(has_biases), steps,
                             float(dropout) if bool(train) else 0.0)
            rnn_sizes = sizes.of(shape) if training else RnnSizes(0, bound(shape).forward_workspace, 0, 0)
            if training:
                sizes.make_dropout_state(rnn_sizes, x)
            note_cudnn_call()
            with torch.autocast(device_type, enabled=False):
                out, hy, cy = _FusedRNN.apply((shape, rnn_sizes, bool(batch_first), lowp, packed), x, h0, c0,
                                              *weights)
            if name == "lstm":
                return out, hy, cy
            return out, hy
        return run

    flatten = torch.nn.RNNBase.flatten_parameters

    def flatten_parameters(module) -> None:
        if not _flatten_as_cudnn(module, device_type):
            flatten(module)
    with vf_replaced({name: functools.partial(make, name) for name in _MODES}), _rng_sets_noted(sizes):
        torch.nn.RNNBase.flatten_parameters = flatten_parameters
        try:
            yield sizes
        finally:
            torch.nn.RNNBase.flatten_parameters = flatten
            if notes is not None:
                notes.extend(sizes.notes())


# Where a script, torch.random.fork_rng or torch.utils.checkpoint sets the random state; the
# CPU's with the GPU's, so the CPU's call stands for both where a CPU stands in for CUDA.
_RNG_SETTERS = ((torch, "set_rng_state"), (torch, "manual_seed"), (torch.cuda, "set_rng_state"),
                (torch.cuda, "set_rng_state_all"), (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"))


@contextlib.contextmanager
def _rng_sets_noted(sizes: _Sizes):
    """Note in `sizes` each time the random state is set, until the block ends."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in _RNG_SETTERS if hasattr(owner, name)]

    def noting(original):
        @functools.wraps(original)
        def setter(*args, **kwargs):
            sizes.rng_set = True
            return original(*args, **kwargs)
        return setter
    for owner, name, original in originals:
        setattr(owner, name, noting(original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
