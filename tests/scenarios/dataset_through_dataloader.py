"""Moves a whole dataset to the device and serves it through a DataLoader: every batch is
collated into a new tensor, the dataset itself is never a model input."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x, y = torch.randn(180_000, 256), torch.randint(0, 10, (180_000,))
loader = DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=512, shuffle=True)
del x, y
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step == 4:
        break
print("done")
