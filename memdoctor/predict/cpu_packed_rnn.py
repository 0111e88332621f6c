"""A CPU RNN over a packed sequence in the fake step, with the ops ATen's own kernel runs.

On the CPU, `torch._VF.lstm(data, batch_sizes, ...)` (and gru, rnn_tanh, rnn_relu) runs
ATen's PackedLayer (aten/src/ATen/native/RNN.cpp), which reads the batch sizes through
their data pointer: fake tensors have none, and the call fails. While `cpu_packed_rnns()`
is active, that call runs the same algorithm in Python, so the same ops and allocations:
per layer and direction, the input's projection for all tokens at once (`linear` with
w_ih), then per time step the step's rows, the cell as ATen's CPU cell computes it
(`linear` with w_hh, gates cut by `unsafe_chunk` and activated in place), and the hidden
state narrowed where sequences end (forwards) or grown by `cat` where they begin
(backwards); the steps' outputs joined by `cat`, directions by `cat` on the last dim,
dropout between layers, final states by `stack`. The batch sizes are read as `.tolist()`
reads them (known values, memdoctor.predict.data_dependent). Other calls, and LSTMs with
projections, go to torch's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memdoctor.predict.vf_patches import vf_replaced

__all__ = ["cpu_packed_rnns"]

_KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def _cell(kind: str, x: torch.Tensor, hidden, w_hh: torch.Tensor, b_hh: torch.Tensor | None):
    """One time step of ATen's CPU cell, its input already projected by w_ih."""
    if kind == "lstm":
        hx, cx = hidden
        gates = F.linear(hx, w_hh, b_hh).add_(x)
        ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
        ingate, forgetgate, cellgate, outgate = ingate.sigmoid_(), forgetgate.sigmoid_(), cellgate.tanh_(), \
            outgate.sigmoid_()
        cy = (forgetgate * cx).add_(ingate * cellgate)
        return outgate * cy.tanh(), cy
    if kind == "gru":
        i_r, i_z, i_n = x.unsafe_chunk(3, 1)
        h_r, h_z, h_n = F.linear(hidden, w_hh, b_hh).unsafe_chunk(3, 1)
        reset = h_r.add_(i_r).sigmoid_()
        update = h_z.add_(i_z).sigmoid_()
        new = i_n.add(h_n.mul_(reset)).tanh_()
        return (hidden - new).mul_(update).add_(new)
    pre = F.linear(hidden, w_hh, b_hh).add_(x)
    return pre.tanh_() if kind == "rnn_tanh" else pre.relu_()


def _slice(hidden, start: int, end: int):
    if isinstance(hidden, tuple):
        return tuple(h.narrow(0, start, end - start) for h in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: list):
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat([h[i] for h in hiddens], 0) for i in range(len(hiddens[0])))
    return torch.cat(hiddens, 0)


def _output(hidden) -> torch.Tensor:
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _forwards(kind, data, sizes, hidden, weights):
    w_ih, w_hh, b_ih, b_hh = weights
    projected = F.linear(data, w_ih, b_ih)
    outputs, finished, offset, last = [], [], 0, sizes[0]
    for size in sizes:
        step = projected.narrow(0, offset, size)
        offset += size
        if last > size:
            finished.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = _cell(kind, step, hidden, w_hh, b_hh)
        outputs.append(_output(hidden))
    finished.append(hidden)
    return torch.cat(outputs, 0), _concat(finished[::-1])


def _backwards(kind, data, sizes, initial, weights):
    w_ih, w_hh, b_ih, b_hh = weights
    projected = F.linear(data, w_ih, b_ih)
    outputs, offset, last = [], data.shape[0], sizes[-1]
    hidden = _slice(initial, 0, last)
    for size in reversed(sizes):
        if size > last:
            hidden = _concat([hidden, _slice(initial, last, size)])
        step = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        hidden = _cell(kind, step, hidden, w_hh, b_hh)
        outputs.append(_output(hidden))
    return torch.cat(outputs[::-1], 0), hidden


def _run(kind, data, sizes, hx, params, has_biases, layers, dropout, train, bidirectional):
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if kind == "lstm":
        hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
    else:
        hiddens = list(hx.unbind(0))
    finals, x = [], data
    for layer in range(layers):
        outs = []
        for d in range(directions):
            i = layer * directions + d
            w = params[i * per:(i + 1) * per]
            weights = (w[0], w[1], w[2], w[3]) if has_biases else (w[0], w[1], None, None)
            run = _backwards if d == 1 else _forwards
            out, final = run(kind, x, sizes, hiddens[i], weights)
            outs.append(out)
            finals.append(final)
        x = torch.cat(outs, -1) if directions == 2 else outs[0]
        if dropout != 0 and train and layer < layers - 1:
            x = F.dropout(x, dropout, True)
    if kind == "lstm":
        return x, torch.stack([f[0] for f in finals], 0), torch.stack([f[1] for f in finals], 0)
    return x, torch.stack(finals, 0)


def _packed_call(kind: str, args) -> bool:
    """Whether `args` are the packed form on CPU tensors: (data, batch_sizes, hx, params,
    has_biases, num_layers, dropout, train, bidirectional), no LSTM projections."""
    if len(args) != 9 or not isinstance(args[1], torch.Tensor) or args[1].dtype != torch.int64:
        return False
    data, params, has_biases = args[0], args[3], args[4]
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
        return False
    per = 4 if has_biases else 2
    return len(params) % per == 0 and len(params) // per == args[5] * (2 if args[8] else 1)


def _packed_rnn(kind: str):
    def replace(original):
        def run(*args, **kwargs):
            if kwargs or not _packed_call(kind, args):
                return original(*args, **kwargs)
            data, batch_sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
            sizes = [int(v) for v in batch_sizes.tolist()]
            return _run(kind, data, sizes, hx, list(params), bool(has_biases), int(layers), float(dropout),
                        bool(train), bool(bidirectional))
        return run
    return replace


def cpu_packed_rnns():
    """torch._VF's RNNs over a packed sequence on the CPU as ATen runs them (module
    docstring), until the block ends."""
    return vf_replaced({kind: _packed_rnn(kind) for kind in _KINDS})
