"""`memdoctor plan`: the cheapest remedies that fit a memory budget, found without running."""
from __future__ import annotations

import contextlib
import sys

from memdoctor.cli.common import EXIT_OK, EXIT_OOM, UsageError, size
from memdoctor.cli.hf_args import add_hf_args, hf_model
from memdoctor.cli.progress import working


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="find the cheapest remedies that fit a memory budget, without running")
    p.add_argument("--model", metavar="NAME", help="a known model, as `memdoctor estimate` takes (or --hf, --hf-config)")
    p.add_argument("--batch", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--budget", type=size, required=True, metavar="SIZE", help="the allocator's limit, e.g. 32GiB")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (adds ZeRO-2 plans)")
    p.add_argument("--json", action="store_true", help="print the candidates as JSON")
    add_hf_args(p)
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    from memdoctor.predict.planner import plan_for_budget
    if ns.batch < 1 or ns.world_size < 1 or (ns.seq is not None and ns.seq < 1):
        raise UsageError("--batch, --seq and --world-size must be at least 1")
    hf = hf_model(ns)
    if (ns.model is None) == (hf is None):
        raise UsageError("give --model NAME, or a transformers model with --hf TYPE or --hf-config FILE")
    label = ns.model or hf.name
    try:
        with working(ns, f"planning {label} within the budget"), contextlib.redirect_stdout(sys.stderr):
            model = ns.model if hf is None else hf.builder(ns.batch, seq=ns.seq)[0]
            cands = plan_for_budget(model, ns.batch, ns.seq, ns.budget, world_size=ns.world_size)
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[0] if str(exc) else "bad input") from None
    fitting = [c for c in cands if c.fits]
    shown = fitting or cands[:5]
    if ns.json:
        from memdoctor.report.json import dumps, plan_json
        print(dumps(plan_json(shown)))
    else:
        from memdoctor.report.text import plan_lines
        print("\n".join(plan_lines(label, ns.batch, ns.seq, ns.budget, shown, bool(fitting))))
    return EXIT_OK if fitting else EXIT_OOM
