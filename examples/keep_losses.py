"""A small regression model whose training loop keeps every step's loss tensor (not
`loss.item()`) in a list for a plot, so each step's autograd graph stays alive.

Run: python examples/keep_losses.py      (finishes on a big machine)
     memdoctor diagnose examples/keep_losses.py --budget 96MiB
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
    loss.backward(retain_graph=True)
    optimizer.step()
    history.append(loss)
print(f"final loss {history[-1].item():.4f}")
print("done")
