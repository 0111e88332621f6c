"""A triplet net in the shape of the siamese/triplet repositories: an embedding net of a
convolution stack (`convnet`) and a head of three Linears (`fc`), called on anchor, positive
and negative by a wrapper. Nearly all that is saved is the convolutions' feature maps: the
list to checkpoint is `convnet`, though `fc` has more like layers."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.convnet = nn.Sequential(nn.Conv2d(1, 32, 5), nn.PReLU(), nn.MaxPool2d(2, stride=2),
                                     nn.Conv2d(32, 64, 5), nn.PReLU(), nn.MaxPool2d(2, stride=2))
        self.fc = nn.Sequential(nn.Linear(64 * 4 * 4, 256), nn.PReLU(), nn.Linear(256, 256), nn.PReLU(),
                                nn.Linear(256, 2))

    def forward(self, x):
        return self.fc(self.convnet(x).flatten(1))


class TripletNet(nn.Module):
    def __init__(self, embedding_net):
        super().__init__()
        self.embedding_net = embedding_net

    def forward(self, a, p, n):
        return self.embedding_net(a), self.embedding_net(p), self.embedding_net(n)


model = TripletNet(EmbeddingNet())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):
    a, p, n = model(*(torch.rand(128, 1, 28, 28) for _ in range(3)))
    loss = F.relu((a - p).pow(2).sum(1) - (a - n).pow(2).sum(1) + 1.0).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
