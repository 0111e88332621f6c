"""Trains on small batches, then scores a large held-out batch without torch.no_grad()."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1536), nn.GELU(), nn.Linear(1536, 1536), nn.GELU(), nn.Linear(1536, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for epoch in range(2):
    model.train()
    for step in range(3):
        x, y = torch.randn(512, 256), torch.randint(0, 2, (512,))
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    scores = [model(torch.randn(6144, 256)).softmax(-1)[:, 1].mean() for _ in range(2)]
print("done")
