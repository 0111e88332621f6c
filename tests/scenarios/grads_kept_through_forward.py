"""Zeroes gradients in place (set_to_none=False), so a full set of gradients stays
allocated while the next forward saves its activations."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(4)])
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(1024, 2048)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
print("done")
