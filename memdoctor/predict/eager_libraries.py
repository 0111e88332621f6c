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

torch's `Module._apply` (behind `module.to()`, `.float()`, `.cuda()`) does not convert fake
parameters as it converts real ones. From 2.13 it swaps each for a new one, which fails once
the autograd graph holds it ("Couldn't swap Linear.weight"; models convert submodules inside
forward, Switch Transformers' router `self.classifier = self.classifier.to(self.dtype)`) and
for one converted from a real tensor (FakeTensorMode keeps a weak reference to it); up to 2.12
it sets `.data`, which leaves a FakeTensor's device where it was (pytorch#91655: XLNet's
parameters, made on the CPU by the legacy `torch.FloatTensor(...)` and moved with `.to()`,
stay there, and its first matmul with a CUDA input fails). While `eager()` is active a
module's fake parameters convert as real ones do: nothing for a conversion that changes
nothing, `.data` set for one on the same device; one moved to another device is swapped
where it can be (the object the optimizer holds stays the same), else replaced.

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
    """Module._apply that converts a module's fake parameters as torch converts real ones
    (module docstring); its children first, as torch does."""
    def _apply(self, fn, recurse=True):
        if recurse:
            for module in self.children():
                module._apply(fn)
        if not any(_fake(p) for p in self._parameters.values()):
            return original(self, fn, recurse=False)
        with torch.no_grad():
            for key, param in list(self._parameters.items()):
                if param is None:
                    continue
                applied, grad = fn(param), param.grad
                if applied is not param and applied.device == param.device:
                    param.data = applied
                elif applied is not param:
                    param = _moved(self, key, param, torch.nn.Parameter(applied, requires_grad=param.requires_grad))
                if grad is not None:
                    grad_applied = fn(grad)
                    if grad_applied is not grad and grad_applied.device == grad.device:
                        grad.data = grad_applied
                    elif grad_applied is not grad:
                        grad = grad_applied.requires_grad_(grad.requires_grad)
                    param.grad = grad
            for key, buf in self._buffers.items():
                if buf is not None:
                    self._buffers[key] = fn(buf)
        return self
    _apply._memdoctor_eager = True
    return _apply


def _moved(module, key: str, param, new):
    """`param` holding `new`'s value (swapped), or `new` in its place where it cannot swap."""
    grad, param.grad = param.grad, None         # a grad held makes the swap refuse
    try:
        torch.utils.swap_tensors(param, new)
        return param
    except RuntimeError:
        param.grad = grad
        module._parameters[key] = new
        return new


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
