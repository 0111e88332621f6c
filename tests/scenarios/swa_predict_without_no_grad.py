"""Stochastic weight averaging as torch's docs write it: an `AveragedModel` updated after
each epoch, `update_bn` at the end, then `preds = swa_model(test_input)` on a large test
batch with grad mode on, the averaged model left in training mode. With `fixed`, the
prediction runs under torch.no_grad()."""
import sys

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, SWALR, update_bn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
swa_model = AveragedModel(model)
swa_scheduler = SWALR(optimizer, swa_lr=0.05)
loader = [(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))) for _ in range(4)]
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    swa_model.update_parameters(model)
    swa_scheduler.step()
update_bn(((x,) for x, _ in loader), swa_model)
test_input = torch.randn(256, 3, 32, 32)
if "fixed" in sys.argv[1:]:
    with torch.no_grad():
        preds = swa_model(test_input)
else:
    preds = swa_model(test_input)
print("done", preds.shape)
