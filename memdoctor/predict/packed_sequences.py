"""Packed sequences (torch.nn.utils.rnn.pack_padded_sequence / pad_packed_sequence) in the
fake step, with the ops and allocations torch's own kernels make.

ATen's `_pack_padded_sequence`, its backward and `_pad_packed_sequence`
(aten/src/ATen/native/PackedSequence.cpp) read the lengths or batch sizes, CPU int64 tensors,
through their data pointer: on fake tensors there is no data, and they fail with "The tensor
has a non-zero number of elements, but its data is not allocated yet". While `packed_sequences()`
is active, `torch._VF`'s two calls run the same algorithm in Python: the same slices, copies,
`cat` and `full`, so the same allocations, with the sizes read as `.tolist()` reads them
(known values, memdoctor.predict.data_dependent). Packing is an autograd function whose
backward is ATen's: one zeroed gradient of the padded input, the packed gradient copied in.
Padding is composite in ATen too: autograd records its slices and copies, as here.

Lengths the estimate does not have (computed from activations: they read as 0) are bounded
from above: every sequence as long as the padded batch, noted.
"""
from __future__ import annotations

import torch

from memdoctor.predict.vf_patches import vf_replaced

__all__ = ["packed_sequences"]


def _pack(padded: torch.Tensor, lengths: list[int], batch_first: bool) -> tuple[torch.Tensor, list[int]]:
    """The packed data and batch sizes: blocks of time steps with the same batch, as ATen cuts them."""
    x = padded.transpose(0, 1) if batch_first else padded
    batch = x.shape[1]
    steps, sizes, prev = [], [], 0
    for i in range(batch):
        length = lengths[batch - 1 - i]
        if length > prev:
            width = batch - i
            steps.append(x[prev:length, :width].contiguous().view(-1, *x.shape[2:]))
            sizes += [width] * (length - prev)
            prev = length
    return torch.cat(steps), sizes


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, lengths, batch_first):
        ctx.shape, ctx.batch_first = tuple(padded.shape), batch_first
        data, sizes = _pack(padded, lengths, batch_first)
        ctx.sizes = sizes
        return data, torch.tensor(sizes, dtype=torch.int64, device="cpu")

    @staticmethod
    def backward(ctx, grad, _grad_sizes):
        shape = list(ctx.shape)
        if ctx.batch_first:
            shape[0], shape[1] = shape[1], shape[0]
        grad_input = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        offset = 0
        for i, size in enumerate(ctx.sizes):
            grad_input[i, :size].copy_(grad[offset:offset + size])
            offset += size
        return (grad_input.transpose(0, 1) if ctx.batch_first else grad_input), None, None


NOTE_BOUND = ("pack_padded_sequence at {where}: lengths the estimate does not have (computed from values it "
              "lacks): every sequence taken as long as the padded batch, an upper bound")


def _packer(notes: list[str] | None):
    def _pack_padded_sequence(padded, lengths, batch_first):
        values = [int(v) for v in lengths.tolist()]
        if values and min(values) <= 0:                 # unknown: read as 0
            from memdoctor.predict.data_dependent import _where
            note = NOTE_BOUND.format(where=_where())
            if notes is not None and note not in notes:
                notes.append(note)
            values = [padded.shape[1 if batch_first else 0]] * len(values)
        if not values or any(a < b for a, b in zip(values, values[1:])):
            raise RuntimeError("`lengths` array must be sorted in decreasing order when `enforce_sorted` is True")
        return _Pack.apply(padded, values, bool(batch_first))
    return _pack_padded_sequence


def _pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    sizes = [int(v) for v in batch_sizes.tolist()]
    if not sizes:
        raise RuntimeError("batch_sizes can not be empty")
    longest = len(sizes)
    if 0 < total_length < longest:
        raise RuntimeError(f"Expected total_length to be at least the length of the longest sequence in input, "
                           f"but got total_length={total_length} and max sequence length being {longest}")
    seq = total_length if total_length > 0 else longest
    trailing = tuple(data.shape[1:])
    output = torch.full((seq, sizes[0], *trailing), padding_value, dtype=data.dtype, device=data.device)
    lengths = [0] * sizes[0]
    where = sizes[0] - 1
    offset, prev_batch, prev_i = 0, sizes[0], 0
    for i in range(longest + 1):
        batch = sizes[i] if i != longest else 0
        if batch != prev_batch:
            count = prev_batch * (i - prev_i)
            block = data[offset:offset + count].view(i - prev_i, prev_batch, *trailing)
            output[prev_i:i, :prev_batch].copy_(block)
            offset += count
            prev_i = i
        for _ in range(prev_batch - batch):
            lengths[where] = i
            where -= 1
        prev_batch = batch
    if batch_first:
        output = output.transpose(0, 1)
    return output, torch.tensor(lengths, dtype=torch.int64, device="cpu")


def packed_sequences(notes: list[str] | None = None):
    """torch._VF's packing and padding as ATen runs them, on fake tensors (module docstring);
    `notes` gets a line where lengths were bounded."""
    return vf_replaced({"_pack_padded_sequence": lambda _: _packer(notes),
                        "_pad_packed_sequence": lambda _: _pad_packed_sequence})
