"""Real code on CUDA: the own real-world cases (tests/realworld/cases.json) and the shared
ones (../shared/realworld/cases.json) that carry a CUDA budget, diagnosed on a GPU with the
allocator source (the default) and with the dispatch source; the first finding must be the
case's cause under both. A CPU budget is no CUDA budget: the caching allocator, capped at the budget under
either source, reserves cuBLAS's workspaces and rounds every block, so a case runs out
earlier than on the CPU (benchmarks/realworld_cuda_budgets.py found each case's CUDA budget:
benchmarks/results/realworld_cuda_budgets_h200_2026-12-02.json). And nanoGPT unmodified (GPT-2 124M, bf16, batch 64) under 24 GiB: its first
evaluation's logits, never evaluation without no_grad (`estimate_loss` is under
@torch.no_grad())."""
import json
import os

import pytest

from tests.realworld.test_realworld import CASES, check_line, diagnose, prepare
from tests.support.paths import shared_path

pytestmark = pytest.mark.gpu

NANOGPT_B64 = {
    "name": "nanogpt_gpt2_b64_bf16", "dir": "shared:realworld/nanogpt", "prepare": ["make_data.py"],
    "script": "train.py", "budget": {"cuda": "24GiB"}, "cause": "large-logits",
    "absent": ["eval-without-no-grad"],
    "args_cuda": ["--device=cuda", "--compile=False", "--dtype=bfloat16", "--dataset=fake",
                  "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_iters=1", "--eval_interval=1000",
                  "--always_save_checkpoint=False", "--out_dir=out", "--batch_size=64"],
    "why": "the first evaluation at batch 64 makes 64 x 1024 x 50304 logits and their cross-entropy"}


def _on_cuda(case: dict) -> dict:
    """The case with CUDA arguments: nanoGPT's --device, word_language_model's --accel;
    transformers' scripts pick the GPU themselves."""
    case = dict(case)
    if "args_cuda" not in case:
        args = ["--device=cuda" if a == "--device=cpu" else a for a in case.get("args", [])]
        if "word_language_model" in case["dir"] and "--accel" not in args:
            args.append("--accel")
        case["args_cuda"] = args
    return case


def _shared_cases() -> list[dict]:
    path = shared_path("realworld", "cases.json")
    raw = json.loads(path.read_text())
    cases = raw["cases"] if isinstance(raw, dict) else raw
    return [{**c, "dir": "shared:realworld/" + c["dir"]} for c in cases]


def _cases() -> list[dict]:
    own = [_on_cuda(c) for c in CASES if "cuda" in c["budget"]]
    try:
        shared = [_on_cuda(c) for c in _shared_cases() if "cuda" in c["budget"]]
    except BaseException:       # collected without ../shared: those cases are left out
        shared = []
    return own + shared + [NANOGPT_B64]


RESULTS = os.environ.get("MEMDOCTOR_GPU_RESULTS")


def _record(case: dict, source: str, out: dict) -> None:
    """Each run's findings, for the results file of a GPU session."""
    if not RESULTS:
        return
    line = {"case": case["name"], "source": source, "cause": case["cause"],
            "rules": [f["rule"] for f in out["findings"]],
            "first": out["findings"][0] if out["findings"] else None}
    with open(RESULTS, "a") as f:
        f.write(json.dumps(line, default=str)[:4000] + "\n")


@pytest.mark.parametrize("source", ["allocator", "dispatch"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["name"])
def test_real_code_cause_comes_first_on_cuda(case, source, tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    work = tmp_path / "case"
    prepare(case, work)
    out = diagnose(case, work, kind="cuda", options=("--source", source))
    _record(case, source, out)
    rules = [f["rule"] for f in out["findings"]]
    assert rules and rules[0] == case["cause"], (case["why"], source, rules, out["findings"][:1])
    assert not set(rules) & set(case.get("absent", [])), rules
    check_line(case, out["findings"][0])
