"""A Dataset that decodes each clip on first access and caches the spectrogram on the
device in __getitem__, to skip decoding in the next epoch: the first epoch fills the cache."""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

DEVICE = "cpu"


class DecodedAudio(Dataset):
    def __init__(self, n):
        self.n, self.cache = n, {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i not in self.cache:
            g = torch.Generator().manual_seed(i)
            wave = torch.randn(32000, generator=g)                 # "decode" two seconds of audio
            spec = torch.stft(wave, 400, 80, window=torch.hann_window(400), return_complex=True).abs()
            self.cache[i] = spec.to(DEVICE)
        return self.cache[i], i % 10


torch.manual_seed(0)
loader = DataLoader(DecodedAudio(600), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Conv1d(201, 64, 5), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 10))
model = model.to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    for spec, label in loader:
        loss = nn.functional.cross_entropy(model(spec.to(DEVICE)), label.to(DEVICE))
        opt.zero_grad()
        loss.backward()
        opt.step()
print("done")
