"""Packed sequences in the estimate (memdoctor.predict.packed_sequences): ATen's packing and
padding read their lengths through a data pointer, which fake tensors do not have. The
estimate runs the same algorithm, so its bytes are the real kernels' bytes."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from memdoctor.predict.estimate import estimate
from memdoctor.predict.packed_sequences import _pad_packed_sequence, _packer
from tests.support.real_steps import plain_peak, real_peak

LENGTHS = [200, 173, 173, 90, 64, 64, 64, 12]


class PackedMLP(nn.Module):
    """Pack, a layer on the packed tokens only, pad back: no RNN, so it runs on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        self.mix = nn.Linear(256, 256)
        self.head = nn.Linear(256, 16)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        mixed = packed._replace(data=torch.tanh(self.mix(packed.data)))
        return self.head(pad_packed_sequence(mixed, batch_first=True, total_length=ids.shape[1])[0])


class PackedLSTM(nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.embed = nn.Embedding(1000, 256)
        self.rnn = nn.LSTM(256, 256, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(512, 16)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if not self.packed:
            return self.head(self.rnn(x)[0])
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.head(pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=ids.shape[1])[0])


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS)[torch.randperm(len(LENGTHS), generator=g)]
    ids = torch.randint(1, 1000, (len(LENGTHS), 200), generator=g)
    return ids, lengths, torch.randint(0, 16, (len(LENGTHS), 200), generator=g)


def _loss(model, batch):
    ids, lengths, tags = batch
    return F.cross_entropy(model(ids, lengths.cpu()).flatten(0, 1), tags.flatten())


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_pack_and_pad_match_atens_values():
    ids, lengths, _ = _batch()
    x = torch.randn(len(LENGTHS), 200, 8)
    sorted_lengths, order = torch.sort(lengths, descending=True)
    data, sizes = torch._VF._pack_padded_sequence(x[order], sorted_lengths, True)
    ours_data, ours_sizes = _packer(None)(x[order], sorted_lengths, True)
    assert torch.equal(ours_data, data) and torch.equal(ours_sizes, sizes)
    for total in (0, 230):
        padded, back = torch._VF._pad_packed_sequence(data, sizes, True, -1.0, total)
        ours, ours_back = _pad_packed_sequence(data, sizes, True, -1.0, total)
        assert torch.equal(ours, padded) and torch.equal(ours_back, back)


def test_packing_backward_matches_atens():
    x = torch.randn(len(LENGTHS), 200, 8, requires_grad=True)
    lengths = torch.tensor(LENGTHS)
    data, _ = torch._VF._pack_padded_sequence(x, lengths, True)
    (data * torch.arange(data.numel()).view_as(data)).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    ours, _ = _packer(None)(x, lengths, True)
    (ours * torch.arange(ours.numel()).view_as(ours)).sum().backward()
    assert torch.equal(x.grad, expected)


def test_a_packed_step_estimates_the_real_steps_bytes():
    est = estimate(PackedMLP, _adamw, _batch, _loss, device="cpu")
    peak = real_peak(PackedMLP, _adamw, _batch, _loss)
    assert abs(est.peak_allocated_bytes - peak) <= 0.01 * peak, (est.peak_allocated_bytes, peak)


@pytest.mark.parametrize("plan", [None, "bf16"])
def test_a_packed_lstm_estimates_for_cuda_below_the_padded_one(plan):
    """cuDNN's fused LSTM on a packed batch: its outputs hold only the real tokens."""
    packed = estimate(lambda: PackedLSTM(True), _adamw, _batch, _loss, plan=plan, device="cuda")
    padded = estimate(lambda: PackedLSTM(False), _adamw, _batch, _loss, plan=plan, device="cuda")
    assert any("cuDNN RNN (lstm)" in n for n in packed.notes)
    assert packed.peak_allocated_bytes < padded.peak_allocated_bytes
    states = 4 * sum(p.numel() for p in PackedLSTM(True).parameters())
    assert packed.peak_allocated_bytes > 4 * states       # weights, gradients, two AdamW states


class PackedGRU(PackedLSTM):
    def __init__(self, packed: bool) -> None:
        super().__init__(packed)
        self.rnn = nn.GRU(256, 256, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(256, 16)


@pytest.mark.parametrize("model", [PackedLSTM, PackedGRU])
def test_a_packed_rnn_for_the_cpu_estimates_the_real_steps_bytes(model):
    """ATen's CPU RNN over a packed batch reads its batch sizes through a data pointer; the
    estimate runs its algorithm (memdoctor.predict.cpu_packed_rnn). Counted without a dispatch
    mode (plain_peak): every time step's slice feeds the projected input's gradient, which
    the engine sums in place only then. The CPU has no caching allocator: its peak is the live
    bytes'."""
    est = estimate(lambda: model(True), _adamw, _batch, _loss, device="cpu")
    peak = plain_peak(lambda: model(True), _adamw, _batch, _loss)
    assert abs(est.live_peak_bytes - peak) <= 0.01 * peak, (est.live_peak_bytes, peak)


def test_the_cpu_packed_rnn_gives_atens_values_and_gradients():
    from memdoctor.predict.cpu_packed_rnn import cpu_packed_rnns
    torch.manual_seed(0)
    lengths = torch.tensor([7, 5, 5, 2, 1])
    for rnn in (nn.LSTM(6, 4, 2, bidirectional=True), nn.GRU(6, 4, 2, bidirectional=True),
                nn.RNN(6, 4, 2, nonlinearity="relu"), nn.LSTM(6, 4, 1, bias=False)):
        rnn = rnn.double()
        x = torch.randn(7, 5, 6, dtype=torch.double, requires_grad=True)

        def run():
            out, h = rnn(pack_padded_sequence(x, lengths))
            h = h if isinstance(h, tuple) else (h,)
            loss = (out.data ** 2).sum() + sum((t * 1.5).sum() for t in h)
            return [out.data, *h, *torch.autograd.grad(loss, [x, *rnn.parameters()])]
        atens = run()
        with cpu_packed_rnns():
            ours = run()
        assert all(torch.allclose(a, b) for a, b in zip(atens, ours)), rnn


class LengthsFromActivations(PackedMLP):
    """Lengths computed from the model's own values: the estimate does not have them."""

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        drop = (self.embed(ids).sum(-1) > 1e9).long().sum(-1)        # 0 in a real run
        return super().forward(ids, (ids.shape[1] - drop).cpu())


def _full_batch():
    ids, _, tags = _batch()
    return ids, torch.full((len(LENGTHS),), 200), tags


def test_lengths_the_estimate_lacks_are_bounded_by_the_padded_length_and_noted():
    bounded = estimate(LengthsFromActivations, _adamw, _batch, _loss, device="cpu")
    full = estimate(PackedMLP, _adamw, _full_batch, _loss, device="cpu")
    assert any("pack_padded_sequence" in n and "upper bound" in n for n in bounded.notes)
    assert not any("pack_padded_sequence" in n for n in full.notes)
    assert abs(bounded.peak_allocated_bytes - full.peak_allocated_bytes) <= 0.01 * full.peak_allocated_bytes
