"""data-on-device: datasets or inputs resident on the device dominate.

What it detects
    Tensors created outside the model and fed to it (inputs), or kept beside it, take a
    large share of device memory: typically a whole dataset moved to the GPU up front.
Why it runs out of memory
    `dataset.to("cuda")` puts every sample on the device for the whole run, while a step
    needs one batch at a time.
Example
    bad:  X = torch.load("train.pt").cuda(); for i in ...: model(X[i:i+64])
    good: X stays on the CPU in pinned memory; each batch goes over with
          `X[i:i+64].to("cuda", non_blocking=True)`
Fix
    Keep the dataset on the host (pinned), move one batch at a time, or use a DataLoader.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "data-on-device"
SHARE = 0.3


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run":
        return None
    # loaded before training or between steps, and fed to the model: not a step's outputs
    inputs = [b for b in f.focus_blocks if b.category == "inputs" and b.phase == "other"]
    held = sum(b.nbytes for b in inputs)
    live = f.focus_bytes
    if not held or held < SHARE * live:
        return None
    biggest = max(inputs, key=lambda b: b.nbytes)
    evidence = [f"{format_bytes(held)} of inputs on the device, {100 * held / live:.0f}% of {format_bytes(live)}",
                f"largest: {'x'.join(map(str, biggest.shape))} {biggest.dtype} {format_bytes(biggest.nbytes)} "
                f"made in step {biggest.step}"]
    predicted = live - held        # plus one batch at a time, small next to the dataset
    remedies = [Remedy("keep the data on the host", "hold the dataset in pinned CPU memory and move each batch "
                       "with .to(device, non_blocking=True)", predicted)]
    return Finding(ID, f"input data on the device takes {format_bytes(held)}", held, evidence, remedies,
                   free_fix_tier(f, predicted), fits(f, predicted))
