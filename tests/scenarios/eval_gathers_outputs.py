"""Trains a classifier over 1000 classes, then evaluates it under torch.no_grad(), gathering
every batch's logits in a list on the device to compute the accuracy at the end."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1000))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x, y = torch.randn(256, 256), torch.randint(0, 1000, (256,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()
all_logits, all_labels = [], []
with torch.no_grad():
    for i in range(100):
        x, y = torch.randn(512, 256), torch.randint(0, 1000, (512,))
        all_logits.append(model(x))
        all_labels.append(y)
accuracy = (torch.cat(all_logits).argmax(-1) == torch.cat(all_labels)).float().mean()
print("accuracy", accuracy.item())
