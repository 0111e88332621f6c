"""Six MLP blocks the model checkpoints itself, with torch.utils.checkpoint: non-reentrant by
default, reentrant with `reentrant`; with `transformers`, a LLaMA-like model with
gradient_checkpointing_enable(), as peft's and transformers' docs write it. Out of memory in the
first forward, before any backward: checkpointing is on already and must not be offered."""
import sys

import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

torch.manual_seed(0)
mode = sys.argv[1] if sys.argv[1:] else "non-reentrant"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                    for _ in range(6))
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint.checkpoint(layer, x, use_reentrant=mode == "reentrant")
        return self.head(x)


if mode == "transformers":
    import transformers
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.train()

    def batch():
        ids = torch.randint(0, 1000, (8, 512))
        return {"input_ids": ids, "labels": ids}

    def loss_of(b):
        return model(**b).loss
else:
    model = Net()

    def batch():
        return torch.randn(16384, 256, requires_grad=mode == "reentrant"), torch.randint(0, 10, (16384,))

    def loss_of(b):
        return nn.functional.cross_entropy(model(b[0]), b[1])
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    loss_of(batch()).backward()
    optimizer.step()
    optimizer.zero_grad()
print("done")
