"""A loop that catches the OOM and skips the batch, as fairseq's trainer does: one batch of
the twelve is 16 times the others and runs out in its forward. The model is a flat stack of
Linears and ReLUs, whose checkpoint segments would keep exactly what its layers save."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
skipped = []
for step, rows in enumerate([512] * 5 + [8192] + [512] * 6):
    x, y = torch.randn(rows, 1024), torch.randint(0, 10, (rows,))
    try:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    except torch.OutOfMemoryError:
        print(f"out of memory at step {step} ({rows} rows): skipping the batch")
        skipped.append(step)
        loss = None
    optimizer.zero_grad(set_to_none=True)
print("skipped", skipped)
