"""Extreme multi-label classification: a bag-of-words encoder and a 30,000-label output
layer trained with BCE-with-logits against multi-hot targets at batch 512."""
import torch
import torch.nn as nn

L = 30_000
torch.manual_seed(0)
model = nn.Sequential(nn.EmbeddingBag(20_000, 128, mode="mean"), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, L))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.BCEWithLogitsLoss()
for step in range(3):
    tokens = torch.randint(0, 20_000, (512, 40))
    targets = torch.zeros(512, L)
    targets.scatter_(1, torch.randint(0, L, (512, 5)), 1.0)
    loss = loss_fn(model(tokens), targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done")
