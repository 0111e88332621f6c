"""A leak that runs out in the third step: each step's logits (8 MiB, with their graph) are
kept for an epoch's accuracy, `all_logits.append(logits)`; too few steps for a slope, but the
same line's tensor from each earlier step is alive. With `fixed`, the argmax is kept instead."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
fixed = "fixed" in sys.argv[1:]
model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8192))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
all_logits = []
for step in range(3):
    x, y = torch.randn(256, 256), torch.randint(0, 8192, (256,))
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    all_logits.append(logits.detach().argmax(-1) if fixed else logits)
print("done", len(all_logits))
