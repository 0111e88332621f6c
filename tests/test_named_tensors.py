"""Where the tensors a script names are found when a trace ends: a variable, a list of them,
a TensorDataset's tensors, a DataLoader's dataset (memdoctor.capture.named_tensors); the
join by address to the allocator's blocks runs on a GPU (tests/gpu/test_realworld_gpu.py,
hf_dataset_on_device)."""
import torch
from torch.utils.data import DataLoader, TensorDataset

from memdoctor.capture.named_tensors import _tensors


def test_tensors_held_the_ways_data_is_held():
    x, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    found = dict(_tensors("train", loader))
    assert set(found) == {"train.dataset.tensors[0]", "train.dataset.tensors[1]"}
    assert found["train.dataset.tensors[0]"] is x and found["train.dataset.tensors[1]"] is y
    assert [n for n, _ in _tensors("ids", x)] == ["ids"]
    assert [n for n, _ in _tensors("pair", (x, 3, y))] == ["pair[0]", "pair[2]"]
    batches = [(x[i:i + 2].clone(), y[i:i + 2].clone()) for i in range(0, 10, 2)]     # made up front
    assert [n for n, _ in _tensors("batches", batches)][:3] == ["batches[0][0]", "batches[0][1]", "batches[1][0]"]
    assert len(list(_tensors("batches", batches))) == 10


def test_modules_and_classes_are_not_walked():
    model = torch.nn.Linear(2, 2)
    assert list(_tensors("model", model)) == []
    assert list(_tensors("kind", TensorDataset)) == []
