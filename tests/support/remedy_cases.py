"""The scenarios tests/test_remedy_memory.py measures, re-stated as their scripts have them
(model, data, seed, optimizer; the scripts are not imported), and the measuring of one
under memdoctor.watch before and after its remedy. tests/gpu/test_remedy_memory_gpu.py runs
the same cases on a GPU.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import memdoctor
from memdoctor.attribution import peak
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.remedies import Plan, chunked_cross_entropy, prepare
from memdoctor.units import format_bytes, parse_size
from tests.support.paths import shared_path


# where the restated loops make their data: tests/gpu/test_remedy_memory_gpu.py sets "cuda" (an
# explicit device, as the scripts have it, rather than a torch.device context: with torch
# 2.11 a checkpoint's recompute under that context fails, which no script here does)
DEVICE = "cpu"


def expected(name: str) -> dict:
    return json.loads(shared_path("scenarios", "expected.json").read_text())[name]


# ---- the scenarios, re-stated --------------------------------------------------------------
# Each loop trains through prepare(); `fixed` switches the remedy on, nothing else changes.

def s02_build():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def s02_loop(model, optimizer, fixed):
    """The script runs 3 steps; 2 reach its peak (the second is the first with momentum
    buffers, the third repeats the second)."""
    prepared = prepare(model, optimizer, Plan(micro_batch=4096) if fixed else Plan())
    for _ in range(2):
        x = torch.randn(16384, 256, device=DEVICE)
        y = torch.randint(0, 10, (16384,), device=DEVICE)
        prepared.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))


class S03Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        return self.out((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, d))


class S03Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = S03Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def s03_build():
    torch.manual_seed(0)
    model = nn.Sequential(*[S03Block(128, 4) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def s03_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan(checkpointing="full") if fixed else Plan())
    for _ in range(2):
        prepared.step(torch.randn(2, 2048, 128, device=DEVICE), lambda m, x: m(x).pow(2).mean())


class S04Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh())
        self.head = nn.Linear(1024, 1)

    def forward(self, x):
        emb = self.body(x)
        return emb, self.head(emb)


def s04_build():
    torch.manual_seed(0)
    model = S04Encoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def s04_keep(emb: torch.Tensor):
    """The fix: a detached copy off the device. On a GPU that is emb.detach().cpu(); on the
    CPU, where .cpu() is the same storage, the copy goes to NumPy memory, which the
    simulated budget (torch's tensors) does not count, as a GPU's does not count host RAM."""
    if emb.device.type != "cpu":
        return emb.detach().cpu()
    return emb.detach().numpy().copy()


def s04_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan())
    embeddings, out = [], {}

    def loss_fn(m, batch):
        out["emb"], pred = m(batch[0])
        return (pred - batch[1]).pow(2).mean()
    for _ in range(60):
        x = torch.randn(1024, 256, device=DEVICE)
        y = torch.randn(1024, 1, device=DEVICE)
        prepared.step((x, y), loss_fn)
        emb = out.pop("emb")
        embeddings.append(s04_keep(emb) if fixed else emb)
    assert len(embeddings) == 60


def s05_build():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 100),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def s05_loop(model, optimizer, fixed):
    """The script runs 2 epochs; one reaches its peak (plain SGD keeps no state, so the
    second epoch makes the first's tensors again)."""
    prepared = prepare(model, optimizer, Plan())
    for _ in range(1):
        model.train()
        for _ in range(4):
            x = torch.randn(1024, 512, device=DEVICE)
            y = torch.randint(0, 100, (1024,), device=DEVICE)
            prepared.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        optimizer.zero_grad(set_to_none=True)   # as the script: no gradients left for the evaluation
        model.eval()
        correct = 0
        with torch.no_grad() if fixed else torch.enable_grad():
            for _ in range(2):
                x = torch.randn(8192, 512, device=DEVICE)
                y = torch.randint(0, 100, (8192,), device=DEVICE)
                correct += (model(x).argmax(dim=-1) == y).sum().item()


S06_VOCAB, S06_DIM, S06_SEQ, S06_BATCH = 32000, 128, 512, 4


class S06TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(S06_VOCAB, S06_DIM)
        self.mix = nn.GRU(S06_DIM, S06_DIM, batch_first=True)
        self.head = nn.Linear(S06_DIM, S06_VOCAB, bias=False)

    def forward(self, ids, logits=True):
        hidden, _ = self.mix(self.embed(ids))
        return self.head(hidden) if logits else hidden


def s06_build():
    torch.manual_seed(0)
    model = S06TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def s06_full_loss(m, ids):
    logits = m(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, S06_VOCAB), ids[:, 1:].reshape(-1))


def s06_chunked_loss(m, ids):
    return chunked_cross_entropy(m(ids[:, :-1], logits=False), m.head.weight, ids[:, 1:], chunks=8)


def s06_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan())
    for _ in range(2):
        ids = torch.randint(0, S06_VOCAB, (S06_BATCH, S06_SEQ + 1), device=DEVICE)
        prepared.step(ids, s06_chunked_loss if fixed else s06_full_loss)


S08_VOCAB, S08_DIM, S08_HEADS, S08_LAYERS, S08_SEQ, S08_CHOICES = 1024, 256, 4, 6, 1024, 2


class S08Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(S08_DIM)
        self.qkv = nn.Linear(S08_DIM, 3 * S08_DIM)
        self.proj = nn.Linear(S08_DIM, S08_DIM)
        self.ln2 = nn.LayerNorm(S08_DIM)
        self.mlp = nn.Sequential(nn.Linear(S08_DIM, 4 * S08_DIM), nn.GELU(), nn.Linear(4 * S08_DIM, S08_DIM))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, S08_HEADS, d // S08_HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class S08DoubleHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(S08_VOCAB, S08_DIM)
        self.wpe = nn.Embedding(S08_SEQ, S08_DIM)
        self.blocks = nn.ModuleList(S08Block() for _ in range(S08_LAYERS))
        self.ln_f = nn.LayerNorm(S08_DIM)
        self.lm_head = nn.Linear(S08_DIM, S08_VOCAB, bias=False)
        self.mc_head = nn.Linear(S08_DIM, 1)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[-1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x), self.mc_head(x[:, -1]).squeeze(-1)


def s08_build():
    torch.manual_seed(0)
    model = S08DoubleHeads()
    return model, torch.optim.AdamW(model.parameters(), lr=6.25e-5)


def s08_loss(m, ids):
    lm_logits, mc_logits = m(ids)
    lm_loss = F.cross_entropy(lm_logits[:, :-1].reshape(-1, S08_VOCAB), ids[:, 1:].reshape(-1))
    mc_loss = F.cross_entropy(mc_logits.view(2, S08_CHOICES), torch.zeros(2, dtype=torch.long, device=mc_logits.device))
    return lm_loss + mc_loss


def s08_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan(checkpointing="full") if fixed else Plan())
    for _ in range(2):
        prepared.step(torch.randint(0, S08_VOCAB, (2 * S08_CHOICES, S08_SEQ), device=DEVICE), s08_loss)


@dataclass(frozen=True)
class Case:
    build: Callable
    loop: Callable
    remedy: str                        # what the test applies
    matches: Callable                  # picks the finding's remedy whose prediction is shown


def _plan_is(prefix: str) -> Callable:
    return lambda r: (r.plan or "").startswith(prefix)


def _title_has(word: str) -> Callable:
    return lambda r: word in r.title


CASES = {
    "s02_large_batch_mlp.py": Case(s02_build, s02_loop, "micro=4096", _plan_is("micro")),
    "s03_long_sequence_attention.py": Case(s03_build, s03_loop, "ckpt=full", _plan_is("ckpt=full")),
    "s04_collect_embeddings.py": Case(s04_build, s04_loop, "keep emb.detach() off the device", _title_has("detached")),
    "s05_validation_pass.py": Case(s05_build, s05_loop, "validation under torch.no_grad()", _title_has("no_grad")),
    "s06_language_model_head.py": Case(s06_build, s06_loop, "chunked_cross_entropy(chunks=8)", _title_has("chunked")),
    "s08_gpt2_doubleheads_finetune.py": Case(s08_build, s08_loop, "ckpt=full", _plan_is("ckpt=full")),
}


# ---- measuring -------------------------------------------------------------------------------
@dataclass
class Measured:
    scenario: str
    cause: str
    remedy: str
    budget_bytes: int
    before_oom: bool
    before_peak_bytes: int
    before_first_rule: str | None
    predicted_remedy: str | None
    predicted_peak_bytes: int | None
    after_oom: bool
    after_peak_bytes: int

    def line(self) -> str:
        def fmt(n):
            return format_bytes(n) if n is not None else "-"
        return (f"{self.scenario:34} budget {fmt(self.budget_bytes):>10} | before {fmt(self.before_peak_bytes):>10}"
                f"{' OOM' if self.before_oom else '    '} | after {fmt(self.after_peak_bytes):>10}"
                f"{' OOM' if self.after_oom else '    '} | predicted {fmt(self.predicted_peak_bytes):>10}"
                f" ({self.predicted_remedy}) | {self.remedy}")


def watched(case: Case, budget: int, fixed: bool):
    """(run, out of memory?) of the case's loop under memdoctor.watch."""
    model, optimizer = case.build()
    oom = False
    try:
        with memdoctor.watch(model, optimizer, budget=budget, source="dispatch") as doc:
            case.loop(model, optimizer, fixed)
    except torch.OutOfMemoryError:
        oom = True
    assert doc.run is not None, "the tracer did not start"
    return doc.run, oom


def measure(name: str) -> Measured:
    case, exp = CASES[name], expected(name)
    budget = parse_size(exp["budget"]["cpu"])
    before, before_oom = watched(case, budget, fixed=False)
    findings = diagnose(facts_from_run(before))
    finding = next((f for f in findings if f.rule == exp["cause"]), None)
    remedy = next((r for r in finding.remedies if case.matches(r)), None) if finding else None
    after, after_oom = watched(case, budget, fixed=True)
    return Measured(
        scenario=name, cause=exp["cause"], remedy=case.remedy, budget_bytes=budget,
        before_oom=before_oom, before_peak_bytes=peak(before)[1],
        before_first_rule=findings[0].rule if findings else None,
        predicted_remedy=(remedy.plan or remedy.title) if remedy else None,
        predicted_peak_bytes=remedy.predicted_peak_bytes if remedy else None,
        after_oom=after_oom, after_peak_bytes=peak(after)[1])


def measure_all() -> list[dict]:
    return [asdict(measure(name)) for name in CASES]
