"""Views, saved-tensor aliases and memoized outputs of fake tensors, made without
FakeTensorMode's dispatch (memdoctor.predict.fake_views, DataDependent.alias,
memdoctor.predict.fake_outputs): the same tensors FakeTensorMode makes, and an estimate of a
step written as a Python loop over slices that still counts its bytes."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memdoctor.predict.data_dependent import MAX_FLOAT_NUMEL, DataDependent
from memdoctor.predict.estimate import estimate
from memdoctor.predict.fake_outputs import OutputMemo, memoizable
from memdoctor.predict.fake_views import is_plain_view, view_of_fakes
from tests.support.real_steps import plain_peak

aten = torch.ops.aten

T = (6, 4, 5)           # the base: a (4, 6, 5) tensor transposed, not contiguous
C = (6, 4, 5, "c")      # contiguous
VIEWS = [
    (T, aten.select.int, (1, 3), {}),
    (T, aten.select.int, (2, -1), {}),
    (T, aten.transpose.int, (0, 2), {}),
    ((4, 1, 5), aten.expand.default, ([2, 4, 6, 5],), {}),
    (C, aten.view.default, ([8, 15, 1],), {}),
    (T, aten.unsqueeze.default, (-1,), {}),
    ((1, 4, 5), aten.squeeze.dim, (0,), {}),
    (T, aten.permute.default, ([2, 0, 1],), {}),
    (T, aten.slice.Tensor, (1, 1, 3), {}),
    (T, aten.as_strided.default, ([3, 2], [1, 6], 2), {}),
    (T, aten.detach.default, (), {}),
    (T, aten.alias.default, (), {}),
    (T, aten.diagonal.default, (), {"dim1": 1, "dim2": 2}),
    (T, aten.unfold.default, (2, 2, 1), {}),
    (T, aten.view.dtype, (torch.int32,), {}),
    (C, aten._unsafe_view.default, ([24, 5],), {}),
]


def _base(mode, shape):
    with mode:
        if shape == T:
            return torch.empty(4, 6, 5).transpose(0, 1)
        return torch.empty(shape[:3] if shape[-1] == "c" else shape)


@pytest.mark.parametrize("shape,func,rest,kwargs", VIEWS, ids=[f"{v[1]}-{i}" for i, v in enumerate(VIEWS)])
def test_a_view_of_fakes_is_fake_tensor_modes_own(shape, func, rest, kwargs):
    mode = FakeTensorMode()
    base = _base(mode, shape)
    assert is_plain_view(func)
    ours = view_of_fakes(func, (base, *rest), kwargs)
    with mode:
        theirs = func(base, *rest, **kwargs)
    assert type(ours) is FakeTensor and ours.fake_mode is mode
    assert (ours.shape, ours.stride(), ours.storage_offset(), ours.dtype, ours.device) == \
        (theirs.shape, theirs.stride(), theirs.storage_offset(), theirs.dtype, theirs.device)
    assert ours.untyped_storage()._cdata == base.untyped_storage()._cdata


def test_views_are_told_from_other_ops():
    assert not is_plain_view(aten.split.Tensor)           # a list of tensors
    assert not is_plain_view(aten.add.Tensor)
    assert not is_plain_view(aten.transpose_.default)     # writes its input's metadata


def test_what_fake_tensor_mode_must_convert_takes_its_dispatch():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _base(mode, (4, 5))
    assert view_of_fakes(aten.select.int, (torch.ones(4, 5), 0, 1), {}) is None       # a real tensor
    constant = mode.from_tensor(torch.ones(4, 5), static_shapes=True)
    constant.constant = torch.ones(4, 5)
    assert view_of_fakes(aten.select.int, (constant, 0, 1), {}) is None               # a constant it propagates
    assert view_of_fakes(aten.select.int, (fake, 0, 1), {}) is not None


def test_a_saved_tensor_alias_shares_storage_and_version_and_known_values():
    values = DataDependent()
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(3, 4)
        ids = torch.empty(5, dtype=torch.long)
    values.remember(ids, torch.arange(5))
    alias = values.alias(x)
    assert type(alias) is FakeTensor and alias is not x and not alias.requires_grad
    assert alias.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert (alias.shape, alias.stride(), alias.device) == (x.shape, x.stride(), x.device)
    with mode:
        x.add_(1)
    assert alias._version == x._version == 1        # autograd's check of a change in place sees it
    assert torch.equal(values.value(values.alias(ids)), torch.arange(5))
    assert values.value(alias) is None


class Scan(nn.Module):
    """A selective scan as transformers' Mamba writes it without its CUDA kernels: a Python
    loop over time steps of small slices, selects, products and matmuls."""

    def __init__(self, d: int = 256, n: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.a = nn.Parameter(torch.randn(d, n) * 0.1)
        self.c = nn.Linear(d, n)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        u, dt = self.inp(x).chunk(2, dim=-1)
        da = torch.exp(F.softplus(dt).unsqueeze(-1) * self.a)         # (b, t, d, n)
        db_u = dt.unsqueeze(-1) * u.unsqueeze(-1)
        c = self.c(x)                                                   # (b, t, n)
        state = torch.zeros(x.shape[0], x.shape[2], self.a.shape[1])
        outs = []
        for i in range(x.shape[1]):
            state = da[:, i] * state + db_u[:, i]
            outs.append(torch.matmul(state, c[:, i, :].unsqueeze(-1))[:, :, 0])
        return self.out(torch.stack(outs, dim=1))


def _batch():
    torch.manual_seed(0)
    return torch.randn(4, 32, 256)


def _loss(model, batch):
    return model(batch).square().mean()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_python_scan_estimates_the_real_steps_bytes_without_dispatching_its_views(monkeypatch):
    """Its views of tensors too large for known values (DataDependent's small ones take the
    dispatch that shadows them) never reach FakeTensorMode, nor do saved tensors' aliases."""
    seen = []
    dispatch = FakeTensorMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        if isinstance(args[0], torch.Tensor) and args[0].numel() > MAX_FLOAT_NUMEL:
            seen.append(func)
        return dispatch(self, func, types, args, kwargs)
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", counting)
    est = estimate(Scan, _adamw, _batch, _loss, device="cpu")
    monkeypatch.undo()
    peak = plain_peak(Scan, _adamw, _batch, _loss)
    assert abs(est.live_peak_bytes - peak) <= 0.01 * peak, (est.live_peak_bytes, peak)
    assert aten.mul.Tensor in seen and aten.add.Tensor in seen
    assert aten.select.int not in seen and aten.detach.default not in seen


FUNCTIONAL = [
    (aten.add.Tensor, lambda f: (f((6, 4, 5)), f((6, 4, 5))), {}),
    (aten.add.Tensor, lambda f: (f((6, 4, 5), torch.int64), 1), {}),
    (aten.add.Tensor, lambda f: (f((6, 4, 5), torch.int64), 1.0), {}),          # promotes to float
    (aten.mul.Tensor, lambda f: (f((6, 1, 5)), f((4, 5), torch.bfloat16)), {}),  # broadcasts, promotes
    (aten.bmm.default, lambda f: (f((6, 4, 5)), f((6, 5, 3))), {}),
    (aten.sum.dim_IntList, lambda f: (f((6, 4, 5)), [1]), {"keepdim": True}),
    (aten.native_layer_norm.default, lambda f: (f((6, 4, 5)), [5], f((5,)), f((5,)), 1e-5), {}),
    (aten.select_backward.default, lambda f: (f((6, 5)), [6, 4, 5], 1, 2), {}),
    (aten.convolution.default, lambda f: (f((2, 3, 8, 8)), f((4, 3, 3, 3)), None, [1, 1], [1, 1], [1, 1],
                                          False, [0, 0], 1), {}),
    (aten._to_copy.default, lambda f: (f((6, 4, 5)),), {"dtype": torch.float16}),
]


@pytest.mark.parametrize("func,make,kwargs", FUNCTIONAL, ids=[f"{v[0]}-{i}" for i, v in enumerate(FUNCTIONAL)])
def test_a_memoized_output_is_fake_tensor_modes_own(func, make, kwargs):
    """A hit makes the outputs FakeTensorMode makes: sizes, strides, dtype, device, each in a
    fresh storage of its size; a call that differs in a dtype or a scalar's type misses."""
    mode = FakeTensorMode()

    def fake(shape, dtype=torch.float32):
        with mode:
            return torch.empty(shape, dtype=dtype)
    args = make(fake)
    memo = OutputMemo()
    assert memoizable(func)
    key = memo.key(func, args, kwargs)
    assert key is not None and memo.get(key) is None
    with mode:
        theirs = func(*args, **kwargs)
    memo.store(key, args, kwargs, theirs)
    ours = memo.get(memo.key(func, make(fake), kwargs))         # other tensors, alike
    assert ours is not None
    for o, t in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (ours, theirs))):
        assert type(o) is FakeTensor and o.fake_mode is mode
        assert (o.shape, o.stride(), o.dtype, o.device, o.untyped_storage().nbytes()) == \
            (t.shape, t.stride(), t.dtype, t.device, t.untyped_storage().nbytes())
        assert o.untyped_storage()._cdata != t.untyped_storage()._cdata


def test_the_memo_tells_calls_apart_and_keeps_out_what_it_cannot_make():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(4, 5)
        ints = torch.empty(4, 5, dtype=torch.int64)
    memo = OutputMemo()
    assert memo.key(aten.add.Tensor, (ints, 1), {}) != memo.key(aten.add.Tensor, (ints, 1.0), {})
    assert memo.key(aten.add.Tensor, (ints, True), {}) != memo.key(aten.add.Tensor, (ints, 1), {})
    assert memo.key(aten.add.Tensor, (x, x.t().contiguous().t()), {}) != memo.key(aten.add.Tensor, (x, x), {})
    assert memo.key(aten.add.Tensor, (x, torch.ones(4, 5)), {}) is None              # a real tensor
    for op in (aten.add_.Tensor, aten.select.int, aten.nonzero.default, aten.bernoulli.default,
               aten.split.Tensor, aten._local_scalar_dense.default):
        assert not memoizable(op), op
    # an output that is not a fresh storage of its own size is not kept
    key = memo.key(aten.mul.Tensor, (x, 2), {})
    with mode:
        out = torch.empty(40)[:20].view(4, 5)
    memo.store(key, (x, 2), {}, out)
    assert memo.get(key) is None
    memo.store(key, (x, 2), {}, x)              # an input's storage
    assert memo.get(key) is None
