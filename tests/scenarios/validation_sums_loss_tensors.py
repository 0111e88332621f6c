"""Trains an MLP on large batches, then validates on small ones without torch.no_grad(),
summing `val_loss += loss`: every batch's graph stays alive through the sum. With `nograd`,
as it should be: the training step stays the run's peak."""
import contextlib
import sys

import torch
from torch import nn

torch.manual_seed(0)
correct = "nograd" in sys.argv[1:]
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    model.train()
    x, y = torch.randn(2048, 512), torch.randint(0, 10, (2048,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

model.eval()
val_loss = 0.0
with torch.no_grad() if correct else contextlib.nullcontext():
    for _ in range(16):
        x, y = torch.randn(512, 512), torch.randint(0, 10, (512,))
        val_loss += nn.functional.cross_entropy(model(x), y)
print("validation loss", float(val_loss) / 16)
