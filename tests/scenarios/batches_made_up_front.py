"""The training set cut into 60 batches and moved to the device before training, one list
of (inputs, labels) pairs that the loop walks: all of it held for the whole run."""
import torch
from torch import nn
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
# the whole training set cut into batches and moved to the device up front
batches = [(torch.randn(256, 3, 32, 32).to(device), torch.randint(0, 10, (256,)).to(device)) for _ in range(60)]
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
print("done")
