"""A model whose weights alone pass the budget: five 4096x4096 Linears (320 MiB in fp32),
built on the device, as a script does with `torch.set_default_device("cuda")` or
`from_pretrained(..., device_map="cuda")`. With `data`, a dataset is preloaded on the device
before the model is built. With `convert`, two of them are built and then converted to
float64 (`model.double()`), the way a model is moved with `.to()`."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
if "data" in sys.argv[1:]:
    images = torch.rand(9600, 4096)             # 150 MiB
    labels = torch.randint(0, 10, (9600,))
layers = 2 if "convert" in sys.argv[1:] else 5
model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(layers)])
if "convert" in sys.argv[1:]:
    model = model.to(torch.float64)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(torch.randn(8, 4096, dtype=next(model.parameters()).dtype)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
