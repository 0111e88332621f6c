"""Twenty-four 768-wide layers trained with AdamW's multi-tensor (foreach) step."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(768, 768) for _ in range(24)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
for step in range(3):
    loss = model(torch.randn(8, 768)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
