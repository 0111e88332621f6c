"""Activation checkpointing of a model's repeated blocks.

A checkpointed block keeps only its inputs through the forward and recomputes its
activations during backward: activation memory drops from all blocks' saved tensors to their
inputs, at the cost of about one more forward. Selective checkpointing keeps the outputs of
the expensive ops (matmuls, attention, convolutions) and recomputes only the cheap ones.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence, Union

import torch
from torch import nn
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
    (checkpointing a lone activation function saves nothing worth a recompute)."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, child in module.named_children():
        if next(child.parameters(), None) is None:
            continue
        groups.setdefault(type(child), []).append((f"{prefix}.{name}" if prefix else name, child))
    best: list[tuple[str, nn.Module]] = []
    for group in groups.values():
        if len(group) >= 2 and len(group) > len(best):
            best = group
    return best


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a model, as (qualified name, module); empty when nothing repeats.

    Candidates are the same-class children of every module, searched recursively; a
    candidate that lies inside a member of another (the Linears of one block's MLP) is part
    of a block, not a block. Of the rest, the largest run inside a ModuleList/Sequential
    wins (the first on a tie); failing that, the largest group of same-class siblings
    (lists themselves, like a ResNet's stages, do not count as siblings).
    """
    containers = (nn.ModuleList, nn.Sequential)
    candidates: list[tuple[str, bool, list[tuple[str, nn.Module]]]] = []
    for name, module in model.named_modules():
        is_list = isinstance(module, containers)
        group = _same_class_group(name, module)
        if group and (is_list or not isinstance(group[0][1], containers)):
            candidates.append((name, is_list, group))
    members = [m for _, _, group in candidates for m, _ in group]
    outer = [
        (is_list, group) for parent, is_list, group in candidates
        if not any(parent == m or parent.startswith(m + ".") for m in members)
    ]
    for want_list in (True, False):
        best: list[tuple[str, nn.Module]] = []
        for is_list, group in outer:
            if is_list == want_list and len(group) > len(best):
                best = group
        if best:
            return best
    return []


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), _MARK, False)


def _checkpointed(forward: Callable, context_fn: Callable | None) -> Callable:
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        fn = functools.partial(forward, **kwargs) if kwargs else forward
        return checkpoint(fn, *args, use_reentrant=False, **extra)

    run.__wrapped__ = forward
    setattr(run, _MARK, True)
    return run


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
) -> Handle:
    """Checkpoint the model's blocks: "full", "selective", or an int n for the first n blocks.

    `blocks` overrides `find_blocks(model)`. The blocks' `forward` is wrapped per instance,
    so undo restores exactly what was there.
    """
    if mode == "full" or mode == "selective":
        count = None
    elif isinstance(mode, int) and not isinstance(mode, bool) and mode >= 0:
        count = mode
    else:
        raise ValueError(f"checkpointing mode must be 'full', 'selective' or a block count >= 0, not {mode!r}")
    found = list(find_blocks(model) if blocks is None else blocks)
    if not found:
        raise ValueError(f"no repeated blocks found in {type(model).__name__}; pass blocks=[(name, module), ...]")
    chosen = found if count is None else found[:count]
    for name, block in chosen:
        if is_checkpointed(block):
            raise ValueError(f"{name} is already checkpointed")
    context_fn = selective_context if mode == "selective" else None
    wrapped = []
    for _, block in chosen:
        had_own = "forward" in block.__dict__
        wrapped.append((block, had_own, block.__dict__.get("forward")))
        block.forward = _checkpointed(block.forward, context_fn)
    caches = _turn_off_kv_caches(model) if chosen else []

    def undo() -> None:
        for config in caches:
            config.use_cache = True
        for block, had_own, previous in reversed(wrapped):
            if had_own:
                block.forward = previous
            else:
                del block.forward

    kind = "selective" if mode == "selective" else "full"
    names = f"{chosen[0][0]} .. {chosen[-1][0]}" if chosen else "none"
    cache_note = ", key/value cache off" if caches else ""
    handle = Handle(f"{kind} checkpointing of {len(chosen)} of {len(found)} blocks ({names}){cache_note}", undo)
    log.info("memdoctor: %s", handle.description)
    return handle


def predicted_peak(
    per_block_saved_bytes: Sequence[int],
    other_peak_bytes: int,
    checkpointed: int,
    input_bytes: Sequence[int],
) -> int:
    """Peak with the first `checkpointed` blocks checkpointed.

    Two moments can be the peak: the start of backward (checkpointed blocks hold only their
    inputs, the others all they saved) and the recompute of a checkpointed block i during
    backward (the later blocks are already freed; the inputs of blocks 0..i-1 and block i's
    recomputed tensors, its input among them, are live). So checkpointing the last block
    never lowers the peak: it is recomputed as soon as backward starts. `other_peak_bytes`
    is counted at both moments, which is conservative when the rest of the peak comes at
    another moment.
    """
    saved = list(per_block_saved_bytes)
    n = checkpointed
    at_backward = sum(input_bytes[:n]) + sum(saved[n:])
    at_recompute = max((sum(input_bytes[:i]) + saved[i] for i in range(n)), default=0)
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
