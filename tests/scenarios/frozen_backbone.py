"""A frozen backbone of four MLP blocks and a trained 10-way head. With `all`, AdamW is handed
every parameter (as peft's examples do after get_peft_model): frozen ones get no gradient and
no state, so the run is the same as with only the head's parameters. With `nograd` the
backbone runs under torch.no_grad(); a number is the batch (2048)."""
import contextlib
import sys

import torch
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d=512, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        with torch.no_grad() if "nograd" in sys.argv else contextlib.nullcontext():
            for block in self.blocks:
                x = block(x)
        return self.head(x)


model = Net()
model.blocks.requires_grad_(False)
optimizer = torch.optim.AdamW(model.parameters() if "all" in sys.argv else model.head.parameters())
rows = next((int(a) for a in sys.argv[1:] if a.isdigit()), 2048)
for step in range(4):
    x, y = torch.randn(rows, 512), torch.randint(0, 10, (rows,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
print("done")
