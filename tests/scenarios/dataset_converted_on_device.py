"""A dataset made on the device up front and converted there, as the fast CIFAR-10 trainers do:
uint8 images (12 MiB), then a float copy (48 MiB) that runs out before any model has run."""
import torch
from torch import nn

torch.manual_seed(0)
raw = torch.randint(0, 256, (4096, 3, 32, 32), dtype=torch.uint8)
images = raw.float().div_(255)
labels = torch.randint(0, 10, (4096,))
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(4):
    idx = torch.randint(0, 4096, (128,))
    loss = nn.functional.cross_entropy(model(images[idx]), labels[idx])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
print("done")
