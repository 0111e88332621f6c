"""A triplet network as pytorch/examples writes one: one embedding net called on anchor,
positive and negative, from three lines, and one triplet loss over the three outputs. The
three passes' graphs wait for that one backward; no pass has a loss of its own."""
import torch
from torch import nn

torch.manual_seed(0)
embed = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(6)], nn.Linear(1024, 128))
optimizer = torch.optim.SGD(embed.parameters(), lr=0.01)
loss_fn = nn.TripletMarginLoss()
for step in range(3):
    anchor, positive, negative = (torch.randn(1024, 1024) for _ in range(3))
    a = embed(anchor)
    p = embed(positive)
    n = embed(negative)
    loss_fn(a, p, n).backward()
    optimizer.step()
    optimizer.zero_grad()
print("done")
