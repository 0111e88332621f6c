"""An MLP-mixer over 64 patches trained under torch.autocast(bfloat16) at batch 128: the
activations are saved in 16 bits already."""
import torch
import torch.nn as nn


class Mixer(nn.Module):
    def __init__(self, tokens=64, d=256):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tok = nn.Sequential(nn.Linear(tokens, 256), nn.GELU(), nn.Linear(256, tokens))
        self.ch = nn.Sequential(nn.Linear(d, 1024), nn.GELU(), nn.Linear(1024, d))

    def forward(self, x):
        x = x + self.tok(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.ln2(x))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(48, 256), *[Mixer() for _ in range(4)], nn.LayerNorm(256), nn.Flatten(), nn.Linear(64 * 256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x, y = torch.randn(128, 64, 48), torch.randint(0, 10, (128,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done")
