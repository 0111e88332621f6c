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


def of_model(root) -> str | None:
    """A LightningModule, or a model Lightning Fabric wrapped."""
    cls = type(root)
    if any(c.__name__ == "LightningModule" for c in cls.__mro__) or cls.__module__.startswith("lightning.fabric"):
        return "lightning"
    return None


def of_optimizer(optimizer) -> str | None:
    return _OPTIMIZER_WRAPPERS.get(type(optimizer).__name__)


def of_frames(frame, depth: int = 40) -> str | None:
    """The framework whose loop is among the frames from `frame` outwards."""
    while frame is not None and depth:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for marker, framework in _LOOP_FILES:
            if marker in path:
                return framework
        frame, depth = frame.f_back, depth - 1
    return None
