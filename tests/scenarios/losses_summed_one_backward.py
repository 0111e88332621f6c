"""Gradient accumulation done by summing the losses of 16 micro-batches and calling backward
once: every micro-batch's graph (its saved activations) waits for that one backward."""
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)], nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
accum = 16
for step in range(3):
    total = 0
    for micro in range(accum):       # every micro-batch's graph stays until the one backward below
        x = torch.randn(128, 1024); y = torch.randint(0, 10, (128,))
        total = total + nn.functional.cross_entropy(model(x), y) / accum
    total.backward()
    opt.step(); opt.zero_grad()
print("done")
