"""A deep, narrow ReLU network trained on one huge batch: every layer saves a
batch x width activation."""
import torch
from torch import nn

torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [nn.Linear(512, 512), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(512, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(2):
    x, y = torch.randn(8192, 512), torch.randn(8192, 1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
