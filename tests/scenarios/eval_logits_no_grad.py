"""A small language model that trains at batch 4 and evaluates, under torch.no_grad(), at
batch 32: the evaluation's logits over a 32k vocabulary and their cross-entropy run out."""
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
vocab, dim, seq = 32000, 64, 256
model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


@torch.no_grad()
def evaluate(batch):
    ids = torch.randint(0, vocab, (batch, seq + 1))
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).item()


for step in range(3):
    ids = torch.randint(0, vocab, (4, seq + 1))
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("eval loss", evaluate(32))
