"""A character-level language model over a 3,000-symbol alphabet (CJK text, byte-pair
vocabularies of small tokenizers): narrower than a word vocabulary, but with many tokens a
batch its logits, their log-softmax in the loss and their gradient are most of the memory."""
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, DIM, BATCH, SEQ = 3000, 128, 32, 256


class CharLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                  nn.Linear(2 * DIM, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


model = CharLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
