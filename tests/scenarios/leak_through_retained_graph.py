"""Two loss histories, as a GAN's loop keeps them: `main_losses` holds losses whose graph
their backward freed (4 bytes each), `aux_losses` holds losses back-propagated with
retain_graph=True, whose graphs keep the auxiliary head's activations, step after step."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
aux = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1))
optimizer = torch.optim.SGD([*model.parameters(), *aux.parameters()], lr=0.01)
main_losses, aux_losses = [], []
for step in range(12):
    h = model(torch.randn(1024, 256))
    loss_aux = aux(h.detach()).pow(2).mean()
    loss_aux.backward(retain_graph=True)
    loss_main = h.pow(2).mean()
    loss_main.backward()
    optimizer.step()
    optimizer.zero_grad()
    main_losses.append(loss_main)
    aux_losses.append(loss_aux)
print("done")
