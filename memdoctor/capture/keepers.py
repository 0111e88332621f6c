"""The user's line that keeps tensors alive: containers in the user's frames when a trace
ends (at the OOM, the frames of its traceback), and the line that adds to each.

A list that grows a tensor a step is the common leak. Where the list was made says little;
the line that appends to it is the one to change. The frames are walked once, at the end
(a walk of the referrers at every step would cost far more than the trace itself).
"""
from __future__ import annotations

import ast
import linecache
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from memdoctor.run import Run
from memdoctor.capture.frames import SourceTable, is_user_file

log = logging.getLogger("memdoctor")

ITEMS_CAP = 100_000            # items looked at per container
_CONTAINERS = (list, tuple, dict, set, deque)
_Tensor = torch.Tensor
_is_functional = torch._is_functional_tensor
_ADDERS = {"append", "extend", "insert", "appendleft", "extendleft", "add", "update", "setdefault", "put"}


@dataclass
class Held:
    """Tensors one container in a user's frame holds, and the line that adds to it."""
    file: str
    line: int
    function: str
    holder: str                                     # "history", "self.cache"
    storages: list[tuple[int, int]] = field(default_factory=list)   # (storage key, data_ptr)


def find_held(tb=None, frame=None, graphs: bool = True) -> list[Held]:
    """Containers of tensors in the user's frames: those of the traceback `tb` and the
    stack from `frame` outwards, with what the tensors' autograd graphs save unless `graphs`
    is off (a checkpointed graph recomputes its forward when its saved tensors are read).
    Never raises (a failure finds nothing)."""
    try:
        return _find_held(tb, frame, graphs)
    except Exception as exc:
        log.warning("memdoctor: looking for what keeps tensors alive failed: %r", exc)
        return []


def _find_held(tb, frame, graphs: bool) -> list[Held]:
    found: dict[tuple[str, str], Held] = {}
    for f in user_frames(tb, frame):
        code = f.f_code
        for holder, value in _namespace(f):
            try:
                storages = _storages(value, graphs)
            except Exception:       # a container of someone else's that computes its items (a lazy mapping)
                continue
            if not storages:
                continue
            key = (code.co_filename, holder)
            if key in found:
                continue
            where = _adding_line(code, holder)
            if where is None and "." in holder and not holder.startswith("self."):
                where = _method_adding_line(f.f_locals.get(holder.split(".", 1)[0]), holder.split(".", 1)[1])
            if where is None:           # made whole (a comprehension, a tuple): no line adds to it
                continue
            if isinstance(where, int):
                where = (os.path.abspath(code.co_filename), where, code.co_name)
            found[key] = Held(*where, holder, storages)
    return list(found.values())


def user_frames(tb=None, frame=None) -> list:
    """The user's frames, each once: those of the traceback `tb` (innermost last), then the
    stack from `frame` outwards."""
    frames, seen = [], set()
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    out = []
    for f in frames:
        if id(f) not in seen and is_user_file(f.f_code.co_filename):
            seen.add(id(f))
            out.append(f)
    return out


def _namespace(frame) -> list[tuple[str, Any]]:
    """(name, value) of a frame's containers, of the containers on its `self` (a module's
    too: a LightningModule's `self.validation_step_outputs`), and of those on its other
    objects whose class the user wrote (a metrics tracker, a logger)."""
    names = dict(frame.f_locals)
    out = [(k, v) for k, v in names.items() if isinstance(v, _CONTAINERS) and not k.startswith("__")]
    for name, owner in names.items():
        module = name == "self" and isinstance(owner, torch.nn.Module)    # a LightningModule's own lists
        if name.startswith("__") or (isinstance(owner, (torch.nn.Module, torch.Tensor, type)) and not module) \
                or (name != "self" and not _users_class(owner)):
            continue
        attrs = getattr(owner, "__dict__", None)
        if isinstance(attrs, dict):         # a module's own bookkeeping (`_modules`, hooks) starts with "_"
            out += [(f"{name}.{k}", v) for k, v in attrs.items()
                    if isinstance(v, _CONTAINERS) and not (module and k.startswith("_"))]
    return out


def _class_file(obj) -> str | None:
    """The file `obj`'s class is defined in, from its methods' code (a class of the script
    itself lives in a `__main__` that runpy has put back by the time the trace ends)."""
    for value in vars(type(obj)).values():
        code = getattr(value, "__code__", None)
        if code is not None:
            return code.co_filename
    return getattr(sys.modules.get(type(obj).__module__), "__file__", None)


def _users_class(obj) -> bool:
    """Whether `obj` is an instance of a class defined in the user's code."""
    filename = _class_file(obj)
    return filename is not None and is_user_file(filename)


def _method_adding_line(owner, attr: str) -> tuple[str, int, str] | None:
    """For `tracker.outputs`, the line of a method of tracker's class that adds to
    `self.outputs` (file, line, the method's name)."""
    filename = _class_file(owner)
    tree = _tree(filename) if filename else None
    if tree is None:
        return None
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == type(owner).__name__:
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = [n.lineno for n in ast.walk(method) if _adds_to(n, f"self.{attr}")]
                    if lines:
                        return os.path.abspath(filename), min(lines), method.name
    return None


def _storages(container, graphs: bool = True) -> list[tuple[int, int]]:
    """(storage key, data_ptr) of the tensors in a container, one level of nesting deep
    (a list of tuples, a dict of lists), and of what their autograd graphs still save."""
    out: list[tuple[int, int]] = []
    budget = [GRAPH_NODES_CAP if graphs else 0]

    def items(c):
        values = dict.values(c) if isinstance(c, dict) else c     # stored values: a lazy mapping loads none
        for i, v in enumerate(values):
            if i >= ITEMS_CAP:
                return
            yield v

    for value in items(container):
        inner = items(value) if isinstance(value, _CONTAINERS) else (value,)
        for t in inner:
            # a plain Tensor (no Parameter, no FakeTensor) is fake only as a functional
            # wrapper: checked directly, is_fake's longer walk kept for the subclasses
            if type(t) is _Tensor:
                if _is_functional(t) and is_fake(t):
                    continue
            elif not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or is_fake(t):
                continue
            try:
                s = t.untyped_storage()
                out.append((s._cdata, s.data_ptr()))
            except Exception:
                continue
            if t.grad_fn is not None and budget[0] > 0:
                out += _graph_storages(t.grad_fn, budget)
    return out


GRAPH_NODES_CAP = 20_000       # autograd nodes walked per container
_saved_names: dict[type, list[str]] = {}


def _graph_storages(root, budget: list[int]) -> list[tuple[int, int]]:
    """(storage key, data_ptr) of the tensors a kept tensor's autograd graph saved for a
    backward that has not freed them (a loss of an evaluation without no_grad, a graph kept
    by retain_graph=True): a list of such losses holds their activations, not 4 bytes each."""
    out: list[tuple[int, int]] = []
    seen, todo = {id(root)}, [root]
    while todo and budget[0] > 0:
        node = todo.pop()
        budget[0] -= 1
        kind = type(node)
        if kind not in _saved_names:
            _saved_names[kind] = [n for n in dir(node) if n.startswith("_saved_")]
        for name in _saved_names[kind]:
            try:
                value = getattr(node, name)
            except Exception:           # freed by a backward: the graph keeps nothing
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    try:
                        s = v.untyped_storage()
                        out.append((s._cdata, s.data_ptr()))
                    except Exception:
                        continue
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return out


# ---- the line that adds to a container --------------------------------------------------
_trees: dict[str, ast.AST | None] = {}


def _tree(filename: str) -> ast.AST | None:
    if filename not in _trees:
        text = "".join(linecache.getlines(filename))
        try:
            _trees[filename] = ast.parse(text) if text else None
        except (SyntaxError, ValueError):
            _trees[filename] = None
    return _trees[filename]


def _names(holder: str, node: ast.AST) -> bool:
    """Whether `node` is the expression `holder` ("history" or "self.history")."""
    if "." in holder:
        obj, attr = holder.split(".", 1)
        return (isinstance(node, ast.Attribute) and node.attr == attr
                and isinstance(node.value, ast.Name) and node.value.id == obj)
    return isinstance(node, ast.Name) and node.id == holder


def _adds_to(node: ast.AST, holder: str) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        return isinstance(f, ast.Attribute) and f.attr in _ADDERS and _names(holder, f.value)
    if isinstance(node, ast.AugAssign):
        return _names(holder, node.target)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Subscript) and _names(holder, t.value) for t in node.targets)
    return False


def _adding_line(code, holder: str) -> int | None:
    """The first line that adds to `holder`: within the frame's own function, else
    anywhere in its file (a global list appended to inside a function)."""
    tree = _tree(code.co_filename)
    if tree is None:
        return None
    lines = [n.lineno for n in ast.walk(tree) if _adds_to(n, holder)]
    if not lines:
        return None
    if code.co_name != "<module>":
        last = max((ln for _, _, ln in code.co_lines() if ln is not None), default=code.co_firstlineno)
        own = [ln for ln in lines if code.co_firstlineno <= ln <= last]
        if own:
            return min(own)
    return min(lines)


# ---- into the Run ------------------------------------------------------------------------
def attach_keepers(run: Run, held: list[Held], live: dict | None = None) -> None:
    """Record in `run.meta["kept_by"]` which blocks each container holds: by storage in
    the dispatch recorder's `live` table, else by address among the blocks alive at the
    end (the allocator source). Never raises."""
    if not held:
        return
    try:
        if live is None:
            at = {b.address: b.id for b in run.blocks.values() if b.free_seq is None and b.address is not None}
        table = SourceTable(run.sources)
        kept = []
        for h in held:
            ids = set()
            for key, ptr in h.storages:
                if live is not None:
                    entry = live.get(key)
                    block_id = entry.id if entry is not None else None
                else:
                    block_id = at.get(ptr)
                if block_id is not None:
                    ids.add(block_id)
            if ids:
                kept.append({"source": table.index(h.file, h.line, h.function), "holder": h.holder,
                             "blocks": sorted(ids)})
        if kept:
            run.meta.setdefault("kept_by", []).extend(kept)
    except Exception as exc:
        log.warning("memdoctor: recording what keeps tensors alive failed: %r", exc)
