"""A language model updated by hand (`p.data.add_(p.grad, alpha=-lr)`, no optimizer), as
older example code does, with its `model.zero_grad()` left out: the gradients stay allocated
(and keep summing) through every later forward. They are under a tenth of the memory beside
the logits, but without them the next step's request would fit."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
VOCAB, DIM, BATCH, SEQ = 8192, 256, 32, 64
ZERO = "--zero-grad" in sys.argv


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return torch.log_softmax(self.decoder(self.encoder(self.embed(ids))), dim=-1)


model = LM()
criterion = nn.NLLLoss()
lr = 0.1
for step in range(3):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    if ZERO:
        model.zero_grad()
    output = model(ids[:, :-1])
    loss = criterion(output.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
print("done")
