"""A wide model under Adam whose gradients are zeroed in place (set_to_none=False): a full
set of gradients stays allocated while the next forward saves its activations, where the
model's states alone would fit."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(2048, 1024)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
print("done")
