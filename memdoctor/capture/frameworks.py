"""Which training framework drives a run (transformers' Trainer, Lightning and its Fabric,
accelerate), told from what the tracer meets anyway: the model's class, the optimizer's
wrapper, the frames that call the model. The diagnosis then gives each fix in that
framework's own settings (memdoctor.integrations.settings_for)."""
from __future__ import annotations

import os

# a framework's training loop, by a part of its files' paths
_LOOP_FILES = (("/transformers/trainer", "transformers"), ("/lightning/pytorch/", "lightning"),
               ("/pytorch_lightning/", "lightning"))
# a framework's optimizer wrapper, by class name
_OPTIMIZER_WRAPPERS = {"AcceleratedOptimizer": "accelerate", "LightningOptimizer": "lightning",
                       "_FabricOptimizer": "lightning"}


def of_model(root) -> set[str]:
    """A LightningModule, or a model Lightning Fabric wrapped."""
    cls = type(root)
    if any(c.__name__ == "LightningModule" for c in cls.__mro__) or cls.__module__.startswith("lightning.fabric"):
        return {"lightning"}
    return set()


def of_optimizer(optimizer) -> set[str]:
    name = _OPTIMIZER_WRAPPERS.get(type(optimizer).__name__)
    return {name} if name else set()


def of_frames(frame, depth: int = 40) -> set[str]:
    """The framework whose loop is among the frames from `frame` outwards."""
    while frame is not None and depth:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for marker, framework in _LOOP_FILES:
            if marker in path:
                return {framework}
        frame, depth = frame.f_back, depth - 1
    return set()


def ddp_buckets(root) -> list[dict]:
    """DistributedDataParallel keeps its gradient buckets, a copy of every gradient, for the
    whole run unless gradient_as_bucket_view=True makes the gradients views into them."""
    if type(root).__name__ != "DistributedDataParallel":
        return []
    return [{"gradient_as_bucket_view": bool(getattr(root, "gradient_as_bucket_view", False)),
             "param_bytes": sum(p.numel() * p.element_size() for p in root.parameters() if p.requires_grad)}]
