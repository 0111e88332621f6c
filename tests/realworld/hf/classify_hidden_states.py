"""Fine-tunes a transformers BERT classifier (built from a config, random weights: no
download) in a hand-written loop that asks for the hidden states and keeps, each step, what
its end-of-epoch metrics need: the predictions, and the [CLS] vector of every layer for a
probe. Ours, in the shape of hand-written transformers fine-tuning loops; a real-world case
brings a leak into it with a one-line change (tests/realworld/cases.json).

    python classify_hidden_states.py [--layers N] [--hidden N] [--batch N] [--seq N] [--steps N]
"""
import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--steps", type=int, default=12)
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = BertConfig(vocab_size=3000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=4, intermediate_size=4 * args.hidden,
                    max_position_embeddings=max(args.seq, 64), num_labels=3)
model = BertForSequenceClassification(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

epoch = []
model.train()
for step in range(args.steps):
    ids = torch.randint(0, 3000, (args.batch, args.seq), device=device)
    labels = torch.randint(0, 3, (args.batch,), device=device)
    outputs = model(input_ids=ids, labels=labels, output_hidden_states=True)
    outputs.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # clone: a slice of a hidden state is a view that would keep all of it
    kept = {"pred": outputs.logits.argmax(-1), "cls": [h[:, 0].detach().clone() for h in outputs.hidden_states]}
    epoch.append(kept)
accuracy = torch.cat([e["pred"] for e in epoch]).eq(0).float().mean()
print(f"accuracy {accuracy.item():.3f}, probe inputs {len(epoch[0]['cls'])} layers")
