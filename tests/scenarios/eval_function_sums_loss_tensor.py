"""A conv net validated every 5 steps by a function that forgets torch.no_grad() and sums
the batch losses as a tensor; the caller keeps the float."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        x = F.relu(self.c3(x))
        return self.fc(x.mean((2, 3)))


def validate(model, batches):
    model.eval()
    total = 0
    for x, y in batches:
        total = total + F.cross_entropy(model(x), y)
    model.train()
    return total / len(batches)


torch.manual_seed(0)
net = ConvNet()
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
val = [(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))) for _ in range(6)]
history = []
for step in range(1, 11):
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0:
        history.append(validate(net, val).item())
print("done", history)
