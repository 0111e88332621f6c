"""Checkpointing the model turned on itself (transformers' gradient_checkpointing_enable(),
torch.utils.checkpoint around its blocks), seen as its blocks run in the forward: an OOM in the
first forward, before any backward recomputed a block, still knows it is on, and the
diagnosis does not offer it again."""
from __future__ import annotations

import sys

import torch

_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_MAX_FRAMES = 16        # from this module's caller up to a reentrant checkpoint's forward
_MAX_SEEN = 4096


class CheckpointSeen:
    """The repeated blocks of the models (found by name: `layers.3` of a list of like layers),
    and those of them seen running, or running modules, inside a checkpoint."""

    def __init__(self) -> None:
        self.blocks: dict[int, str] = {}
        self.seen: set[str] = set()

    def add_blocks(self, root: torch.nn.Module, counts: dict[str, int], prefix: str = "") -> None:
        """Each block and every module inside it, by the block's name: transformers checkpoints
        a layer's `forward`, so that only the modules inside it run inside the checkpoint."""
        for name, module in root.named_modules():
            name = prefix + name
            container, _, index = name.rpartition(".")
            if index.isdigit() and container in counts:
                for inner in module.modules():
                    self.blocks.setdefault(id(inner), name)

    def check(self, module: torch.nn.Module) -> None:
        name = self.blocks.get(id(module))
        if name is not None and name not in self.seen and len(self.seen) < _MAX_SEEN and _inside_checkpoint():
            self.seen.add(name)


def _inside_checkpoint() -> bool:
    """Inside torch.utils.checkpoint's forward: the non-reentrant kind pushes its saved-tensor
    hooks (`_checkpoint_hook`), the reentrant kind runs the function from its Function's
    forward with grad mode off."""
    if _top_saved_hooks is not None:
        hooks = _top_saved_hooks(False)
        if hooks and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook"):
            return True
    if torch.is_grad_enabled():
        return False
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_name == "forward" and frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frame = frame.f_back
    return False
