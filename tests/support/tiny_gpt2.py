"""A GPT-2 small enough to train a few steps on a CPU, built from a config (no download), and
random token data for it: what the framework integration tests train."""
import torch

VOCAB, SEQ, BATCH = 256, 64, 16


def config():
    from transformers import GPT2Config
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                      bos_token_id=0, eos_token_id=0)


def model():
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(config())


def tokens(rows: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(0))


class TokenDataset(torch.utils.data.Dataset):
    """Random tokens as a causal LM's examples: the labels are the inputs."""

    def __init__(self, rows: int = 64):
        self.x = tokens(rows)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def predicted_peak(plan: str | None) -> int:
    """memdoctor's estimate of one AdamW training step of model() on a batch, with `plan`
    applied by memdoctor.remedies: the live bytes at the peak, on the CPU."""
    from memdoctor.predict.estimate import estimate
    x = tokens(BATCH)
    est = estimate(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), {"input_ids": x, "labels": x},
                   lambda m, b: m(**b).loss, plan=plan, device="cpu", settle=False)
    return est.peak_allocated_bytes
