"""data-on-device: a dataset held whole on the device, one batch of it used at a time.

What it detects
    Tensors made outside any forward (before training or between steps), alive at the
    OOM (or the peak), that the model's inputs are taken from: typically a whole dataset
    moved to the GPU up front.
Preconditions
    - the tensor was made outside any forward, backward or optimizer step and is not a
      weight, gradient or optimizer state;
    - it feeds the inputs: an input was a view holding at most a quarter of its storage
      (`X[i:i+64]`), or inputs are batches of its rows (a DataLoader over a
      `TensorDataset` collates each batch into a new B x rest tensor of the same dtype
      from a N x rest one, N at least 4 B); tensors of the same length made with it (the
      labels) count with it;
    - or the data was made up front as batches: at least 8 tensors made by one line of the
      script before the first step, and either the OOM came before any model ran or a
      model's input was one of them;
    - or the OOM came outside any pass before any model ran, while data was being made
      (a float copy of a uint8 dataset): the tensors made so far and the request count;
    - together they take at least 30% of live memory.
Why it runs out of memory
    `dataset.to("cuda")` puts every sample on the device for the whole run, while a step
    needs one batch at a time.
Example
    bad:  X = torch.load("train.pt").cuda(); for i in ...: model(X[i:i+64])
          DataLoader(TensorDataset(X.cuda(), y.cuda()), batch_size=64)
    good: X stays on the CPU in pinned memory; each batch goes over with
          `X[i:i+64].to("cuda", non_blocking=True)`
Fix
    Keep the dataset on the host (pinned), move one batch at a time, or use a DataLoader.
Known limits
    On the CPU (the dispatch source without a GPU) host memory is the device: a dataset
    the script would keep on the host counts too. A dataset whose batches are transformed
    on the way (a new shape per sample) is not linked to its batches.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits, plural
from memdoctor.diagnosis.facts import Facts

ID = "data-on-device"
SHARE = 0.3


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run" or not f.dataset:
        return None
    held = sum(b.nbytes for b in f.dataset) + f.dataset_request
    live = f.focus_bytes
    if held < SHARE * live:
        return None
    biggest = max(f.dataset, key=lambda b: b.nbytes)
    evidence = [f"{format_bytes(held)} of data held on the device ({plural(len(f.dataset), 'tensor')}), "
                f"{100 * held / live:.0f}% of {format_bytes(live)}",
                f"largest: {_shape(biggest)}{format_bytes(biggest.nbytes)} made outside the model in step {biggest.step}"
                + (f"; batches of {f.dataset_batch_rows} rows are taken from it"
                   if f.dataset_batch_rows and not f.dataset_batches else "")]
    if f.dataset_batches:
        evidence.append(f"{f.dataset_batches} batches made up front by one line, "
                        + ("before the model ever ran" if not any(b.category == "inputs" for b in f.dataset)
                           else "each fed to the model in turn"))
    if f.dataset_request:
        evidence.append(f"ran out making more of it, asking for {format_bytes(f.dataset_request)}, "
                        "before any model ran")
        remedies = [Remedy("keep the data on the host", "hold the dataset in pinned CPU memory in its stored "
                           "dtype (uint8 images stay uint8) and move and convert each batch on the way in")]
        return Finding(ID, f"data made on the device takes {format_bytes(held)} before training starts", held,
                       evidence, remedies, free_fix_tier(f, None), None)
    rows = biggest.shape[0] if biggest.shape else 0
    if f.dataset_batches:
        batch = held // f.dataset_batches
    else:
        batch = held * f.dataset_batch_rows // rows if rows and f.dataset_batch_rows else 0
    predicted = live - held + batch        # one batch at a time on the device
    remedies = [Remedy("keep the data on the host", "hold the dataset in pinned CPU memory and move each batch "
                       "with .to(device, non_blocking=True)", predicted)]
    return Finding(ID, f"data held on the device takes {format_bytes(held)}", held, evidence, remedies,
                   free_fix_tier(f, predicted), fits(f, predicted))


def _shape(b) -> str:
    """"180000x256 float32 " where the shape is known (the allocator source does not know it
    for a tensor not yet bound to a name)."""
    return f"{'x'.join(map(str, b.shape))} {b.dtype} " if b.shape else ""
