"""Two generators of one class, chained under one cycle loss (CycleGAN's G_B2A(G_A2B(x))):
both hold their blocks' activations until the one backward."""
import torch
from torch import nn

torch.manual_seed(0)


class Generator(nn.Module):
    def __init__(self, d=512, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


g_ab, g_ba = Generator(), Generator()
optimizer = torch.optim.SGD([*g_ab.parameters(), *g_ba.parameters()], lr=0.01)
for step in range(3):
    real = torch.randn(4096, 512)
    nn.functional.l1_loss(g_ba(g_ab(real)), real).backward()
    optimizer.step()
    optimizer.zero_grad()
print("done")
