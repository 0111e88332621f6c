"""A word-level language model trained a few steps with hand-written SGD (its gradients stay
until the next step zeroes them), then evaluated under no_grad with every batch's
log-probabilities kept in a list: the kept outputs grow each batch, the gradients do not."""
import torch
from torch import nn

VOCAB, EMB, BATCH, BPTT = 32000, 128, 5, 64
torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.GRU(EMB, EMB)
        self.decoder = nn.Linear(EMB, VOCAB)

    def forward(self, x):
        out, _ = self.rnn(self.encoder(x))
        return nn.functional.log_softmax(self.decoder(out).view(-1, VOCAB), dim=1)


model = Model()
for step in range(2):
    model.zero_grad()
    data = torch.randint(0, VOCAB, (BPTT, BATCH))
    loss = nn.functional.nll_loss(model(data), data.view(-1))
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)

model.eval()
kept = []
with torch.no_grad():
    for batch in range(8):
        data = torch.randint(0, VOCAB, (BPTT, BATCH))
        output = model(data)
        kept.append(output)         # every batch's log-probabilities stay
print("done")
