"""Trains a transformers T5 (built from a config, random weights: no download) as a
sequence-to-sequence model with a hand-written loop: source and target token ids, labels
passed to the model (its own cross-entropy over the vocabulary), AdamW.

    python seq2seq.py [--vocab N] [--d-model N] [--layers N] [--batch N] [--src N] [--tgt N] [--steps N]
"""
import argparse

import torch
from transformers import T5Config, T5ForConditionalGeneration

ap = argparse.ArgumentParser()
ap.add_argument("--vocab", type=int, default=32128)
ap.add_argument("--d-model", type=int, default=64)
ap.add_argument("--layers", type=int, default=1)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--src", type=int, default=64)
ap.add_argument("--tgt", type=int, default=64)
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = T5Config(vocab_size=args.vocab, d_model=args.d_model, d_kv=16, d_ff=2 * args.d_model,
                  num_layers=args.layers, num_decoder_layers=args.layers, num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
for step in range(args.steps):
    src = torch.randint(1, args.vocab, (args.batch, args.src), device=device)
    tgt = torch.randint(1, args.vocab, (args.batch, args.tgt), device=device)
    out = model(input_ids=src, labels=tgt)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {out.loss.item():.3f}")
