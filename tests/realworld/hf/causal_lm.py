"""Fine-tunes a transformers GPT-2 (built from a config, random weights: no download) as a
causal LM with a hand-written loop: a DataLoader over token ids, AdamW, evaluation under
no_grad. Ours, in the shape of transformers' own no-trainer examples; the real-world cases
bring one known cause into it with a one- or two-line change (tests/realworld/cases.json).

    python causal_lm.py [--layers N] [--embd N] [--vocab N] [--batch N] [--seq N]
                        [--steps N] [--samples N] [--eval-batch N] [--eval-batches N]
"""
import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--embd", type=int, default=128)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--vocab", type=int, default=50257)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--samples", type=int, default=256)
ap.add_argument("--eval-batch", type=int, default=8)
ap.add_argument("--eval-batches", type=int, default=2)
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                    n_head=args.heads, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

ids = torch.randint(0, args.vocab, (args.samples, args.seq))
train = DataLoader(TensorDataset(ids), batch_size=args.batch, shuffle=True)
held_out = DataLoader(TensorDataset(ids[: args.eval_batch * args.eval_batches]), batch_size=args.eval_batch)


@torch.no_grad()
def evaluate():
    model.eval()
    losses = []
    for (batch,) in held_out:
        batch = batch.to(device)
        out = model(input_ids=batch, labels=batch)
        losses.append(out.loss.item())
    model.train()
    return sum(losses) / len(losses)


model.train()
step = 0
while step < args.steps:
    for (batch,) in train:
        batch = batch.to(device)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step >= args.steps:
            break
print(f"eval loss {evaluate():.3f}")
