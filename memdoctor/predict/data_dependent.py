"""Data-dependent operations on fake tensors: values the build made are kept and computed for
real, the rest are assumed or bounded from above, and each assumption is noted.

A fake tensor has a shape but no data, so an op whose result depends on the data (`.item()`,
`bool(mask.all())`, `nonzero`, `x[mask]`, `unique`, ...) cannot run on it. A training step
needs them all the same: transformers checks `attention_mask.all()` to drop a mask, reads
`labels.max()`, selects the CTC targets with `labels.masked_select(labels >= 0)`; a
mixture of experts finds each expert's tokens with `torch.where(expert_mask[e])`.

DataDependent is a dispatch mode, entered just inside FakeTensorMode (under the tracer, which
sees only what it returns), that keeps a real CPU copy (a shadow) of each small tensor whose
values are known: made by a factory (`ones`, `arange`, `randint`, `torch.tensor`), a real
tensor handed in, or an op on known tensors. Integer and bool tensors up to MAX_INT_NUMEL
elements are kept, floating ones up to MAX_FLOAT_NUMEL (masks and positions, not
activations). A data-dependent op on known values gets the real answer, and a fake output of
that shape. On unknown values:

- an index chosen from activations (`topk`, `argmax`, `sort`: a router's choice of experts,
  a sampled token) is assumed spread evenly over the candidates, so what follows from it
  (one expert's share of the tokens) is the mean;
- a Python scalar read from them (`.item()`, `bool(...)`, `torch.equal`) is taken as 0 /
  False: the branch of a step with nothing unusual (no inf in the loss scaler's check, no
  sample outside a truncated normal's bounds);
- an output whose size depends on them (`nonzero`, `masked_select`, boolean indexing,
  `unique`) is bounded from above: every element selected. Those positions stand for a bound,
  not for the real ones: two selections a real run keeps apart (a sampler's positives and
  negatives) may overlap in them, so the union of masks made from them (`pos | neg`) counts
  as many elements as the two hold together (up to all of them): never fewer than the real
  union. The masks `x == 0`, `x == 1`, ... of one unknown tensor (a box's pyramid level) split
  its elements between them: the first selected takes them all, the others what is left (an
  upper bound where each part makes tensors of one size per element, as a pooler's levels do).

Ops whose fake kernel refuses what the real one runs (`_grouped_mm` on fp32, fake-only
checks for bf16) are run on bf16 stand-ins for their shape. `notes()` says which ops made the
estimate uncertain.
"""
from __future__ import annotations

import os
import sys

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from memdoctor.capture.lean_mode import DEVICE_QUERY, LeanDispatchMode, device_query
from memdoctor.predict.fake_outputs import OutputMemo, memoizable
from memdoctor.predict.fake_views import is_plain_view, view_of_fakes
from memdoctor.predict.finite_checks import FINITE_CHECKS, finite_answer
from memdoctor.predict.mask_unions import UNIONS, mask_elements, plain_tensors, union_bound
from memdoctor.predict.random_draws import (COMPARISONS, MAX_DRAW_VARIANTS, RANDOM_DRAWS, UNIFORM_DRAWS,
                                           compare_range, span)

__all__ = ["DataDependent", "MAX_INT_NUMEL", "MAX_FLOAT_NUMEL"]

MAX_INT_NUMEL = 1 << 24          # integer / bool tensors: masks, ids, labels, positions, routing
MAX_FLOAT_NUMEL = 1 << 16        # floating tensors: a mask's additive form, rotary tables; not activations
MAX_STAND_IN_NUMEL = 1 << 26     # zeros standing in for unknown inputs, for an output's shape

# ops whose output size follows from values: bounded by their input's size when unknown
# (non-maximum suppression keeps at most every box)
_SIZE_FROM_VALUES = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                     "unique_dim_consecutive", "_unique", "argwhere", "nms", "qnms"}
# ops that pick indices from values: assumed spread evenly when their input is unknown
_CHOOSERS = {"topk", "argmax", "argmin", "sort", "argsort", "max", "min", "kthvalue", "mode", "multinomial"}
# an output bounded from above carries "bound:aten.<op>" among its assumptions
_BOUND = "bound:"
# checks that only assert on values (torch._assert_async, torch._check on tensors)
_ASSERTS = {"_assert_async", "_functional_assert_async", "_assert_scalar", "_functional_assert_scalar",
            "_assert_tensor_metadata"}
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
             "<frozen", "contextlib.py")
# ops whose output values do not depend on their tensor inputs' values (only on their shapes)
_VALUE_FREE = {"zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full",
               "new_empty", "new_empty_strided", "rand_like", "randn_like", "randint_like"}
# fake kernels stricter than the real ones: run on stand-ins of this dtype for the shape
_DTYPE_STAND_INS = {"_grouped_mm": torch.bfloat16}
# ops whose dispatch here notes more than their outputs' shapes: never answered from the memo
_NOT_MEMOIZED = _CHOOSERS | _VALUE_FREE | _ASSERTS | set(_DTYPE_STAND_INS) | RANDOM_DRAWS | {"eq", "ne"} | set(FINITE_CHECKS)


def _device_to_cpu(x):
    if isinstance(x, torch.device) and x.type != "cpu":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith(("cuda", "meta")):
        return "cpu"
    return x


def _where() -> str:
    """The innermost caller outside torch and memdoctor: the line whose op read a value."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_INTERNAL) and not path.startswith("<"):
            parts = path.replace("\\", "/").split("/")
            short = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else parts[-1]
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "an unknown line"


_real = plain_tensors      # plain tensors: no dispatch mode (FakeTensorMode among them) sees inside


def _small(t: torch.Tensor) -> bool:
    limit = MAX_FLOAT_NUMEL if (t.is_floating_point() or t.is_complex()) else MAX_INT_NUMEL
    return t.numel() <= limit


class DataDependent(LeanDispatchMode):
    """Known values of small tensors, and answers for data-dependent ops (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()      # fake tensor -> real CPU tensor
        self.assumed: WeakIdKeyDictionary = WeakIdKeyDictionary()     # fake tensor -> ops it was assumed from
        self.stale: set[int] = set()       # storages written with unknown values since their shadow was made
        # small fake tensors made of random draws -> their values' range (low, high), or None
        self.drawn: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.parts: WeakIdKeyDictionary = WeakIdKeyDictionary()       # mask `x == k` on unknown x -> (x, k)
        self.shares: WeakIdKeyDictionary = WeakIdKeyDictionary()      # that x -> {k: elements its mask selects}
        self._notes: dict[str, str] = {}
        self._info: dict = {}               # op -> _op_info's tuple
        self.outputs = OutputMemo()         # functional ops' outputs by their arguments' metadata
        self.noting = True                  # off while the model is built: its initial values do not matter
        self.branches = 0                   # branches decided by a random draw in this step so far
        self.flips: frozenset[int] = frozenset()    # those answered the other way in this step

    # ------------------------------------------------------------------ values
    def value(self, t) -> torch.Tensor | None:
        """The real values of `t` (a real tensor is its own), or None when unknown."""
        if not isinstance(t, torch.Tensor):
            return None
        if not isinstance(t, FakeTensor):
            return t
        real = self.values.get(t)
        if real is None or (self.stale and self._storage(t) in self.stale):
            return None
        return real

    def remember(self, fake: torch.Tensor, real: torch.Tensor, assumed: frozenset = frozenset()) -> None:
        """Keep `real` (moved to the CPU) as the values of `fake`, if it is small enough."""
        if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and _small(fake) \
                and tuple(real.shape) == tuple(fake.shape):
            with _real():
                self.values[fake] = real.detach().to("cpu")
            if assumed:
                self.assumed[fake] = assumed
            if self.stale:
                self.stale.discard(self._storage(fake))

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """`t.detach()` made without dispatch where it can be (memdoctor.predict.fake_views),
        for the saved-tensor hook's alias: through the dispatch modes a detach costs as much as
        any op, and autograd saves several tensors per op. Same storage and version counter, no
        history; `t`'s known values are the alias's."""
        alias = view_of_fakes(torch.ops.aten.detach.default, (t,), {})
        if alias is None:
            return t.detach()
        real = self.value(t)
        if real is not None:
            self.values[alias] = real
            assumed = self.assumed.get(t)
            if assumed:
                self.assumed[alias] = assumed
        elif self.noting and len(self.drawn) and t in self.drawn:
            self.drawn[alias] = None        # as a detach's output: drawn, its range unknown
        return alias

    @staticmethod
    def _storage(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage()._cdata
        except Exception:
            return -1

    def notes(self) -> list[str]:
        """What the estimate assumed about values it does not know, one line per op."""
        return list(self._notes.values())

    def begin_step(self, flips=()) -> None:
        """A new training step: its branches decided by random draws are counted from 0, and
        those numbered in `flips` take the other branch (a layer LayerDrop skips)."""
        self.branches = 0
        self.flips = frozenset(flips)

    def _note(self, key: str, text: str) -> None:
        if self.noting:
            self._notes.setdefault(key, text)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:        # a tensor's device is no value it needs
            return device_query(args)
        kwargs = kwargs or {}
        name, mutable, view, memo = self._op_info(func)
        if name in _ASSERTS:
            return None
        if view:
            out = self.fast_view(func, args, kwargs)
            if out is not None:
                return out
        known = self._all_known(args, kwargs)
        if not known and name in _VALUE_FREE:          # only the shapes matter: zeros stand in
            known = True
        if known and self.noting and name in RANDOM_DRAWS:
            known = False
        key = None
        if memo and not known and not (self.noting and len(self.drawn) and self._any_drawn(args)):
            key = self.outputs.key(func, args, kwargs)     # nothing below to note: the outputs' shapes suffice
            if key is not None:
                out = self.outputs.get(key)
                if out is not None:
                    return out
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            flat, spec, tensors, reals = self._inputs(args, kwargs, name in _VALUE_FREE)
            return self._data_dependent(func, name, args, kwargs, flat, spec, tensors, reals,
                                        all(r is not None for r in reals))
        except RuntimeError:
            if name not in _DTYPE_STAND_INS:
                raise
            return self._with_stand_ins(func, args, kwargs, _DTYPE_STAND_INS[name])
        if known:
            flat, spec, tensors, reals = self._inputs(args, kwargs, name in _VALUE_FREE)
            self._shadow(func, name, args, kwargs, flat, spec, tensors, reals, out)
        else:
            if mutable:
                self._mark_written(func, args, kwargs)
            finite = finite_answer(name, args)          # memdoctor.predict.finite_checks
            if name in _CHOOSERS:
                self._assume_spread(func, name, args, out)
            elif finite is not None:
                self._assume_finite(name, out, finite)
            elif name == "eq":
                self._note_part(args, out)
            if self.noting and (name in RANDOM_DRAWS or (len(self.drawn) and self._any_drawn(args))):
                if name in COMPARISONS and self._decided(name, args, out):
                    return out
                bounds = span(name, args) if name in UNIFORM_DRAWS else None
                for o in tree_flatten(out)[0]:
                    if isinstance(o, FakeTensor) and _small(o):
                        self.drawn[o] = bounds
        if key is not None:
            self.outputs.store(key, args, kwargs, out)
        return out

    def _op_info(self, func) -> tuple[str, bool, bool, bool]:
        """(its name, whether it writes an argument, whether it is a plain view, whether its
        outputs may be memoized), kept per op."""
        info = self._info.get(func)
        if info is None:
            name = func.overloadpacket.__name__
            info = self._info[func] = (name, func._schema.is_mutable, is_plain_view(func),
                                       memoizable(func) and name not in _NOT_MEMOIZED)
        return info

    def fast_view(self, func, args, kwargs):
        """A view of fake tensors whose values are not known, made without dispatch
        (memdoctor.predict.fake_views); None for any other op, and for a view of known values,
        which dispatch shadows. The kernel watch calls it first: a view allocates nothing, and
        no mode below has anything to note of it."""
        if not self._op_info(func)[2] or self._all_known(args, kwargs):
            return None
        out = view_of_fakes(func, args, kwargs)
        if out is not None and self.noting and len(self.drawn) and self._any_drawn(args) and _small(out):
            self.drawn[out] = None      # a view of random draws, its range unknown
        return out

    def _decided(self, name: str, args, out) -> bool:
        """Keep the answer of `draw < c` (<=, >, >=) as known values where the draw's range
        decides it: a branch that cannot go either way is not one the estimate varies."""
        if len(args) != 2 or not isinstance(args[0], FakeTensor) or not isinstance(out, FakeTensor) \
                or isinstance(args[1], bool) or not isinstance(args[1], (int, float)):
            return False
        bounds = self.drawn.get(args[0])
        if bounds is None:
            return False
        answer = compare_range(name, bounds[0], bounds[1], float(args[1]))
        if answer is None:
            return False
        with _real():
            real = torch.full(tuple(out.shape), answer, dtype=torch.bool)
        self.remember(out, real)
        return True

    def _any_drawn(self, args) -> bool:
        """Whether a tensor argument was made of random draws (a LayerDrop's `torch.rand([])`)."""
        for a in args:
            if isinstance(a, FakeTensor) and a in self.drawn:
                return True
        return False

    def _all_known(self, args, kwargs) -> bool:
        """Whether every tensor argument's values are known (stops at the first that is not)."""
        for group in (args, kwargs.values()):
            for a in group:
                if isinstance(a, torch.Tensor):
                    if self.value(a) is None:
                        return False
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        if isinstance(t, torch.Tensor) and self.value(t) is None:
                            return False
        return True

    def _inputs(self, args, kwargs, shapes_only: bool):
        """(flat arguments, their structure, the tensors, their real values or None); with
        `shapes_only`, zeros of the right shape (and no memory) for the unknown ones."""
        flat, spec = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        reals = [self.value(t) for t in tensors]
        if shapes_only:
            with _real():
                reals = [r if r is not None else torch.zeros((), dtype=t.dtype).expand(tuple(t.shape))
                         for t, r in zip(tensors, reals)]
        return flat, spec, tensors, reals

    def _assumptions(self, tensors) -> frozenset:
        found: frozenset = frozenset()
        for t in tensors:
            a = self.assumed.get(t) if isinstance(t, FakeTensor) else None
            if a:
                found = found | a
        return found

    def _real_call(self, func, flat, spec, tensors, reals):
        """func on the real values (CPU), outside every mode."""
        swap = {id(t): r for t, r in zip(tensors, reals)}
        real_flat = [swap.get(id(x), x) if isinstance(x, torch.Tensor) else _device_to_cpu(x) for x in flat]
        real_args, real_kwargs = tree_unflatten(real_flat, spec)
        with _real():
            return func(*real_args, **real_kwargs)

    def _shadow(self, func, name, args, kwargs, flat, spec, tensors, reals, out) -> None:
        """Run an op on the real values of its known inputs: its small outputs are known
        too, and what it writes in place stays known."""
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not all(isinstance(o, FakeTensor) and _small(o) for o in outs):
            self._mark_written(func, args, kwargs)
            return
        held = mask_elements(reals) if name in UNIONS else None     # before `a |= b` writes `a`
        try:
            real = self._real_call(func, flat, spec, tensors, reals)
        except Exception:
            self._mark_written(func, args, kwargs)
            return
        assumed = self._assumptions(tensors)
        real_outs = [o for o in tree_flatten(real)[0] if isinstance(o, torch.Tensor)]
        if held is not None and len(real_outs) == 1 and any(a.startswith(_BOUND) for a in assumed):
            real_outs = [union_bound(real_outs[0], held)]
        if len(real_outs) == len(outs):
            for fake, value in zip(outs, real_outs):
                self.remember(fake, value, assumed)

    def _mark_written(self, func, args, kwargs) -> None:
        """An op that writes into its arguments with values not computed here: their storages
        hold unknown values from now on."""
        if not func._schema.is_mutable:
            return
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, FakeTensor):
                    self.stale.add(self._storage(t))

    def _assume_spread(self, func, name, args, out) -> None:
        """Indices chosen from unknown values: consecutive candidates, distinct within one
        choice, so that each candidate is chosen equally often across the batch."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) == 2:
            idx = outs[1]                   # (values, indices): topk, sort, max.dim, kthvalue, mode
        elif name in ("argmax", "argmin", "argsort", "multinomial"):
            idx = outs[0]
        else:
            return
        source = args[0] if args else None
        if not (isinstance(idx, FakeTensor) and idx.dtype == torch.int64 and _small(idx)
                and isinstance(source, torch.Tensor)):
            return
        dim = self._dim_of(name, args, source)
        n = max(int(source.shape[dim]) if source.dim() else 1, 1)
        with _real():
            if idx.dim() and idx.dim() == source.dim():
                shape = list(idx.shape)
                k = shape.pop(dim)
                rows = 1
                for s in shape:
                    rows *= int(s)
                grid = (torch.arange(rows)[:, None] * k + torch.arange(k)[None, :]) % n
                real = grid.reshape(*shape, k).movedim(-1, dim)
            else:                           # one index per row (the dimension reduced away)
                real = (torch.arange(idx.numel()) % n).reshape(idx.shape)
        self.remember(idx, real, frozenset({f"aten.{name}"}))

    def _assume_finite(self, name: str, out, answer: bool) -> None:
        """A NaN / inf check of values the estimate does not have: every element finite."""
        if isinstance(out, FakeTensor) and _small(out):
            with _real():
                self.remember(out, torch.full(tuple(out.shape), answer, dtype=torch.bool))
            self._note("finite", f"checks for NaN and inf (aten.{name}) on weights, activations or the loss "
                       "are taken as an ordinary step's: every value finite")

    @staticmethod
    def _dim_of(name: str, args, source) -> int:
        if name in ("topk", "kthvalue"):
            dim = args[2] if len(args) > 2 else -1
        elif name == "multinomial":
            dim = -1
        else:
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        return dim % max(source.dim(), 1)

    # ------------------------------------------------------------------ data-dependent ops
    def _data_dependent(self, func, name, args, kwargs, flat, spec, tensors, reals, known):
        assumed = self._assumptions(tensors)
        if known:
            chosen = sorted(a for a in assumed if not a.startswith(_BOUND))
            if chosen:
                self._note(f"assumed:{chosen}",
                           f"{', '.join(chosen)} chose indices from values the estimate does not have (a "
                           "router's experts, the top-scoring boxes, a sampled token): taken as spread evenly over "
                           f"the candidates, so what depends on the choice (aten.{name}) is the average case; a real "
                           "run's split differs by a few percent")
            real = self._real_call(func, flat, spec, tensors, reals)
            if not isinstance(real, torch.Tensor) and not isinstance(real, (tuple, list)):
                return real                                             # a Python scalar
            return self._fake_like(real, tensors[0] if tensors else None, assumed)
        if name in ("_local_scalar_dense", "equal", "is_nonzero"):
            dtype = tensors[0].dtype if tensors else torch.bool
            where = _where()
            if self._any_drawn(tensors):
                self._note(f"scalar:{where}", f"a random draw decides a branch at {where} (aten.{name}: "
                           "LayerDrop and the like): on a GPU each step draws anew, so its steps differ from one "
                           "another and leave its cached segments split otherwise (wav2vec2 fp32 at batch 8 on "
                           "the H200: a reserved peak 15% above that of steps all alike); the estimate runs its "
                           "steps with every such branch taken as 0 / False, and again with them varied (the "
                           "first taken otherwise in the first step, then one more step for each, "
                           f"{MAX_DRAW_VARIANTS} at most, taking it otherwise), and reports the higher peaks")
                flip = self.branches in self.flips
                self.branches += 1
                if flip:
                    if name != "_local_scalar_dense" or dtype == torch.bool:
                        return True
                    return 1.0 if dtype.is_floating_point else 1
            else:
                self._note(f"scalar:{where}", f"a value read at {where} (aten.{name}: .item(), bool(), a "
                           "comparison) depends on weights, activations or random draws, which the estimate does "
                           "not have: taken as 0 / False, the branch with nothing unusual")
            if name != "_local_scalar_dense" or dtype == torch.bool:
                return False
            return 0.0 if dtype.is_floating_point else 0
        if name in _SIZE_FROM_VALUES or name == "index":
            return self._bounded(func, name, args, kwargs)
        return self._on_stand_ins(func, name, flat, spec, tensors, reals)

    def _on_stand_ins(self, func, name, flat, spec, tensors, reals):
        """An op whose output shape follows from the values of its known inputs (lengths,
        offsets) and not from its unknown ones: run for real with zeros in their place."""
        unknown = [t for t, r in zip(tensors, reals) if r is None]
        if sum(t.numel() for t in unknown) > MAX_STAND_IN_NUMEL:
            raise DynamicOutputShapeException(func)
        with _real():
            zeros = [torch.zeros(tuple(t.shape), dtype=t.dtype) if r is None else r for t, r in zip(tensors, reals)]
        real = self._real_call(func, flat, spec, tensors, zeros)
        self._note(f"stand-in:{name}", f"aten.{name}'s output shape depends on the values of its inputs: taken "
                   "from a run on the CPU with the lengths the batch gives and zeros for the activations")
        device = tensors[0].device if tensors else torch.device("cpu")
        return tree_map(lambda r: torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype, device=device)
                        if isinstance(r, torch.Tensor) else r, real)

    def _fake_like(self, real, like, assumed: frozenset = frozenset()):
        """Fake tensors on the fake device holding `real`'s shapes (and remembering its values)."""
        device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")

        def make(r):
            if not isinstance(r, torch.Tensor):
                return r
            fake = torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype, device=device)
            self.remember(fake, r, assumed)
            return fake
        return tree_map(make, real)

    def _bounded(self, func, name, args, kwargs):
        """An output size that depends on unknown values, bounded from above: all selected
        (a mask whose values are known selects exactly its own)."""
        x = args[0]
        if name == "index":
            return self._index_bounded(func, args, kwargs)
        if name == "masked_select":
            mask = self.value(args[1])
            if mask is not None:
                shape = torch.broadcast_shapes(x.shape, mask.shape)
                with _real():
                    n = int(mask.expand(shape).sum())
                return torch.empty((n,), dtype=x.dtype, device=x.device)
        self._note_bound(name)
        if name in ("nonzero", "argwhere"):             # every position (of its share), in order
            n = self._share(x)
            with _real():
                every = torch.ones(tuple(x.shape), dtype=torch.bool).nonzero()[:n] if x.numel() <= MAX_INT_NUMEL else None
            out = torch.empty((n, x.dim()), dtype=torch.int64, device=x.device)
            if every is not None:
                self.remember(out, every, frozenset({_BOUND + "aten." + name}))
            return out
        if name in ("nms", "qnms"):                     # every box kept
            out = torch.empty((x.shape[0],), dtype=torch.int64, device=x.device)
            with _real():
                self.remember(out, torch.arange(x.shape[0]), frozenset({_BOUND + "aten." + name}))
            return out
        if name == "masked_select":
            shape = torch.broadcast_shapes(x.shape, args[1].shape)
            out = torch.empty((shape.numel(),), dtype=x.dtype, device=x.device)
            known = self.value(x)
            if known is not None:
                with _real():
                    self.remember(out, known.expand(shape).reshape(-1))
            return out
        if name in ("_unique2", "unique_consecutive"):
            flags = list(args[1:]) + [kwargs.get(k) for k in ("return_inverse", "return_counts")]
            inverse = bool(flags[1] if name == "_unique2" else flags[0]) if len(flags) > 1 else False
            counts = bool(flags[2] if name == "_unique2" else flags[1]) if len(flags) > 2 else False
            n = x.numel()
            return (torch.empty((n,), dtype=x.dtype, device=x.device),
                    torch.empty(tuple(x.shape) if inverse else (0,), dtype=torch.int64, device=x.device),
                    torch.empty((n,) if counts else (0,), dtype=torch.int64, device=x.device))
        raise DynamicOutputShapeException(func)

    def _note_part(self, args, mask) -> None:
        """`x == k` on unknown integer values: one part of a partition of x's elements."""
        x, k = args[0], args[1] if len(args) > 1 else None
        if isinstance(k, torch.Tensor):
            known = self.value(k)
            with _real():
                k = known.item() if known is not None and known.numel() == 1 else None
        if isinstance(x, FakeTensor) and isinstance(mask, FakeTensor) and type(k) in (int, bool) \
                and not (x.is_floating_point() or x.is_complex()) and tuple(mask.shape) == tuple(x.shape):
            self.parts[mask] = (x, k)

    def _share(self, mask) -> int:
        """The elements an unknown mask selects at most: all of them, or for one part of a
        partition (`x == k`), what the parts selected before it left."""
        part = self.parts.get(mask) if isinstance(mask, FakeTensor) else None
        if part is None:
            return mask.numel()
        x, k = part
        given = self.shares.setdefault(x, {})
        if k not in given:
            given[k] = max(x.numel() - sum(given.values()), 0)
            self._note("bound:partition", "masks `x == k` on values the estimate does not have (a box's pyramid "
                       "level): the first selected takes every element, the others what is left, as the real "
                       "parts share them; an upper bound where each part makes tensors of one size per element, "
                       "as a pooler's levels do")
        return given[k]

    def _note_bound(self, name: str) -> None:
        self._note(f"bound:{name}", f"aten.{name} on values the estimate does not have: its output is bounded "
                   "from above (every element selected), so the estimate errs high there")

    def _index_bounded(self, func, args, kwargs):
        """x[mask]: the positions a known mask selects, or, for an unknown one, every position."""
        x, indices = args[0], list(args[1])
        swapped = []
        for idx in indices:
            if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                known = self.value(idx)
                if known is not None:
                    with _real():
                        rows = known.nonzero().unbind(1)
                    swapped += [self._fake_like(r, idx) for r in rows]
                else:                   # every position (of its share) selected
                    self._note_bound("index")
                    n = self._share(idx)
                    with _real():
                        rows = torch.ones(tuple(idx.shape), dtype=torch.bool).nonzero()[:n].unbind(1) \
                            if idx.numel() <= MAX_INT_NUMEL else None
                    if rows is not None:
                        swapped += [self._fake_like(r, idx, frozenset({_BOUND + "aten.index"})) for r in rows]
                    else:
                        swapped += [torch.zeros((n,), dtype=torch.int64, device=idx.device) for _ in range(idx.dim())]
            else:
                swapped.append(idx)
        return func(x, swapped, **kwargs)

    def _with_stand_ins(self, func, args, kwargs, dtype):
        """The output of an op whose fake kernel refuses these dtypes: its shape from a run on
        stand-ins of `dtype`, in the dtype the real kernel returns."""
        floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        original = floats[0] if floats else dtype

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        out = func(*tree_map(cast, args), **tree_map(cast, kwargs))
        return tree_map(lambda o: torch.empty_strided(tuple(o.shape), tuple(o.stride()), dtype=original,
                                                      device=o.device) if isinstance(o, torch.Tensor) else o, out)
