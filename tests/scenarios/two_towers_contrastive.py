"""A CLIP-style dual encoder: two towers of one class, called once each, and a symmetric
InfoNCE loss over the B x B similarity of a 3072 batch."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Tower(nn.Module):
    def __init__(self, d_in, d):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 128))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


torch.manual_seed(0)
image_tower, text_tower = Tower(512, 512), Tower(300, 512)
logit_scale = nn.Parameter(torch.tensor(2.659))
params = list(image_tower.parameters()) + list(text_tower.parameters()) + [logit_scale]
opt = torch.optim.AdamW(params, lr=1e-4)
B = 3072
for step in range(3):
    img, txt = torch.randn(B, 512), torch.randn(B, 300)
    zi, zt = image_tower(img), text_tower(txt)
    logits = logit_scale.exp() * zi @ zt.t()
    target = torch.arange(B)
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
print("done")
