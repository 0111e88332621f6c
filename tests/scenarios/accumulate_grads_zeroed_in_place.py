"""Gradient accumulation over 4 micro-batches with `optimizer.zero_grad(set_to_none=False)`
(timm's and many image-classification scripts' habit): the gradients stay allocated, but from
the second micro-batch on each step's own backward uses them anyway, so freeing them before
the forward (`set_to_none=True`) leaves the peak where it is. With `none`, set_to_none=True."""
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
to_none = "none" in sys.argv[1:]
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                      nn.Flatten(), nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 100))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
ACCUMULATE = 4
for step in range(3):
    for micro in range(ACCUMULATE):
        x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 100, (32,))
        loss = F.cross_entropy(model(x), y) / ACCUMULATE
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=to_none)
print("done")
