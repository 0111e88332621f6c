"""Three EMA copies of the model, updated after each step and never called: their weights
count with the model's states (they were taken for a dataset held on the device)."""
import copy
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])
opt = torch.optim.AdamW(model.parameters())
emas = [copy.deepcopy(model) for _ in range(3)]       # three EMA copies at different decays
for step in range(3):
    loss = model(torch.randn(64, 2048)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for ema, decay in zip(emas, (0.9, 0.99, 0.999)):
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.mul_(decay).add_(p, alpha=1 - decay)
print("done")
