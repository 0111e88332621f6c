"""Gradient accumulation as timm and transformers write it: four micro-batches back-propagated,
then one SGD (momentum) step. Out of memory before the first step, the gradients alive are the
ones being accumulated, not kept from an earlier step; model states alone pass the budget."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(4)], nn.Linear(1024, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
accumulate = 4
for i in range(2 * accumulate):
    x, y = torch.randn(512, 1024), torch.randint(0, 10, (512,))
    (nn.functional.cross_entropy(model(x), y) / accumulate).backward()
    if (i + 1) % accumulate == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
print("done")
