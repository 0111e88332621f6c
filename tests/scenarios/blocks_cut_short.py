"""A stack of six attention blocks trained with AdamW that runs out in its second block
in the first step: the blocks after it never ran, yet a fix must carry what they save.

    python blocks_cut_short.py BATCH [accelerate] [kept] [ckpt] [cuda]

accelerate: the optimizer wrapped as accelerate's Accelerator.prepare wraps it (as
transformers' Trainer does); kept: each block keeps its attention weights on a custom
Function's ctx (not through save_for_backward), which no saved-tensor hook sees; ckpt: each
block checkpointed (torch.utils.checkpoint), so that it runs out recomputing one in backward."""
import sys

import torch
import torch.utils.checkpoint
from torch import nn

BATCH, SEQ, WIDTH, HEADS, BLOCKS = int(sys.argv[1]), 256, 128, 4, 6
WRAP, KEEP, CKPT = ("accelerate" in sys.argv[2:], "kept" in sys.argv[2:], "ckpt" in sys.argv[2:])
DEVICE = "cuda" if "cuda" in sys.argv[2:] else "cpu"


class SoftmaxOnCtx(torch.autograd.Function):
    """softmax that keeps its output on ctx, as hand-written kernels often do."""

    @staticmethod
    def forward(ctx, x):
        ctx.out = torch.softmax(x, dim=-1)
        return ctx.out.clone()

    @staticmethod
    def backward(ctx, grad):
        out = ctx.out
        return out * (grad - (grad * out).sum(-1, keepdim=True))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (c // HEADS) ** 0.5
        att = SoftmaxOnCtx.apply(scores) if KEEP else torch.softmax(scores, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 512)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if CKPT else block(x)
        return self.head(x)


torch.manual_seed(0)
model = Model().to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
if WRAP:
    from accelerate import Accelerator
    model, optimizer = Accelerator(cpu=True).prepare(model, optimizer)
for step in range(3):
    ids = torch.randint(0, 512, (BATCH, SEQ), device=DEVICE)
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("done")
