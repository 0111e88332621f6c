"""A wide two-layer regressor trained with Adam on tiny batches: parameters, gradients
and Adam's two moments dwarf the activations."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3072, 3072), nn.Tanh(), nn.Linear(3072, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
for step in range(3):
    x, y = torch.randn(4, 3072), torch.randn(4, 1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
