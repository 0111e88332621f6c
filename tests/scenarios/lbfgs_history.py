"""Full-batch LBFGS with a closure on a two-layer network: its state is history_size pairs
of flat parameter-sized vectors, far more than the model.

    python lbfgs_history.py [HISTORY_SIZE]"""
import sys

import torch
from torch import nn

HISTORY = int(sys.argv[1]) if len(sys.argv) > 1 else 10
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024))
x, y = torch.randn(32, 1024), torch.randn(32, 1024)
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=HISTORY, max_iter=20)
for step in range(2):
    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    print(step, optimizer.step(closure).item())
