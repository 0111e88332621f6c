"""DistributedDataParallel over gloo with AdamW on a wide MLP: beside the weights, their
gradients and two moments, DDP keeps its gradient buckets (a copy of every gradient) for the
whole run unless gradient_as_bucket_view=True.

    torchrun --nproc-per-node 2 ddp_buckets.py [view]"""
import sys

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view="view" in sys.argv[1:])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(torch.randn(64, 1024)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
print("done")
