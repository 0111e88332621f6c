"""Names for a model whose module paths another traced model has already (a GAN's two
nn.Sequential, CycleGAN's two generators, a generator and a discriminator that both have a
`net`): the bytes of both would add up under one name (`main.0`). It is named by the variable
or attribute the caller holds it in (`netD.main.0`, `discriminator.net.0`), else by its class
and order (`Generator#2.blocks.0`)."""
from __future__ import annotations

import sys

from memdoctor.capture.frames import is_user_file

_FRAMES = 16        # from the module call's hook out through the user's frames


def root_prefix(root, taken: set, earlier_roots: list, frame=None) -> str:
    """"" where none of `root`'s module paths is `taken` already; else "<name>." for it."""
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
