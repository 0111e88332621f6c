"""A regression loss that broadcasts (N, 1) predictions against (N,) targets into N x N."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(64, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(2):
    x, y = torch.randn(16384, 64), torch.randn(16384)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
