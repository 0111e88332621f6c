"""torch._VF's functions replaced for the length of a block: the fake step's RNN, packing and
padding calls (memdoctor.predict.fused_rnn, packed_sequences, cpu_packed_rnn)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["vf_replaced"]


@contextlib.contextmanager
def vf_replaced(replacements: dict[str, Callable[[Callable], Callable]]):
    """Each torch._VF function named in `replacements` replaced by what its factory makes of
    the original, until the block ends; then set back where torch._VF held it itself, and
    removed where it came by lookup (torch._C._VariableFunctions)."""
    vf = torch._VF
    originals = {name: getattr(vf, name) for name in replacements}
    own = {name: name in vf.__dict__ for name in replacements}
    for name, factory in replacements.items():
        setattr(vf, name, factory(originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            if own[name]:
                setattr(vf, name, original)
            else:
                vf.__dict__.pop(name, None)
