"""Checkpointing aimed where the memory is: segments of a flat nn.Sequential (a layer alone
saves nothing), the same block across a CNN's stages, and under `--try ckpt` the model whose
activations filled the memory. Peaks are measured from traced runs on the CPU."""
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from memdoctor.attribution import live_blocks, peak
from memdoctor.capture.session import Tracer
from memdoctor.remedies.checkpointing import (apply_checkpointing, checkpoint_units, find_blocks,
                                              is_checkpointed, predicted_peak)
from memdoctor.remedies.inject import activation_root, compare
from memdoctor.capture.script import trace_script

GAN = Path(__file__).parent / "fixtures" / "scripts" / "two_models_gan.py"


def flat_cnn(depth: int = 6) -> nn.Sequential:
    layers, c = [], 3
    for w in [16] + [32] * (depth - 1):
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.layer2 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


class HandWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = (nn.Conv2d(3, 3, 3, padding=1) for _ in range(3))

    def forward(self, x):
        return self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


def test_units_of_a_flat_sequential_are_segments_from_each_repeated_layer():
    names = [u.name for u in checkpoint_units(flat_cnn(4))]
    assert names == ["0..2", "3..5", "6..8", "9..14"]      # the head goes with the last segment
    wrapped = nn.Sequential()
    wrapped.main = flat_cnn(3)
    assert [u.name for u in checkpoint_units(wrapped)] == ["main.0..2", "main.3..5", "main.6..11"]


def test_the_same_block_across_stages_is_one_set_of_units():
    assert [n for n, _ in find_blocks(ResNetLike())] == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]


def test_single_layers_in_a_hand_written_forward_are_refused():
    with pytest.raises(ValueError, match="hand-written forward"):
        apply_checkpointing(HandWritten(), "full")


@pytest.mark.parametrize("make", [flat_cnn, ResNetLike], ids=["flat-sequential", "resnet-stages"])
@pytest.mark.parametrize("mode", ["full", "selective", 2])
def test_same_gradients_and_batch_norm_statistics(make, mode):
    torch.manual_seed(0)
    plain = make()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(4, 3, 16, 16)
    plain(x).square().mean().backward()
    handle = apply_checkpointing(ckpt, mode)
    ckpt(x).square().mean().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    for a, b in zip(plain.buffers(), ckpt.buffers()):       # the recompute left them alone
        assert torch.equal(a, b)
    handle.undo()
    assert not any(is_checkpointed(m) for m in ckpt.modules())


def traced_step(model, x):
    """A training step under the dispatch tracer: the Run and the last event of the forward."""
    with Tracer(models=[model], source="dispatch") as t:
        out = model(x)
        end_of_forward = len(t.recorder.run.actions) - 1
        out.square().mean().backward()
        model.zero_grad(set_to_none=True)
    return t.run, end_of_forward


def test_flat_sequential_peak_drops_as_predicted():
    torch.manual_seed(0)
    model = flat_cnn(6)
    x = torch.randn(16, 3, 64, 64)
    units = checkpoint_units(model)
    run, end_of_forward = traced_step(model, x)

    def unit_of(module):
        index = int(module.split(".")[0]) if module else None
        return next((k for k, u in enumerate(units) if index is not None and u.start <= index < u.stop), None)
    # what each segment saves, holds for a moment, and takes in: measured on the plain run
    saved, extra, inputs = [0] * len(units), [0] * len(units), []
    for b in live_blocks(run, end_of_forward):
        if b.category == "activations" and unit_of(b.module) is not None:
            saved[unit_of(b.module)] += b.nbytes
    for b in run.blocks.values():
        if b.category == "temporaries" and b.phase == "forward" and unit_of(b.module) is not None:
            extra[unit_of(b.module)] = max(extra[unit_of(b.module)], b.nbytes)
    with torch.no_grad():
        h = x
        for u in units:
            inputs.append(h.numel() * h.element_size())
            h = model[u.start:u.stop](h)
    before = peak(run)[1]
    predicted = predicted_peak(saved, before - sum(saved), len(units), inputs, extra)

    handle = apply_checkpointing(model, "full")
    assert handle.description.startswith(f"full checkpointing of {len(units)} of {len(units)} segments")
    after = peak(traced_step(model, x)[0])[1]
    handle.undo()
    assert after < 0.75 * before
    assert abs(after - predicted) <= 0.05 * predicted, (before, predicted, after)


def test_try_ckpt_checkpoints_the_model_whose_activations_ran_out():
    before = trace_script(str(GAN), source="dispatch").run
    assert activation_root(before) == "Generator"
    tried = compare(str(GAN), [], "ckpt=full", source="dispatch")
    assert tried.problems == []
    assert len(tried.applied) == 1 and "of Generator" in tried.applied[0], tried.applied
    assert "segments of layers" in tried.applied[0]
    assert peak(tried.after)[1] < peak(tried.before)[1]



class _SavedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _SavedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_SavedBlock() for _ in range(3))
        self.flat = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.flat(x)


def test_a_checkpointed_model_still_saves_whole_and_copies():
    """`torch.save(model)` at the end of training (pytorch/examples' word_language_model does
    it) and `copy.deepcopy(model)` (an EMA copy) keep working with checkpointing applied; the
    saved and copied models compute what the checkpointed one does."""
    import io
    torch.manual_seed(0)
    model = _SavedModel()
    apply_checkpointing(model, "full")
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    # as word_language_model loads it: weights only, its own classes allowed, nothing else
    with torch.serialization.safe_globals([_SavedModel, _SavedBlock, nn.ModuleList, nn.Sequential, nn.Linear]):
        loaded = torch.load(buffer)
    assert torch.equal(loaded(x), model(x))
    assert "forward" not in loaded.blocks[0].__dict__ and "__getstate__" not in loaded.blocks[0].__dict__
    assert torch.equal(copy.deepcopy(model)(x), model(x))


def test_checkpointing_undone_leaves_the_modules_as_they_were():
    model = _SavedModel()
    own = model.flat.forward
    model.flat.forward = own            # a forward of its own in the instance, kept through undo
    before = {name: set(m.__dict__) for name, m in model.named_modules()}
    apply_checkpointing(model, "full").undo()
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == before
    assert model.flat.__dict__["forward"] is own


def test_t5s_blocks_are_its_encoders_and_decoders_layers_not_the_two_stacks():
    """T5's encoder and decoder are same-class siblings that each hold a list of blocks: the
    blocks are the lists' members (as for a model wrapped one level down, as Lightning does)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
                                   vocab_size=100, d_kv=32)
    wrapper = nn.Module()
    wrapper.model = transformers.T5ForConditionalGeneration(config)
    assert [name for name, _ in find_blocks(wrapper)] == [
        "model.encoder.block.0", "model.encoder.block.1", "model.decoder.block.0", "model.decoder.block.1"]


def test_blocks_inside_plain_containers_are_the_ones_called():
    """LDM's UNet stages are plain nn.Module()s holding lists; the parent calls `down[i].block[j]`,
    never `down[i]`: the blocks are the list members, or checkpointing wraps a forward never run."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList()
            for _ in range(3):
                stage = nn.Module()
                stage.block = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
                self.down.append(stage)

        def forward(self, x):
            for stage in self.down:
                for block in stage.block:
                    x = x + block(x)
            return x

    assert [name for name, _ in find_blocks(Net())] == [f"down.{i}.block.{j}" for i in range(3) for j in range(2)]


def test_composite_blocks_come_before_a_run_of_single_layers():
    """A diffusion UNet's two resnet blocks per stage, beside its time embedding's two Linears in
    a Sequential: the blocks are the resnets (checkpointing the Linears saves nothing)."""
    class Resnet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return x + self.conv2(torch.relu(self.conv1(x)))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.time_embedding = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 4))
            self.resnets = nn.ModuleList(Resnet() for _ in range(2))

    assert [name for name, _ in find_blocks(UNet())] == ["resnets.0", "resnets.1"]
    assert [name for name, _ in find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))] == ["0", "2"]
