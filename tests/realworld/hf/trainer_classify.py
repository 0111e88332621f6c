"""Fine-tunes a transformers BERT classifier (built from a config, random weights: no download)
with transformers' own Trainer, unchanged: the loop, the optimizer and the evaluation are the
Trainer's. Random token ids stand in for a tokenized dataset.

    python trainer_classify.py [--batch N] [--seq N] [--steps N] [--layers N] [--hidden N]
"""
import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--heads", type=int, default=4)
args = ap.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 30522, (rows, args.seq), generator=g)
        self.labels = torch.randint(0, 2, (rows,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(args.seq, dtype=torch.long),
                "labels": self.labels[i]}


torch.manual_seed(0)
config = BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    intermediate_size=4 * args.hidden, max_position_embeddings=args.seq, num_labels=2)
model = BertForSequenceClassification(config)
training = TrainingArguments(output_dir="out", per_device_train_batch_size=args.batch, max_steps=args.steps,
                             learning_rate=5e-5, logging_steps=1, save_strategy="no", report_to=[],
                             dataloader_pin_memory=False, use_cpu=not torch.cuda.is_available())
trainer = Trainer(model=model, args=training, train_dataset=Tokens(args.batch * args.steps))
trainer.train()
print("done")
