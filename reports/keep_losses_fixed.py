"""examples/keep_losses.py with the leak fixed: the loop keeps `loss.item()` (a number) and
no longer asks backward to retain the graph, so each step's graph is freed.

Run: python reports/keep_losses_fixed.py
     memdoctor trace reports/keep_losses_fixed.py --budget 96MiB
"""
import torch
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

history = []
for step in range(40):
    x = torch.randn(2048, 128, device=device)
    y = torch.randn(2048, 1, device=device)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    history.append(loss.item())
print(f"final loss {history[-1]:.4f}")
print("done")
