"""A small LM trained under bf16 autocast, as nanoGPT's train.py runs it: its loss's
log-softmax over a 16k vocabulary stays in fp32 and is most of what is saved, yet autocast
is on already and bf16 is no fix to offer."""
import torch
from torch import nn

torch.manual_seed(0)
VOCAB, WIDTH, ROWS = 16384, 256, 2048
model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                      nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    ids, targets = torch.randint(0, VOCAB, (ROWS,)), torch.randint(0, VOCAB, (ROWS,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(ids), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
