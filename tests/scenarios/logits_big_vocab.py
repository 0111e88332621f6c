"""A bag-of-embeddings next-token model over a 50k vocabulary."""
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
vocab, dim = 50000, 64
model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(2):
    ids = torch.randint(0, vocab, (8, 257))
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
