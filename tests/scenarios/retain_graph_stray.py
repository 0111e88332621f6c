"""pytorch/examples' MNIST network with a stray `loss.backward(retain_graph=True)` (added to
silence "Trying to backward through the graph a second time"): each step's saved tensors
stay alive through `optimizer.step()` and the next forward, until `output` and `loss` are
bound again. With `fixed`, plain `loss.backward()`; with `count`, prints the bytes one
training forward saves for backward (storages counted once, parameters left out) and stops."""
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
fixed = "fixed" in sys.argv[1:]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


model = Net()
if "count" in sys.argv[1:]:
    seen, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.nll_loss(model(torch.randn(64, 1, 28, 28)), torch.randint(0, 10, (64,)))
    print("saved", sum(seen.values()))
    sys.exit(0)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    data, target = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizer.zero_grad()
    output = model(data)
    loss = F.nll_loss(output, target)
    loss.backward(retain_graph=not fixed)
    optimizer.step()
print("done")
