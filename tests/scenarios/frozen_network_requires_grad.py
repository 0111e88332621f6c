"""A network no optimizer trains, left requiring grad: `loss-net` is fast_neural_style's
perceptual loss (a VGG-like feature net on the model's output and on the target), `teacher`
is knowledge distillation (a teacher in eval mode, called on the batch without no_grad).
Backward fills the frozen net's gradients every step, and saves its activations for them.
With `fixed`, the net is `requires_grad_(False)` first."""
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
mode = sys.argv[1]
fixed = "fixed" in sys.argv[2:]


def features():
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())


if mode == "loss-net":
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 3, 3, padding=1))
    frozen = features().eval()
else:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    frozen = nn.Sequential(features(), nn.Linear(256, 10)).eval()
if fixed:
    frozen.requires_grad_(False)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.rand(16, 3, 32, 32)
    optimizer.zero_grad()
    if mode == "loss-net":
        loss = F.mse_loss(frozen(model(x)), frozen(x))
    else:
        target = F.softmax(frozen(x) / 2.0, dim=1)
        loss = F.kl_div(F.log_softmax(model(x) / 2.0, dim=1), target, reduction="batchmean")
    loss.backward()
    optimizer.step()
print("done")
