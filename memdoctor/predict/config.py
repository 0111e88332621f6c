"""`memdoctor estimate`'s configurations: a known model (memdoctor.predict.models), a script's
build() or a transformers model (memdoctor.predict.hf_models), a batch shape, an optimizer and a
plan, turned into one estimate."""
from __future__ import annotations

import contextlib
import os
from typing import Any

from memdoctor.capture.script import script_build
from memdoctor.predict.estimate import estimate_built
from memdoctor.predict.hf_models import HfModel
from memdoctor.predict.result import Estimate
from memdoctor.remedies.plan import OPTIMIZERS as SWAPS
from memdoctor.remedies.plan import Plan

__all__ = ["estimate_config"]


def estimate_config(model: str | None = None, script: str | None = None, script_args=(), *,
                    hf: HfModel | None = None, batch: int = 8,
                    seq: int | None = None, image_size: int | None = None, precision: str | None = None,
                    checkpointing: str | int | None = None, micro_batch: str | int | None = None,
                    optimizer: str = "adamw", plan: str | None = None, world_size: int = 1,
                    zero: int | None = None, budget: int | None = None, device: str = "cuda",
                    anchors: bool = False, probe_gpu: bool | None = None, settle: bool = True) -> Estimate:
    """The estimate of a known model (memdoctor.predict.models), of a script's build() or of a
    transformers model (`hf`), as `memdoctor estimate` takes them; ValueError for a
    configuration that makes no sense. A script's sys.argv (`script_args`) and sys.path hold
    for the whole estimate."""
    if sum(x is not None for x in (model, script, hf)) != 1:
        raise ValueError("give one of a model (--model NAME), a SCRIPT exposing build(), or a transformers "
                         "model (--hf TYPE or --hf-config FILE)")
    if batch < 1:
        raise ValueError("--batch must be at least 1")
    if world_size < 1:
        raise ValueError("--world-size must be at least 1")
    swap = None
    base = optimizer
    if optimizer in SWAPS:          # "fused", "adamw-8bit", ...: a plan swap on top of AdamW
        swap, base = optimizer, "adamw"
    the_plan = _plan(plan, precision=precision, checkpointing=checkpointing, micro_batch=micro_batch,
                     optimizer=swap, zero=zero)
    if script is not None:
        building = script_build(script, script_args)
        config = {"script": os.path.abspath(script)}
    elif hf is not None:
        build, config = hf.builder(batch, seq=seq, image_size=image_size, optimizer=base)
        building = contextlib.nullcontext(build)
    else:
        building, config = _known_model(model, batch, seq, image_size, base)
    with building as build:
        est = estimate_built(build, plan=the_plan, device=device, world_size=world_size, budget=budget,
                             anchors=anchors, probe_gpu=probe_gpu, settle=settle)
    est.run.meta.setdefault("estimate", {})["config"] = config
    est.config = config
    return est


def _plan(plan: str | None, **fields: Any) -> Plan:
    """The plan string with the fields given apart on top (a digit string is a number)."""
    values: dict[str, Any] = {}
    if plan:
        parsed = Plan.parse(plan)
        values = {k: getattr(parsed, k) for k in ("precision", "checkpointing", "micro_batch", "optimizer", "zero")}
    for key, value in fields.items():
        if value is not None:
            if isinstance(value, str) and value.isascii() and value.isdigit():    # not "²"
                value = int(value)
            values[key] = value
    return Plan(**values)


def _known_model(name: str, batch: int, seq: int | None, image_size: int | None, optimizer: str):
    """(a context giving the build() of a known model, its configuration for the report)."""
    from memdoctor.predict.models import get
    try:
        spec = get(name)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    build = spec.builder(batch=batch, seq=seq, optimizer=optimizer, image_size=image_size)
    config = {"model": spec.name, "batch": batch,
              "seq": (seq or spec.default_seq) if spec.kind == "lm" else None,
              "image_size": (image_size or spec.image_size) if spec.kind == "image" else None,
              "optimizer": optimizer}
    return contextlib.nullcontext(build), config
