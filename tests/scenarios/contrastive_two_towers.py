"""A CLIP-style contrastive loop in the shape of open_clip's and the CLIP paper's pseudocode:
an image tower and a text tower, each sample's embeddings scored against every other's in
the batch (`logits = image @ text.T`), cross-entropy both ways. The loss compares samples
within the batch: splitting it into micro-batches would change it (fewer negatives).
`-- gradcache 4` trains the same step by gradient caching over 4 chunks (the GradCache paper's
recipe): embeddings without grad, the loss over all of them, then each chunk again with its
embeddings' gradients."""
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
BATCH, DIM = 1024, 256


class ImageTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GELU())
        self.proj = nn.Linear(64 * 8 * 8, DIM)

    def forward(self, x):
        return self.proj(self.conv(x).flatten(1))


class TextTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        self.mlp = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, DIM))

    def forward(self, ids):
        return self.mlp(self.embed(ids)).mean(1)


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual, self.text = ImageTower(), TextTower()
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, images, ids):
        return F.normalize(self.visual(images), dim=-1), F.normalize(self.text(ids), dim=-1), self.logit_scale.exp()


def clip_loss(image_features, text_features, logit_scale):
    logits_per_image = logit_scale * image_features @ text_features.T
    logits_per_text = logits_per_image.T
    labels = torch.arange(image_features.shape[0])
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cached_step(images, ids, chunks):
    with torch.no_grad():
        parts = [model(i, t)[:2] for i, t in zip(images.chunk(chunks), ids.chunk(chunks))]
    image_features = torch.cat([p[0] for p in parts]).requires_grad_()
    text_features = torch.cat([p[1] for p in parts]).requires_grad_()
    loss = clip_loss(image_features, text_features, model.logit_scale.exp())
    loss.backward()
    rows = image_features.shape[0] // chunks
    for c, (i, t) in enumerate(zip(images.chunk(chunks), ids.chunk(chunks))):
        image_part, text_part, _ = model(i, t)
        grads = image_features.grad[c * rows:(c + 1) * rows], text_features.grad[c * rows:(c + 1) * rows]
        ((image_part * grads[0]).sum() + (text_part * grads[1]).sum()).backward()
    return loss


model = CLIP()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
chunks = int(sys.argv[2]) if sys.argv[1:2] == ["gradcache"] else 0
for step in range(3):
    images, ids = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 1000, (BATCH, 16))
    optimizer.zero_grad()
    if chunks:
        loss = cached_step(images, ids, chunks)
    else:
        loss = clip_loss(*model(images, ids))
        loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
print("done")
