"""Keeps each step's predictions (still attached to the graph) for later analysis."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 768), nn.SiLU(), nn.Linear(768, 768), nn.SiLU(), nn.Linear(768, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
kept = []
for step in range(40):
    x, y = torch.randn(1024, 128), torch.randn(1024, 8)
    hidden = model[:4](x)
    pred = model[4](hidden)
    loss = nn.functional.mse_loss(pred, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kept.append(hidden)
print("done")
