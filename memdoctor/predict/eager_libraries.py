"""Libraries that change their code path when they see a fake tensor are told they run
eagerly while the fake step runs, so that the step the estimate measures is the one a GPU runs.

transformers asks `is_tracing(tensor)` (transformers.utils.import_utils) before reading a
value: a FakeTensor counts as tracing, and then an all-ones attention mask is never dropped
(the real run drops it and calls attention with is_causal, and with grouped-query heads
enable_gqa=True), so the fake step would run other attention kernels than the GPU does.
While `eager()` is active that check says no for fake tensors; the values it then reads
come from memdoctor.predict.data_dependent (known, or assumed and noted).

TorchScript functions (transformers' DeBERTa-v2 up to 5.17 scripts its relative-position
buckets) run, once profiled, as fused kernels that read their inputs' memory directly: on
fake tensors that memory does not exist, and a GPU reports an illegal memory access (the
H200 did, for DeBERTa-v2 in bf16, after real steps in the same process). While `eager()` is
active a module's scripted functions are replaced by the Python functions they were
scripted from (torch keeps them as `_torchdynamo_inline`), so their ops run one at a time
on any thread, backward's included; the rest of TorchScript runs unoptimized and unfused.
The memory is the same but for a fused kernel's temporaries.

torch's `Module._apply` (behind `module.to()`, `.float()`, `.cuda()`) swaps a fake parameter
for a new one, which fails once the autograd graph holds it ("Couldn't swap Linear.weight"),
where a real parameter gets its `.data` set. Models convert submodules inside forward
(Switch Transformers' router: `self.classifier = self.classifier.to(self.dtype)`, most often
to the dtype it has). While `eager()` is active, where torch cannot swap them, a module's fake
parameters convert as real ones do: nothing for a conversion that changes nothing, `.data` set
for one that does.

A real 0-d tensor formats as its value (`f"expert_{idx}"` is "expert_3"); a fake one as its
repr, since `Tensor.__format__` reads the value only of an exact torch.Tensor. Switch
Transformers names the expert to run that way. While `eager()` is active a 0-d fake tensor
formats as its value, read as `.item()` reads it (memdoctor.predict.data_dependent).
"""
from __future__ import annotations

import contextlib
import sys

import torch

__all__ = ["eager"]


class _Eager:
    """The patches in place, and how to undo them."""

    def __init__(self) -> None:
        self.undo: list = []

    def refresh(self) -> None:
        """Patch the libraries imported since (a build imports them inside the estimate)."""
        _flush_torchscript_plans()
        self._unscript()
        utils = sys.modules.get("transformers.utils.import_utils")
        if utils is not None and getattr(utils, "is_fake_tensor", None) is not None \
                and not getattr(utils.is_fake_tensor, "_memdoctor_eager", False):
            original = utils.is_fake_tensor

            def is_fake_tensor(x) -> bool:
                return False
            is_fake_tensor._memdoctor_eager = True
            utils.is_fake_tensor = is_fake_tensor
            self.undo.append(lambda: setattr(utils, "is_fake_tensor", original))

    def _unscript(self) -> None:
        """Each module-level scripted function of a loaded library, as its Python original."""
        for names, name, value in _script_functions():
            original = getattr(value, "_torchdynamo_inline", None)
            if callable(original):
                names[name] = original
                self.undo.append(lambda names=names, name=name, value=value: names.__setitem__(name, value))

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()


@contextlib.contextmanager
def _no_fusion():
    """TorchScript's fusers off (torch.jit.fuser("none") without its deprecation warnings)."""
    c = torch._C
    old = (c._jit_can_fuse_on_cpu(), c._jit_can_fuse_on_gpu(), c._jit_texpr_fuser_enabled(), c._jit_llga_enabled())
    c._jit_override_can_fuse_on_cpu(False)
    c._jit_override_can_fuse_on_gpu(False)
    c._jit_set_texpr_fuser_enabled(False)
    c._jit_set_llga_enabled(False)
    try:
        yield
    finally:
        c._jit_override_can_fuse_on_cpu(old[0])
        c._jit_override_can_fuse_on_gpu(old[1])
        c._jit_set_texpr_fuser_enabled(old[2])
        c._jit_set_llga_enabled(old[3])


def _script_functions():
    """(module namespace, name, function) of every module-level TorchScript function loaded."""
    script_function = torch.jit.ScriptFunction
    for module in list(sys.modules.values()):
        try:
            names = vars(module)
        except TypeError:
            continue
        for name, value in list(names.items()):
            if type(value) is script_function:     # never the value's own __class__ (lazy objects warn)
                yield names, name, value


def _flush_torchscript_plans() -> None:
    """Forget the plans TorchScript functions of loaded modules cached (fused ones, from real
    runs earlier in this process, would run on the fake tensors); they profile again."""
    for _names, _name, value in _script_functions():
        try:
            value._debug_flush_compilation_cache()
        except Exception:
            pass


def _fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _apply_as_on_real_tensors(original):
    """Module._apply that, where torch cannot swap a module's fake parameters, converts them as
    torch converts real ones: nothing for a conversion that changes nothing, `.data` set
    otherwise. Its children are converted by then (torch converts them first)."""
    def _apply(self, fn, recurse=True):
        try:
            return original(self, fn, recurse)
        except RuntimeError as exc:
            own = [t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None]
            if "Couldn't swap" not in str(exc) or not own or not all(_fake(t) for t in own):
                raise
        with torch.no_grad():
            for param in self._parameters.values():
                if param is None:
                    continue
                applied = fn(param)
                if applied is not param:
                    param.data = applied
                grad = param.grad
                if grad is not None:
                    applied = fn(grad)
                    if applied is not grad:
                        grad.data = applied
            for key, buf in self._buffers.items():
                if buf is not None:
                    self._buffers[key] = fn(buf)
        return self
    _apply._memdoctor_eager = True
    return _apply


def _format_as_on_real_tensors(original):
    """Tensor.__format__ that formats a 0-d fake tensor as its value, as a real one formats."""
    def __format__(self, format_spec):
        if _fake(self) and self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return original(self, format_spec)
    __format__._memdoctor_eager = True
    return __format__


def _patch(owner, name: str, make, undo: list) -> None:
    original = getattr(owner, name)
    if not getattr(original, "_memdoctor_eager", False):
        setattr(owner, name, make(original))
        undo.append(lambda: setattr(owner, name, original))


@contextlib.contextmanager
def eager():
    """Until the block ends, libraries see eager tensors where they look for fake ones; call
    `.refresh()` on what it yields after importing more of them."""
    state = _Eager()
    state.refresh()
    _patch(torch.nn.Module, "_apply", _apply_as_on_real_tensors, state.undo)
    _patch(torch.Tensor, "__format__", _format_as_on_real_tensors, state.undo)
    try:
        with torch.jit.optimized_execution(False), _no_fusion():
            yield state
    finally:
        state.restore()
        _flush_torchscript_plans()
