"""Activation checkpointing of a model's repeated blocks.

A checkpointed block keeps only its inputs through the forward and recomputes its
activations during backward: activation memory drops from all blocks' saved tensors to their
inputs, at the cost of about one more forward. Selective checkpointing keeps the outputs of
the expensive ops (matmuls, attention, convolutions) and recomputes only the cheap ones.

When the repeated "blocks" are single layers of a flat nn.Sequential (Conv, BN, ReLU, Conv,
...), checkpointing a layer alone saves nothing (it keeps its input, which it saved anyway):
the unit is then a segment of consecutive layers, from one repeated layer up to the next,
as torch.utils.checkpoint.checkpoint_sequential runs them.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memdoctor.remedies._handle import Handle

log = logging.getLogger("memdoctor")

_MARK = "_memdoctor_checkpoint"

_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_efficient_attention_forward",
    "_flash_attention_forward", "convolution", "_convolution",
)


def _existing_ops(names: Sequence[str]) -> frozenset:
    ops = []
    for name in names:
        try:
            ops.append(getattr(torch.ops.aten, name))
        except (AttributeError, RuntimeError):  # not in this torch build
            pass
    return frozenset(ops)


SAVED_OPS = _existing_ops(_SAVED_OP_NAMES)


class _Calls:
    """How many ops selective checkpointing's policy has been asked about: each one passes
    through a Python dispatch mode, forward and recompute, which costs CPU time per op
    (memdoctor.predict.step_time counts it)."""
    count = 0


POLICY_CALLS = _Calls()


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what is costly to recompute (matmul-like ops), recompute the rest."""
    POLICY_CALLS.count += 1
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def _same_class_group(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The largest set of children of one class; children without parameters do not count
    (checkpointing a lone activation function saves nothing worth a recompute), nor children
    without a forward of their own (a plain nn.Module holding lists, as LDM's UNet stages do:
    the parent calls their parts, never them)."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, child in module.named_children():
        if next(child.parameters(), None) is None or type(child).forward is nn.Module.forward:
            continue        # nothing to save, or never called (a plain container: its parts are)
        groups.setdefault(type(child), []).append((f"{prefix}.{name}" if prefix else name, child))
    best: list[tuple[str, nn.Module]] = []
    for group in groups.values():
        if len(group) >= 2 and len(group) > len(best):
            best = group
    return best


def _holds_list_of_blocks(candidate, candidates) -> bool:
    """Whether a list of composite modules (blocks, not single layers) lies inside a member
    of `candidate`'s group."""
    members = [m for m, _ in candidate[2]]
    return any(is_list and any(name == m or name.startswith(m + ".") for m in members)
               and any(next(child.children(), None) is not None for _, child in group)
               for name, is_list, group in candidates)


def _saved_under(parent: str, is_list: bool, group: list[tuple[str, nn.Module]],
                 saved_bytes: Mapping[str, int] | None) -> int:
    """What a run of blocks saved in a traced run: everything under its list (a flat stack is
    checkpointed in segments that take the layers between), else under its members."""
    if not saved_bytes:
        return 0
    roots = [parent] if is_list else [m for m, _ in group]
    return sum(n for path, n in saved_bytes.items()
               if any(r == "" or path == r or path.startswith(r + ".") for r in roots))


def _composite(group: list[tuple[str, nn.Module]]) -> bool:
    return bool(group) and next(group[0][1].children(), None) is not None


def find_blocks(model: nn.Module, saved_bytes: Mapping[str, int] | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a model, as (qualified name, module); empty when nothing repeats.

    Candidates are the same-class children of every module, searched recursively; a
    candidate that lies inside a member of another (the Linears of one block's MLP) is part
    of a block, not a block, unless it is a list of composite modules inside same-class
    siblings (T5's encoder and decoder stacks each hold a list of blocks). Of the rest,
    the largest run of composite modules inside a ModuleList/Sequential wins (a UNet's
    blocks, not the two Linears of its time embedding), else the largest run of single
    layers (the first on a tie); failing that, the largest group of same-class siblings
    (lists themselves, like a ResNet's stages, do not count as siblings).

    `saved_bytes` (module path -> bytes it saved for backward, from a traced run) puts the run
    that saved most ahead of the longest: a triplet net's two convolutions, whose list saves
    the feature maps, before its head's three Linears.
    """
    containers = (nn.ModuleList, nn.Sequential)
    candidates: list[tuple[str, bool, list[tuple[str, nn.Module]]]] = []
    for name, module in model.named_modules():
        is_list = isinstance(module, containers)
        group = _same_class_group(name, module)
        if group and (is_list or not isinstance(group[0][1], containers)):
            candidates.append((name, is_list, group))
    for want_list in (True, False):
        # lists inside another list's members are parts of blocks; so are lists of single
        # layers inside same-class siblings (two blocks' MLPs), but not lists of composite
        # modules (T5's encoder and decoder each hold a list of blocks)
        pool = [c for c in candidates if c[1] or not _holds_list_of_blocks(c, candidates)] \
            if want_list else candidates
        members = [m for _, _, group in pool for m, _ in group]
        outer = [(parent, is_list, group) for parent, is_list, group in pool
                 if not any(parent == m or parent.startswith(m + ".") for m in members)]
        best: list[tuple[str, nn.Module]] = []
        best_key: tuple = (False, 0, 0)
        for parent, is_list, group in outer:   # composite blocks first, then what saved most, the longest
            key = (_composite(group), _saved_under(parent, is_list, group, saved_bytes), len(group))
            if is_list == want_list and key > best_key:
                best, best_key = group, key
        if best:
            # the same block in several lists (a ResNet's stages, T5's encoder and decoder)
            kind = type(best[0][1])
            return [m for _, is_list, group in outer if is_list == want_list and type(group[0][1]) is kind
                    for m in group]
    return []


@dataclass
class Unit:
    """What one checkpoint covers: a block (`module`), or the layers `start`..`stop`-1
    of the flat nn.Sequential `parent`."""
    name: str
    module: nn.Module | None = None
    parent: nn.Sequential | None = None
    start: int = 0
    stop: int = 0


def checkpoint_units(model: nn.Module, saved_bytes: Mapping[str, int] | None = None) -> list[Unit]:
    """What `apply_checkpointing` checkpoints: the repeated blocks (find_blocks), or, when
    those are single layers of a flat nn.Sequential, segments of it, one from each
    repeated layer up to the next (the first takes the layers before it too, the last the
    layers after). Raises ValueError when the repeated layers sit in a hand-written forward,
    where no segment can be cut. `saved_bytes` as for find_blocks."""
    blocks = find_blocks(model, saved_bytes)
    if not blocks or any(next(m.children(), None) is not None for _, m in blocks):
        return [Unit(name, module) for name, module in blocks]
    modules = dict(model.named_modules())
    by_parent: dict[str, list[int]] = {}
    for name, _ in blocks:
        parent, _, index = name.rpartition(".")
        by_parent.setdefault(parent, []).append(int(index) if index.isdigit() else -1)
    units: list[Unit] = []
    for parent_name, indices in by_parent.items():
        parent = modules.get(parent_name)
        if not isinstance(parent, nn.Sequential) or type(parent).forward is not nn.Sequential.forward \
                or min(indices) < 0:
            raise ValueError(f"the repeated layers of {type(model).__name__} ({blocks[0][0]}, ...) are single "
                             "layers called by a hand-written forward: checkpointing one alone saves nothing")
        starts = sorted(indices)
        starts[0] = 0
        stops = starts[1:] + [len(parent)]
        prefix = f"{parent_name}." if parent_name else ""
        units += [Unit(f"{prefix}{a}" if b - a == 1 else f"{prefix}{a}..{b - 1}", None, parent, a, b)
                  for a, b in zip(starts, stops)]
    return units


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), _MARK, False)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _running_stats_kept(modules: Sequence[nn.Module]):
    """A recompute runs batch norms in training mode again, which would update their
    running statistics a second time: put them back as the forward left them. The copies
    are made outside the dispatch modes (selective checkpointing's policy would take them
    for ops the forward did not run)."""
    bufs = [buf for mod in modules for m in mod.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
            for buf in (m.running_mean, m.running_var, m.num_batches_tracked) if buf is not None]
    with _disable_current_modes(), torch.no_grad():
        saved = [buf.clone() for buf in bufs]
    try:
        yield
    finally:
        with _disable_current_modes(), torch.no_grad():
            for buf, value in zip(bufs, saved):
                buf.copy_(value)


def _recomputable(forward: Callable, modules: Sequence[nn.Module]) -> Callable:
    """`forward`, which in backward (the recompute) leaves batch-norm statistics alone."""
    if not any(isinstance(m, nn.modules.batchnorm._NormBase) for mod in modules for m in mod.modules()):
        return forward

    def run(*args, **kwargs):
        if not _in_backward():
            return forward(*args, **kwargs)
        with _running_stats_kept(modules):
            return forward(*args, **kwargs)
    return run


def _checkpointed(forward: Callable, context_fn: Callable | None, module: nn.Module | None = None) -> Callable:
    extra = {} if context_fn is None else {"context_fn": context_fn}
    inner = forward if module is None else _recomputable(forward, [module])

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        fn = functools.partial(inner, **kwargs) if kwargs else inner
        return checkpoint(fn, *args, use_reentrant=False, **extra)

    return WrappedForward(run, forward)


def _segmented(parent: nn.Sequential, units: list[Unit], chosen: set[int], context_fn: Callable | None) -> Callable:
    """A forward for the flat nn.Sequential `parent` that runs its `units` (segments
    covering it in order), the `chosen` ones under checkpoint."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    layers = list(parent)

    def segment(unit: Unit) -> Callable:
        def run(x):
            for layer in layers[unit.start:unit.stop]:
                x = layer(x)
            return x
        return _recomputable(run, layers[unit.start:unit.stop])
    runs = [segment(u) for u in units]

    def forward(x):
        if not torch.is_grad_enabled():
            return nn.Sequential.forward(parent, x)
        for i, run in enumerate(runs):
            x = checkpoint(run, x, use_reentrant=False, **extra) if i in chosen else run(x)
        return x

    return WrappedForward(forward, parent.forward)


class WrappedForward:
    """A forward memdoctor put on a module: it runs `run`. The module pickles and copies
    without it (`_install`), so `torch.save(model)` and `copy.deepcopy(model)` (an EMA copy)
    keep working and what they make runs the plain forward."""

    def __init__(self, run: Callable, wrapped: Callable):
        self._run, self.__wrapped__ = run, wrapped
        setattr(self, _MARK, True)

    def __call__(self, *args, **kwargs):
        return self._run(*args, **kwargs)


def _install(module: nn.Module, forward: WrappedForward) -> tuple:
    """Put `forward` on `module`, and a `__getstate__` of its own that pickles and copies the
    module without it: a script's `torch.load(weights_only=True)` of its whole model allows
    the globals it lists, never memdoctor's. Returns what `undo` needs."""
    undo = (module, "forward" in module.__dict__, module.__dict__.get("forward"))
    module.forward = forward
    object.__setattr__(module, "__getstate__", functools.partial(_state_without_forward, module, *undo[1:]))
    return undo


def _state_without_forward(module: nn.Module, had_own: bool, previous) -> dict:
    state = type(module).__getstate__(module)
    state.pop("__getstate__", None)
    if had_own:
        state["forward"] = previous
    else:
        state.pop("forward", None)
    return state


def _turn_off_kv_caches(model: nn.Module) -> list:
    """Set `config.use_cache = False` on the model's (transformers-style) configs that have
    it on; returns those configs.

    A key/value cache filled in the forward is filled again by the recompute: full
    checkpointing then keeps a second copy of every block's keys and values, and
    selective checkpointing fails (the recompute runs ops the forward did not).
    transformers' own gradient_checkpointing_enable() turns the cache off for the same reason.
    """
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    return list(configs.values())


def apply_checkpointing(
    model: nn.Module,
    mode: Union[str, int] = "full",
    *,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
    saved_bytes: Mapping[str, int] | None = None,
) -> Handle:
    """Checkpoint the model's blocks: "full", "selective", or an int n for the first n blocks.

    The units are `checkpoint_units(model)` (blocks, or segments of a flat Sequential);
    `blocks` overrides them with modules of your choosing; `saved_bytes` (module path -> bytes
    saved for backward in a traced run) picks, of several runs of blocks, the one that saved
    most. The blocks' `forward` (a flat Sequential's own) is wrapped per instance, so undo
    restores exactly what was there.
    """
    if mode == "full" or mode == "selective":
        count = None
    elif isinstance(mode, int) and not isinstance(mode, bool) and mode >= 0:
        count = mode
    else:
        raise ValueError(f"checkpointing mode must be 'full', 'selective' or a block count >= 0, not {mode!r}")
    found = checkpoint_units(model, saved_bytes) if blocks is None else [Unit(n, m) for n, m in blocks]
    if not found:
        raise ValueError(f"no repeated blocks found in {type(model).__name__}; pass blocks=[(name, module), ...]")
    chosen = found if count is None else found[:count]
    for unit in chosen:
        if is_checkpointed(unit.module or unit.parent):
            raise ValueError(f"{unit.name} is already checkpointed")
    context_fn = selective_context if mode == "selective" else None
    wrapped = []
    for unit in chosen:
        if unit.module is not None:
            block = unit.module
            wrapped.append(_install(block, _checkpointed(block.forward, context_fn, block)))
    for parent in {id(u.parent): u.parent for u in chosen if u.parent is not None}.values():
        units = [u for u in found if u.parent is parent]
        picked = {i for i, u in enumerate(units) if any(u is c for c in chosen)}
        wrapped.append(_install(parent, _segmented(parent, units, picked, context_fn)))
    caches = _turn_off_kv_caches(model) if chosen else []

    def undo() -> None:
        for config in caches:
            config.use_cache = True
        for block, had_own, previous in reversed(wrapped):
            del block.__dict__["__getstate__"]
            if had_own:
                block.forward = previous
            else:
                del block.forward

    kind = "selective" if mode == "selective" else "full"
    what = "segments of layers" if found[0].parent is not None else "blocks"
    names = (chosen[0].name if len(chosen) == 1 else f"{chosen[0].name} .. {chosen[-1].name}") if chosen else "none"
    cache_note = ", key/value cache off" if caches else ""
    handle = Handle(f"{kind} checkpointing of {len(chosen)} of {len(found)} {what} ({names}){cache_note}", undo)
    log.info("memdoctor: %s", handle.description)
    return handle


def predicted_peak(
    per_block_saved_bytes: Sequence[int],
    other_peak_bytes: int,
    checkpointed: int,
    input_bytes: Sequence[int],
    recompute_extra_bytes: Sequence[int] | None = None,
) -> int:
    """Peak with the first `checkpointed` blocks checkpointed.

    Two moments can be the peak: the start of backward (checkpointed blocks hold only their
    inputs, the others all they saved) and the recompute of a checkpointed block i during
    backward (the later blocks are already freed; the inputs of blocks 0..i-1 and block i's
    recomputed tensors, its input among them, are live). So checkpointing the last block
    never lowers the peak: it is recomputed as soon as backward starts. `other_peak_bytes`
    is counted at both moments, which is conservative when the rest of the peak comes at
    another moment. `recompute_extra_bytes` (per block, default none) is what a block's
    forward holds for a moment beyond what it saves (a batch norm's output before the ReLU
    after it), which its recompute holds on top of the rest.
    """
    saved = list(per_block_saved_bytes)
    extra = list(recompute_extra_bytes) if recompute_extra_bytes is not None else [0] * len(saved)
    n = checkpointed
    at_backward = sum(input_bytes[:n]) + sum(saved[n:])
    at_recompute = max((sum(input_bytes[:i]) + saved[i] + extra[i] for i in range(n)), default=0)
    return other_peak_bytes + max(at_backward, at_recompute)


def blocks_to_fit(
    per_block_saved_bytes: Sequence[int],
    other_peak_bytes: int,
    budget_bytes: int,
    input_bytes: Sequence[int] | int | None = None,
) -> int:
    """The fewest leading blocks to checkpoint ("ckpt=n") so the predicted peak fits.

    Checkpointing block i saves its saved bytes minus its input bytes (a negative saving
    when the block did not save its input). `input_bytes` (per
    block, or one size for all) is estimated, when not given, as half of what the block
    saves: a block saves at least its input and one intermediate of like size, so this
    overstates the input for most blocks and errs towards checkpointing more. Raises
    ValueError when checkpointing every block is not enough.
    """
    saved = [int(b) for b in per_block_saved_bytes]
    if input_bytes is None:
        inputs = [b // 2 for b in saved]
    elif isinstance(input_bytes, int):
        inputs = [input_bytes] * len(saved)
    else:
        inputs = [int(b) for b in input_bytes]
        if len(inputs) != len(saved):
            raise ValueError(f"{len(inputs)} input sizes for {len(saved)} blocks")
    for n in range(len(saved) + 1):
        if predicted_peak(saved, other_peak_bytes, n, inputs) <= budget_bytes:
            return n
    best = predicted_peak(saved, other_peak_bytes, len(saved), inputs)
    raise ValueError(
        f"checkpointing all {len(saved)} blocks gives a predicted peak of {best} bytes, "
        f"over the budget of {budget_bytes} bytes"
    )
