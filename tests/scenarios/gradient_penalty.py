"""WGAN-GP's critic step as the PyTorch-GAN repository writes it: fake images from the
generator (not detached), the gradient penalty from `autograd.grad(..., create_graph=True)`
on an interpolation of real and fake, made between the passes, outside any module."""
import torch
from torch import autograd, nn

torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(100, 512), nn.LeakyReLU(0.2), nn.Linear(512, 784), nn.Tanh())
critic = nn.Sequential(nn.Linear(784, 512), nn.LeakyReLU(0.2), nn.Linear(512, 256), nn.LeakyReLU(0.2),
                       nn.Linear(256, 1))
optimizer_g = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.5, 0.999))
optimizer_d = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.999))


def gradient_penalty(real, fake):
    alpha = torch.rand(real.size(0), 1)
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    scores = critic(interpolates)
    gradients = autograd.grad(scores, interpolates, torch.ones_like(scores), create_graph=True,
                              retain_graph=True, only_inputs=True)[0]
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean()


for step in range(4):
    real = torch.rand(2048, 784) * 2 - 1
    optimizer_d.zero_grad()
    fake = generator(torch.randn(2048, 100))
    loss_d = -critic(real).mean() + critic(fake).mean() + 10 * gradient_penalty(real, fake)
    loss_d.backward()
    optimizer_d.step()
    optimizer_g.zero_grad()
    loss_g = -critic(generator(torch.randn(2048, 100))).mean()
    loss_g.backward()
    optimizer_g.step()
print("done")
