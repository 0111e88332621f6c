"""The independent count the estimate's CPU tests compare with: real training steps on the CPU,
traced by memdoctor's dispatch source, each allocation rounded as the allocator model rounds."""
from __future__ import annotations

from typing import Callable

from memdoctor.capture.session import Tracer
from memdoctor.cuda.allocator_model import round_size
from memdoctor.predict.fake_step import train_step
from memdoctor.run import Action, Run


def rounded_live_peak(run: Run) -> int:
    """The highest sum of live allocations in `run`, each rounded to the allocator's size."""
    live = peak = 0
    for action, nbytes in zip(run.actions, run.event_bytes):
        if action == Action.ALLOC and nbytes:
            live += round_size(nbytes)
        elif action == Action.FREE and nbytes:
            live -= round_size(nbytes)
        peak = max(peak, live)
    return peak


def _train(model_fn: Callable, optimizer_fn: Callable, batch_fn: Callable, loss_fn: Callable, steps: int) -> None:
    """`steps` training steps, the model, optimizer and batch made first (inside the count)."""
    model = model_fn()
    optimizer = optimizer_fn(model)
    batch = batch_fn()
    for _ in range(steps):
        train_step(model, optimizer, batch, loss_fn)


def real_steps(model_fn: Callable, optimizer_fn: Callable, batch_fn: Callable, loss_fn: Callable,
               steps: int = 2) -> Run:
    """`steps` real training steps on the CPU, the model, optimizer and batch made inside the trace."""
    with Tracer(source="dispatch") as tracer:
        _train(model_fn, optimizer_fn, batch_fn, loss_fn, steps)
    return tracer.run


def real_peak(model_fn: Callable, optimizer_fn: Callable, batch_fn: Callable, loss_fn: Callable,
              steps: int = 2) -> int:
    return rounded_live_peak(real_steps(model_fn, optimizer_fn, batch_fn, loss_fn, steps))


def plain_peak(model_fn: Callable, optimizer_fn: Callable, batch_fn: Callable, loss_fn: Callable,
               steps: int = 2) -> int:
    """The rounded live peak of `steps` real CPU steps counted by torch.profiler's memory
    events, with no dispatch mode active. Under one (real_steps' tracer) autograd's engine
    sums a gradient that several ops feed out of place (`isTensorSubclassLike` holds for
    every tensor then); without one it sums in place, as the estimate counts. They part
    where one tensor feeds many ops: an RNN's projected input, sliced at every time step."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        _train(model_fn, optimizer_fn, batch_fn, loss_fn, steps)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        nbytes = e.nbytes()
        live += round_size(nbytes) if nbytes > 0 else -round_size(-nbytes)
        peak = max(peak, live)
    return peak
