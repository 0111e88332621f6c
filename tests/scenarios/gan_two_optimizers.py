"""A GAN step in DCGAN's order, correct as written: D on real data (backward), fake = G(z),
D on fake.detach() (backward), D's step, then D(fake) for G's step, whose backward reaches
G through D. Two models, two Adam optimizers: model states are both models' (16 bytes a
parameter once each has stepped), and G's forward is back-propagated later in the step."""
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 784))
D = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
optimizer_d = torch.optim.Adam(D.parameters(), 2e-4)
optimizer_g = torch.optim.Adam(G.parameters(), 2e-4)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(1024, 1), torch.zeros(1024, 1)
for step in range(3):
    optimizer_d.zero_grad()
    bce(D(torch.rand(1024, 784)), ones).backward()
    fake = G(torch.randn(1024, 64))
    loss_d = bce(D(fake.detach()), zeros)
    loss_d.backward()
    optimizer_d.step()
    optimizer_g.zero_grad()
    loss_g = bce(D(fake), ones)
    loss_g.backward()
    optimizer_g.step()
print("done")
