"""The estimate leaves no fake tensor in the user's function caches: real training later in the
same process computes with real tensors, the same as in a process that never estimated."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memdoctor.predict.estimate import estimate
from memdoctor.predict.fake_caches import clear_caches_filled, lru_caches

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@functools.lru_cache(maxsize=4)
def _position_index(n: int) -> torch.Tensor:
    """A memoised table, as models keep their relative position indices."""
    coords = torch.arange(n)
    return (coords[:, None] - coords[None, :]).abs()


class RelativeBias(nn.Module):
    def __init__(self, n: int = 16, d: int = 32):
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, 1))
        self.proj = nn.Linear(d, d)
        self.n = n

    def forward(self, x):
        bias = self.table[_position_index(self.n)].squeeze(-1)       # (n, n)
        return (bias @ self.proj(x)).mean()


def _loss(model, x):
    return model(x)


def test_a_cache_the_estimate_filled_holds_no_fake_tensor_afterwards():
    _position_index.cache_clear()
    estimate(lambda: RelativeBias(), None, lambda: torch.randn(16, 32), _loss, device="cpu")
    index = _position_index(16)
    assert type(index) is torch.Tensor
    torch.manual_seed(0)
    model = RelativeBias()
    loss = model(torch.randn(16, 32))
    assert type(loss) is torch.Tensor
    loss.backward()
    assert type(model.table.grad) is torch.Tensor and model.table.grad.abs().sum() > 0


def test_only_the_caches_called_in_the_block_are_cleared():
    @functools.lru_cache(maxsize=None)
    def untouched(n):
        return n * 2

    @functools.lru_cache(maxsize=None)
    def called(n):
        return n * 3

    untouched(1), called(1)
    with clear_caches_filled():
        untouched(1)            # a hit computes nothing
        called(2)
    assert untouched.cache_info().currsize == 1
    assert called.cache_info().currsize == 0


def test_caches_are_cleared_when_the_block_fails():
    @functools.lru_cache(maxsize=None)
    def called(n):
        return n

    with pytest.raises(RuntimeError):
        with clear_caches_filled():
            called(1)
            raise RuntimeError("the estimate failed")
    assert called.cache_info().currsize == 0


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_beit_trains_on_real_tensors_after_its_estimate():
    """transformers' BEiT memoises its relative position index: filled by the estimate's fake
    build and kept, it would make the next real BEiT in the process compute a FakeTensor loss."""
    import transformers

    config = transformers.BeitConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, image_size=32, patch_size=8,
                                     use_relative_position_bias=True, num_labels=10)

    def batch():
        g = torch.Generator().manual_seed(1)
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([1, 7])}

    def real_loss() -> torch.Tensor:
        torch.manual_seed(0)
        model = transformers.BeitForImageClassification(config)
        return model(**batch()).loss

    def hf_loss(model, b):
        return model(**b).loss

    estimate(lambda: transformers.BeitForImageClassification(config), None, batch, hf_loss, device="cpu")
    after = real_loss()
    assert not isinstance(after, FakeTensor)
    for cache in lru_caches():         # the reference: every cache in the process empty
        cache.cache_clear()
    assert torch.equal(after, real_loss())
