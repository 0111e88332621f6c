"""A leak that runs out in the second step: an autoencoder's reconstructions are kept for a
figure at the end of the epoch, `reconstructions.append(recon)`, 32 MiB a step with their
graph; only the first step's is alive when the second runs out. With `fixed`, a detached
copy of the first image of each batch is kept instead. With `reference`, a frozen copy of
the model as it was at the start, 8 times as wide, is kept beside it (to measure drift
against): the step's leak is then under a tenth of what is alive."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
fixed = "fixed" in sys.argv[1:]
model = nn.Sequential(nn.Linear(4096, 512), nn.ReLU(), nn.Linear(512, 64), nn.ReLU(),
                      nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 4096), nn.Sigmoid())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
if "reference" in sys.argv[1:]:
    reference = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096)).requires_grad_(False)
reconstructions = []
for step in range(4):
    x = torch.rand(2048, 4096)
    recon = model(x)
    loss = nn.functional.binary_cross_entropy(recon, x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    reconstructions.append(recon[:1].detach().clone() if fixed else recon)
print("done", len(reconstructions))
