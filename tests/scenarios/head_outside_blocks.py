"""A small decoder LM whose head and loss hold more than its blocks: an 8000-word vocabulary
over 4 x 256 tokens, the loss computed inside the model's forward and the logits returned
with it (as transformers' models do). Checkpointing the blocks leaves the head's tensors.
An argument sets the batch (4 sequences)."""
import sys

import torch
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab=8000, d=128, n=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1)), logits


batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
model = LM()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    ids = torch.randint(0, 8000, (batch, 256))
    loss, logits = model(ids, ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
