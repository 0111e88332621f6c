"""Names for a model whose module paths another traced model has already (a GAN's two
nn.Sequential, CycleGAN's two generators, a generator and a discriminator that both have a
`net`): the bytes of both would add up under one name (`main.0`). It is named by the variable
or attribute the caller holds it in (`netD.main.0`, `discriminator.net.0`), else by its class
and order (`Generator#2.blocks.0`). A model called on its own that is a part of a larger module
(a LightningModule's `training_step` calling `self.body`) is named by its path in it
(`body.layers.0`), as the user wrote it."""
from __future__ import annotations

import sys

import torch

from memdoctor.capture.frames import is_user_file

_FRAMES = 16        # from the module call's hook out through the user's frames
OWNER_WALKS = 8     # models looked for in a module holding them (a walk of the heap, ~0.1 s, each)


def root_prefix(root, taken: set, earlier_roots: list, frame=None) -> str:
    """"<path>." of `root` in a module holding it; else "" where none of `root`'s
    module paths is `taken` already; else "<name>." for it."""
    owned = _path_in_owner(root) if len(earlier_roots) < OWNER_WALKS else ""
    if owned:
        return owned + "."
    if not any(name in taken for name, _ in root.named_modules() if name):
        return ""
    same = [r for r in earlier_roots if r is not None and r is not root and type(r) is type(root)]
    frame = frame if frame is not None else sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            break
        if is_user_file(frame.f_code.co_filename):
            for name, value in frame.f_locals.items():
                if value is root and name.isidentifier() and name != "self":
                    return name + "."
            owner = frame.f_locals.get("self")
            for name, value in (getattr(owner, "_modules", None) or {}).items():
                if value is root:
                    return name + "."
        frame = frame.f_back
    return f"{type(root).__name__}#{len(same) + 1}."


def _path_in_owner(root) -> str:
    """`root`'s path in the outermost module holding it, else "". Found from the modules'
    own child lists (one walk over what the collector tracks), not from callers' frames: reading
    a frame's locals keeps its deleted tensors alive."""
    import gc
    parents = {}
    for obj in gc.get_objects():     # type(), not isinstance(): touches no lazy attributes
        if issubclass(type(obj), torch.nn.Module) and obj is not root:
            for name, child in obj._modules.items():
                if child is not None:
                    parents.setdefault(id(child), (obj, name))
    path, node = [], root
    while id(node) in parents and len(path) < 64:
        node, name = parents[id(node)]
        if node is root:
            return ""
        path.append(name)
    return ".".join(reversed(path))
