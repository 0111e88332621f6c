"""The estimate's GPU-side pieces on a real GPU: cuDNN's convolution workspaces measured by
the probe agree with the allocator's own count, and with them a convolutional network's
estimate meets its measured peaks."""
import gc

import pytest
import torch

from memdoctor.predict.op_probe import probe, spec_of

pytestmark = pytest.mark.gpu
aten = torch.ops.aten


def _fresh():
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("shape, weight, stride", [((32, 64, 56, 56), (64, 64, 3, 3), 1),
                                                   ((32, 256, 56, 56), (512, 256, 1, 1), 2),
                                                   ((32, 3, 224, 224), (64, 3, 7, 7), 2)])
def test_probed_workspace_is_what_the_allocator_was_asked_for(shape, weight, stride):
    x = torch.randn(*shape, device="cuda")
    w = torch.randn(*weight, device="cuda")
    pad = weight[-1] // 2
    args = (x, w, None, [stride, stride], [pad, pad], [1, 1], False, [0, 0], 1)
    key, tree = spec_of(args, {})
    scratch = probe(aten.convolution.default, key, tree)
    _fresh()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    y = aten.convolution.default(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
    out = y.untyped_storage().nbytes()
    assert peak - out == max((s.nbytes for s in scratch), default=0)


def _two_real_steps(build) -> tuple[int, int]:
    """The allocated and reserved peaks two real training steps of `build()` add on this GPU."""
    from memdoctor.predict.fake_step import train_step
    _fresh()
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with torch.device("cuda"):
        model, optimizer, batch, loss_fn = build()
    for _ in range(2):
        train_step(model, optimizer, batch, loss_fn)
    torch.cuda.synchronize()
    peaks = torch.cuda.max_memory_allocated() - base_alloc, torch.cuda.max_memory_reserved() - base_res
    del model, optimizer, batch
    _fresh()
    return peaks


def test_resnet50_estimate_with_measured_workspaces_meets_the_gpu():
    from memdoctor.predict.estimate import estimate_built
    from memdoctor.predict.models import get
    from memdoctor.predict import op_probe
    build = get("resnet50").builder(batch=32)
    est = estimate_built(build, device="cuda", settle=False)     # the two steps measured below
    assert any("measured on this machine's GPU" in n for n in est.notes)
    probed = dict(op_probe.MEASURED)
    again = estimate_built(build, device="cuda", settle=False)   # the same layers: nothing run again
    assert op_probe.MEASURED.keys() == probed.keys()
    assert all(op_probe.MEASURED[k] is probed[k] for k in probed)
    assert again.peak_reserved_bytes == est.peak_reserved_bytes
    allocated, reserved = _two_real_steps(build)
    print(f"resnet50 b32: allocated {allocated} predicted {est.peak_allocated_bytes}; "
          f"reserved {reserved} predicted {est.peak_reserved_bytes}")
    assert abs(est.peak_allocated_bytes - allocated) <= 0.01 * allocated
    assert abs(est.peak_reserved_bytes - reserved) <= 0.04 * reserved


def _gpu_scratch(func, *args):
    """What `func(*args)` took and gave back inside the call on this GPU, in order: (bytes,
    made before the outputs)."""
    from memdoctor.predict.op_probe import recorded_trace, scratch_from_trace
    return [(s.nbytes, s.before_outputs) for s in scratch_from_trace(recorded_trace(lambda: func(*args)))]


def _rule(func, *args):
    from memdoctor.cuda.kernel_scratch import Gpu, scratch_for
    return [(s.nbytes, s.before_outputs) for s in scratch_for(func, args, {}, Gpu.local()) if "cub" not in s.label]


def _includes(bigger: list, smaller: list) -> list:
    """What is left of `bigger` after taking out every item of `smaller` (None if one is missing)."""
    left = list(bigger)
    for n in smaller:
        if n not in left:
            return None
        left.remove(n)
    return left


def test_kernel_scratch_rules_match_this_gpu():
    """The rules of memdoctor.cuda.kernel_scratch against the kernels themselves, on this GPU."""
    g = torch.randn(12608, 3072, device="cuda")
    assert _gpu_scratch(aten.sum.dim_IntList, g, [0]) == _rule(aten.sum.dim_IntList, g, [0])
    for dtype in (torch.float32, torch.bfloat16):         # weight_norm's norm, and a full one
        w = torch.randn(36864, 128, device="cuda", dtype=dtype)
        assert _gpu_scratch(aten.norm.ScalarOpt_dim, w, 2, [0]) == _rule(aten.norm.ScalarOpt_dim, w, 2, [0]) != []
        assert _gpu_scratch(aten.linalg_vector_norm.default, w, 2, [0]) == \
            _rule(aten.linalg_vector_norm.default, w, 2, [0])
        assert _gpu_scratch(aten.norm.Scalar, w, 2) == _rule(aten.norm.Scalar, w, 2)

    # memory-efficient attention backward, fp32 and bf16, with the output gradient laid out as
    # the forward's output and as a contiguous [B, H, M, K] (copied first)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(8, 16, 1024, 64, device="cuda", dtype=dtype)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, q, q, None, True)
        for grad in (torch.randn_like(out), torch.randn(8, 16, 1024, 64, device="cuda", dtype=dtype)):
            args = (grad, q, q, q, None, out, lse, seed, offset, 0.0, [True, True, True, False], False)
            assert _gpu_scratch(aten._scaled_dot_product_efficient_attention_backward.default, *args) == \
                _rule(aten._scaled_dot_product_efficient_attention_backward.default, *args), (dtype, grad.stride())

    # embedding backward: every rule size is there; what is left is cub's temporaries (small)
    grad = torch.randn(8, 1024, 1024, device="cuda")
    idx = torch.randint(0, 50257, (8, 1024), device="cuda")
    got = sorted(n for n, _ in _gpu_scratch(aten.embedding_dense_backward.default, grad, idx, 50257, -1, False))
    rule = sorted(n for n, _ in _rule(aten.embedding_dense_backward.default, grad, idx, 50257, -1, False))
    left = _includes(got, rule)
    assert left is not None and len(left) <= 3 and all(n < 1024 * 1024 for n in left), (got, rule)


class _LegacyParams(torch.nn.Module):
    """Parameters from the legacy `torch.FloatTensor(...)`, which makes them on the CPU
    whatever the default device (XLNet's attention): a script moves the model with .to()."""

    def __init__(self, d: int = 1024):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.FloatTensor(d, 4 * d).normal_(std=0.02))
        self.w2 = torch.nn.Parameter(torch.FloatTensor(4 * d, d).normal_(std=0.02))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def _legacy_build():
    model = _LegacyParams().to(torch.get_default_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, torch.randn(4096, 1024), lambda m, x: m(x).square().mean()


def test_a_model_built_on_the_cpu_and_moved_estimates_as_the_gpu_measures():
    from memdoctor.predict.estimate import estimate_built
    est = estimate_built(_legacy_build, device="cuda", settle=False)
    allocated, _ = _two_real_steps(_legacy_build)
    assert abs(est.peak_allocated_bytes - allocated) <= 0.01 * allocated


class _PackedTagger(torch.nn.Module):
    def __init__(self, vocab: int = 8000, dim: int = 256, hidden: int = 512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.lstm = torch.nn.LSTM(dim, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.out = torch.nn.Linear(2 * hidden, 32)

    def forward(self, ids, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True)
        out, _ = self.lstm(packed)
        return self.out(pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])[0])


def _packed_build():
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(32, 257, (48,), generator=g, device="cpu").sort(descending=True).values
    lengths[0] = 256
    ids = torch.randint(1, 8000, (48, 256), generator=g, device="cpu")
    model = _PackedTagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(m, batch):
        return m(batch[0], batch[1]).float().square().mean()
    return model, optimizer, (ids.to(torch.get_default_device()), lengths), loss_fn


def test_a_packed_lstm_estimates_as_the_gpu_measures():
    """cuDNN sizes a packed call's reserve by its batch sizes: probed so, not as the padded batch."""
    from memdoctor.predict.estimate import estimate_built
    est = estimate_built(_packed_build, device="cuda", settle=False)
    assert any("cuDNN RNN (lstm): reserve space and workspaces measured" in n for n in est.notes)
    allocated, reserved = _two_real_steps(_packed_build)
    print(f"packed lstm: allocated {allocated} predicted {est.peak_allocated_bytes}; "
          f"reserved {reserved} predicted {est.peak_reserved_bytes}")
    assert abs(est.peak_allocated_bytes - allocated) <= 0.02 * allocated
    assert abs(est.peak_reserved_bytes - reserved) <= 0.05 * reserved
