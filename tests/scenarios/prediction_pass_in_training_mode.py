"""pytorch/examples' time_sequence_prediction with its prediction pass left out of
`torch.no_grad()` and the model left in training mode: each step trains on 100 time steps,
then predicts 1000 future steps from another line; unrolled over 1100 time steps with grad on,
the cells save what a backward that never comes would need. With `fixed`, the prediction runs
under `torch.no_grad()`."""
import sys

import torch
from torch import nn

torch.manual_seed(0)
fixed = "fixed" in sys.argv[1:]


class Sequence(nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, x, future=0):
        outputs = []
        h = c = h2 = c2 = torch.zeros(x.size(0), self.hidden)
        for x_t in x.split(1, dim=1):
            h, c = self.lstm1(x_t, (h, c))
            h2, c2 = self.lstm2(h, (h2, c2))
            output = self.linear(h2)
            outputs += [output]
        for _ in range(future):
            h, c = self.lstm1(output, (h, c))
            h2, c2 = self.lstm2(h, (h2, c2))
            output = self.linear(h2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


waves = torch.sin(torch.arange(101).float() / 20 + torch.rand(64, 1) * 60)
x, y, test_input = waves[:48, :-1], waves[:48, 1:], waves[48:, :-1]
model = Sequence()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(3):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    if fixed:
        with torch.no_grad():
            pred = model(test_input, future=1000)
    else:
        pred = model(test_input, future=1000)
    print(step, loss.item(), pred[:, -1].abs().mean().item())
