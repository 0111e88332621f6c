"""transformers' Trainer evaluating a causal LM with compute_metrics: without
eval_accumulation_steps its evaluation loop joins every batch's logits into one tensor on the
device, a longer one each batch, until it runs out (a language model's logits are
batch x sequence x vocabulary floats).

    python trainer_eval_gathers_logits.py [EVAL_ROWS] [loss-only] [--eval-batch N]

loss-only: prediction_loss_only=True, no compute_metrics: nothing is gathered. --eval-batch:
per_device_eval_batch_size (8)."""
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

ROWS, SEQ, VOCAB = int(sys.argv[1]) if len(sys.argv) > 1 else 160, 128, 8000
LOSS_ONLY = "loss-only" in sys.argv[2:]
EVAL_BATCH = int(sys.argv[sys.argv.index("--eval-batch") + 1]) if "--eval-batch" in sys.argv else 8
torch.manual_seed(0)
config = AutoConfig.for_model("gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
model = AutoModelForCausalLM.from_config(config)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.ids = torch.randint(0, VOCAB, (rows, SEQ))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def accuracy(eval_preds):
    logits, labels = eval_preds
    return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}


args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, per_device_eval_batch_size=EVAL_BATCH,
                         max_steps=2, save_strategy="no", report_to=[], use_cpu=True,
                         dataloader_pin_memory=False, disable_tqdm=True, prediction_loss_only=LOSS_ONLY)
trainer = Trainer(model=model, args=args, train_dataset=Blocks(8), eval_dataset=Blocks(ROWS),
                  compute_metrics=None if LOSS_ONLY else accuracy)
trainer.train()
print(trainer.evaluate())
