"""`memdoctor` command line. Imports torch only inside the commands that need it, so
`memdoctor --help` stays instant.

Exit codes: 0 ran and fit; 1 the script failed for a reason other than memory;
2 bad input or usage; 3 out of memory (diagnosed); 4 memdoctor's own failure.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_INTERNAL = 0, 1, 2, 3, 4


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit 2."""


def _size(text: str) -> int:
    from memdoctor.units import SizeError, parse_size
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memdoctor",
        description="Find out why PyTorch training runs out of GPU memory, and fix it.",
        epilog="exit codes: 0 fit, 1 script failed, 2 bad input, 3 out of memory, 4 internal error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("trace", help="run a script under the tracer and show its memory at the peak")
    _script_args(p)
    p.add_argument("-o", "--output", metavar="RUN", help="where to save the run (default: STEM.memrun.json.gz)")
    p = sub.add_parser("diagnose", help="name the cause of an OOM: from a script, a log, a snapshot or a run")
    _script_args(p, optional=True)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--log", metavar="FILE", help="a log or pasted error text holding OOM messages")
    src.add_argument("--snapshot", metavar="FILE", help="a torch.cuda.memory._dump_snapshot() file (read safely)")
    src.add_argument("--run", metavar="FILE", nargs="+",
                     help="a saved *.memrun.json.gz run; several: one per rank, diagnosed together")
    p.add_argument("-o", "--output", metavar="RUN", help="also save the traced run here")
    p.add_argument("--report", metavar="HTML", help="also write an HTML report here")
    p.add_argument("--try", dest="try_fix", metavar="FIX",
                   help="with SCRIPT: run it again with a remedy injected, no edit to it, and show before and "
                        "after: bf16, fp16, ckpt=full|selective|N, opt=fused, alloc=expandable_segments "
                        "(-o then saves the after run; --report shows both)")

    p = sub.add_parser("explain", help="what a rule detects, why it runs out of memory, and the fix")
    p.add_argument("rule", nargs="?", help="a rule id; without one, list them")

    p = sub.add_parser("tui", help="explore a run in the terminal: overview, timeline, modules, findings, remedies",
                       epilog="with --script, arguments after -- are passed to the script")
    p.add_argument("run", nargs="?", metavar="RUN", help="a saved *.memrun.json.gz run")
    p.add_argument("--script", metavar="SCRIPT", help="trace this training script live, then show it")
    p.add_argument("--budget", type=_size, metavar="SIZE", help="with --script: memory budget, e.g. 224MiB")
    p.add_argument("--source", choices=("auto", "dispatch", "allocator"), default="auto",
                   help="with --script: allocator (CUDA) or dispatch (any device); auto picks")
    p.add_argument("-o", "--output", metavar="RUN", help="with --script: also save the traced run here")

    p = sub.add_parser("report", help="write a self-contained HTML report of a saved run (of two: before and after)")
    p.add_argument("run", metavar="RUN", help="a saved *.memrun.json.gz run")
    p.add_argument("run2", nargs="?", metavar="RUN2", help="a second run, shown as after, with RUN as before")
    p.add_argument("-o", "--output", metavar="HTML", help="where to write the report (default: STEM.html)")

    p = sub.add_parser("estimate", help="predict the peak GPU memory of a configuration without running it",
                       epilog="SCRIPT must define build() returning (model, optimizer, batch, loss_fn) or a dict "
                              "with those keys; arguments after -- are passed to it as sys.argv")
    p.add_argument("script", nargs="?", help="a script with build(), instead of --model")
    p.add_argument("--model", metavar="NAME", help="a known model: gpt2-124m, gpt2-355m, gpt2-774m, gpt2-1.5b, "
                   "bert-base, bert-large, llama-1b, resnet50, vit-b16")
    p.add_argument("--batch", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--image-size", type=int, help="image size for resnet50")
    p.add_argument("--precision", choices=("bf16", "fp16", "bf16-true"), help="autocast, or bf16 weights")
    p.add_argument("--checkpointing", metavar="MODE", help="full, selective or a number of blocks")
    p.add_argument("--micro-batch", metavar="N", help="samples per micro-batch (gradient accumulation)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, adafactor; or an optimizer "
                   "remedy on AdamW: fused, adamw-8bit, adamw-bf16, in-backward, in-backward-8bit")
    p.add_argument("--plan", metavar="PLAN", help="a plan string, e.g. bf16,ckpt=full,micro=2")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (DDP, or ZeRO with --zero)")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage over --world-size ranks")
    p.add_argument("--budget", type=_size, metavar="SIZE", help="the allocator's limit, e.g. 16GiB "
                   "(the CUDA context comes on top)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device to predict for")
    p.add_argument("--anchors", action="store_true",
                   help="also show torch MemTracker's, DeepSpeed's and accelerate's figures (slower)")
    p.add_argument("--no-gpu-probe", action="store_true",
                   help="use no GPU memory: do not measure cuDNN's convolution workspaces on this machine's GPU")
    p.add_argument("-o", "--output", metavar="RUN", help="also save the predicted run here")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("plan", help="find the cheapest remedies that fit a memory budget, without running")
    p.add_argument("--model", required=True, metavar="NAME", help="a known model, as `memdoctor estimate` takes")
    p.add_argument("--batch", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--budget", type=_size, required=True, metavar="SIZE", help="the allocator's limit, e.g. 32GiB")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (adds ZeRO-2 plans)")
    p.add_argument("--json", action="store_true", help="print a JSON list of candidates")
    return parser


def _script_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("script", nargs="?" if optional else None, help="the training script, run as `python SCRIPT ARGS`")
    p.add_argument("--budget", type=_size, metavar="SIZE", help="memory budget, e.g. 16GiB or 224MiB")
    p.add_argument("--source", choices=("auto", "dispatch", "allocator"), default="auto",
                   help="allocator (CUDA caching allocator) or dispatch (any device); auto picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.epilog = "arguments after -- are passed to the script"


def _script_argv(ns) -> list[str]:
    return list(getattr(ns, "script_args", []))


def _check_script(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"no such script: {path}")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not a script")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read script: {path}")


def _path_for(run, path: str) -> str:
    from memdoctor.capture.ranks import path_for
    return path_for(run, path)


def cmd_trace(ns) -> int:
    _check_script(ns.script)
    from memdoctor.attribution import at_peak
    from memdoctor.report.json import dumps, trace_json
    result = _traced(ns)
    run = result.run
    peak = at_peak(run)
    out = _path_for(run, ns.output or os.path.splitext(os.path.basename(ns.script))[0] + ".memrun.json.gz")
    run.save(out)
    if ns.json:
        print(dumps(trace_json(run, peak)))
    else:
        from memdoctor.report.text import print_trace
        print_trace(run, peak)
        print(f"run saved to {out}")
    return _exit_for(result)


def _traced(ns):
    from memdoctor.capture.session import trace_script
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with contextlib.redirect_stdout(stream):
            return trace_script(ns.script, _script_argv(ns), budget=ns.budget, source=ns.source)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _exit_for(result) -> int:
    if result.oom:
        return EXIT_OOM
    if result.exit_code not in (0, None):
        if result.error:
            print(f"memdoctor: the script failed: {result.error}", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    return EXIT_OK


def cmd_diagnose(ns) -> int:
    given = [x for x in (ns.script, ns.log, ns.snapshot, ns.run) if x]
    if len(given) != 1:
        raise UsageError("give exactly one of: SCRIPT, --log FILE, --snapshot FILE, --run FILE [FILE ...]")
    if getattr(ns, "try_fix", None) is not None:
        return _diagnose_try(ns)
    if ns.log:
        return _diagnose_log(ns)
    from memdoctor.report.json import diagnosis_json, dumps
    from memdoctor.diagnosis import diagnose, facts_from_run
    if ns.script:
        _check_script(ns.script)
        result = _traced(ns)
        run, code = result.run, _exit_for(result)
        if ns.output:
            run.save(_path_for(run, ns.output))
    elif ns.snapshot:
        from memdoctor.capture.snapshot import SnapshotError, load_snapshot, snapshot_to_run
        try:
            run = snapshot_to_run(load_snapshot(ns.snapshot))
        except SnapshotError as exc:
            raise UsageError(str(exc)) from None
        code = EXIT_OOM if run.ooms else EXIT_OK
    elif len(ns.run) > 1:
        return _diagnose_ranks(ns)
    else:
        from memdoctor.run import Run
        run = Run.load(ns.run[0])
        code = EXIT_OOM if run.ooms else EXIT_OK
    facts = facts_from_run(run)
    findings = diagnose(facts)
    if ns.report:
        _write_report(run, findings, facts, ns.report)
    if ns.json:
        print(dumps(diagnosis_json(findings, facts, run)))
    else:
        from memdoctor.report.text import print_diagnosis
        print_diagnosis(findings, facts)
    return code


def _diagnose_ranks(ns) -> int:
    """Several runs, one per rank: each diagnosed, the findings merged, the ranks named."""
    from memdoctor.capture.ranks import rank_of
    from memdoctor.diagnosis.merge import first_oom, merge_findings
    from memdoctor.report.json import JSON_VERSION, diagnosis_json, dumps, oom_dict
    from memdoctor.diagnosis import diagnose, facts_from_run
    from memdoctor.run import Run
    loaded = []
    for index, path in enumerate(ns.run):
        run = Run.load(path)
        loaded.append((rank_of(run, index), run, path))
    ranks = [r for r, _, _ in loaded]
    if len(set(ranks)) != len(ranks):
        raise UsageError(f"two runs say they are the same rank ({sorted(ranks)}); give one run per rank")
    diagnosed = []
    for rank, run, path in sorted(loaded, key=lambda x: x[0]):
        facts = facts_from_run(run)
        diagnosed.append((rank, run, path, facts, diagnose(facts)))
    merged = merge_findings([(r, findings) for r, _, _, _, findings in diagnosed])
    first = first_oom([(r, run) for r, run, _, _, _ in diagnosed])
    if ns.report:
        rank, run, _, facts, findings = next(d for d in diagnosed if first is None or d[0] == first[0])
        _write_report(run, findings, facts, ns.report)
    if ns.json:
        print(dumps({
            "version": JSON_VERSION, "ranks": [r for r, *_ in diagnosed],
            "oom": first is not None, "first_oom_rank": first[0] if first else None,
            "first_oom": oom_dict(first[1]) if first else None,
            "findings": [m.to_dict() for m in merged],
            "per_rank": [{"rank": r, "run": path, **diagnosis_json(findings, facts, run)}
                         for r, run, path, facts, findings in diagnosed],
        }))
    else:
        from memdoctor.report.text import ranks_lines
        print("\n".join(ranks_lines(diagnosed, merged, first)))
    return EXIT_OOM if first is not None else EXIT_OK


def _diagnose_try(ns) -> int:
    """SCRIPT as written and with --try FIX injected, side by side; exit as the after run."""
    from memdoctor.remedies.inject import FixError, compare, comparison_json, comparison_lines, parse_fix, summary
    if not ns.script:
        raise UsageError("--try needs a SCRIPT to run again")
    try:
        fix = parse_fix(ns.try_fix)
    except FixError as exc:
        raise UsageError(str(exc)) from None
    _check_script(ns.script)
    from memdoctor.report.json import dumps
    from memdoctor.diagnosis import diagnose, facts_from_run
    try:
        with contextlib.redirect_stdout(sys.stderr if ns.json else sys.stdout):
            tried = compare(ns.script, _script_argv(ns), fix, budget=ns.budget, source=ns.source)
    except FixError as exc:
        raise UsageError(str(exc)) from None
    sides = []
    for run in (tried.before, tried.after):
        facts = facts_from_run(run)
        sides.append((run, facts, diagnose(facts)))
    data = comparison_json(tried, summary(*sides[0]), summary(*sides[1]), ns.budget)
    if ns.output:
        tried.after.save(ns.output)
    if ns.report:
        try:
            from memdoctor.report.html import write_report
            write_report(ns.report, tried.before, findings=sides[0][2], facts=sides[0][1], other_run=tried.after)
        except ImportError as exc:
            print(f"memdoctor: no HTML report: {exc}", file=sys.stderr)
    if ns.json:
        print(dumps(data))
    else:
        print("\n".join(comparison_lines(data, ns.script)))
    after = data["after"]
    if after["oom"]:
        return EXIT_OOM
    return EXIT_OK if after["exit_code"] in (0, None) else EXIT_SCRIPT_FAILED


def _write_report(run, findings, facts, path: str) -> None:
    try:
        from memdoctor.report.html import write_report
    except ImportError as exc:
        print(f"memdoctor: no HTML report: {exc}", file=sys.stderr)
        return
    write_report(path, run, findings=findings, facts=facts)


def _diagnose_log(ns) -> int:
    from memdoctor.capture.oomlog import LogError, scan_file
    from memdoctor.report.json import diagnosis_json, dumps
    from memdoctor.diagnosis import diagnose, facts_from_oom
    try:
        found = scan_file(ns.log)
    except LogError as exc:
        raise UsageError(str(exc)) from None
    if not found:
        if ns.json:
            print(dumps({"version": 1, "oom": False, "ooms": [], "findings": []}))
        else:
            print(f"no out-of-memory message found in {ns.log}")
        return EXIT_OK
    per_oom = [(oom, diagnose(facts_from_oom(oom))) for oom in found]
    first, findings = per_oom[0]
    facts = facts_from_oom(first)
    ooms = [{**oom.expected(), "line": oom.line,
             "rule": fs[0].rule if fs else None} for oom, fs in per_oom]
    if ns.json:
        print(dumps(diagnosis_json(findings, facts, None, ooms)))
    else:
        from memdoctor.report.text import diagnosis_lines
        print(f"{len(found)} out-of-memory message{'s' if len(found) > 1 else ''} in {ns.log}; "
              f"the first, at line {first.line}:")
        for line in diagnosis_lines(findings, facts):
            print(line)
    return EXIT_OOM


def cmd_explain(ns) -> int:
    from memdoctor.diagnosis.registry import all_ids, explain
    if not ns.rule:
        for rule_id in all_ids():
            print(rule_id)
        return EXIT_OK
    try:
        print(explain(ns.rule))
    except KeyError:
        raise UsageError(f"no rule {ns.rule!r}; `memdoctor explain` lists them") from None
    return EXIT_OK


def cmd_tui(ns) -> int:
    if bool(ns.run) == bool(ns.script):
        raise UsageError("give a RUN file or --script SCRIPT, one of them")
    if not ns.script and (ns.budget or ns.output):
        raise UsageError("--budget and -o go with --script")
    if ns.script:
        _check_script(ns.script)
    elif not os.path.isfile(ns.run):
        raise UsageError(f"no such run file: {ns.run}")
    if not sys.stdout.isatty():
        raise UsageError("the tui needs a terminal; `memdoctor diagnose --run RUN` prints the same diagnosis")
    try:
        import textual  # noqa: F401
    except ImportError:
        raise UsageError("the tui needs textual: pip install 'memdoctor[tui]'") from None
    from memdoctor.tui import run_app
    if ns.script:
        return run_app(script=ns.script, script_args=_script_argv(ns), budget=ns.budget,
                       source=ns.source, output=ns.output)
    return run_app(ns.run)


def cmd_report(ns) -> int:
    from memdoctor.run import Run
    try:
        from memdoctor.report.html import write_report
    except ImportError as exc:
        raise UsageError(f"the HTML report needs plotly: pip install 'memdoctor[report]' ({exc})") from None
    run = Run.load(ns.run)
    other = Run.load(ns.run2) if ns.run2 else None
    out = ns.output
    if not out:
        stem = os.path.basename(ns.run)
        for suffix in (".gz", ".json", ".memrun"):
            stem = stem.removesuffix(suffix)
        out = (stem or "report") + ".html"
    if os.path.isdir(out):
        raise UsageError(f"{out} is a folder; give a file name for the report")
    write_report(out, run, other_run=other)
    print(f"report written to {out}")
    return EXIT_OK


def cmd_estimate(ns) -> int:
    if ns.script and ns.model:
        raise UsageError("give a SCRIPT or --model, not both")
    if not ns.script and not ns.model:
        raise UsageError("give --model NAME or a SCRIPT with build(); known models: gpt2-124m, gpt2-355m, "
                         "gpt2-774m, gpt2-1.5b, bert-base, bert-large, llama-1b, resnet50, vit-b16")
    if ns.script:
        _check_script(ns.script)
    from memdoctor.predict.estimate import estimate_config
    from memdoctor.report.json import dumps
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with contextlib.redirect_stdout(stream):
            est = estimate_config(
                ns.model, ns.script, _script_argv(ns), batch=ns.batch, seq=ns.seq, image_size=ns.image_size,
                precision=ns.precision, checkpointing=ns.checkpointing, micro_batch=ns.micro_batch,
                optimizer=ns.optimizer, plan=ns.plan, world_size=ns.world_size, zero=ns.zero,
                budget=ns.budget, device=ns.device, anchors=ns.anchors,
                probe_gpu=False if ns.no_gpu_probe else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ns.output:
        est.run.save(ns.output)
    if ns.json:
        print(dumps(est.to_dict()))
    else:
        print("\n".join(est.text_lines()))
        if ns.output:
            print(f"predicted run saved to {ns.output}")
    return EXIT_OOM if est.fits is False else EXIT_OK


def cmd_plan(ns) -> int:
    import json
    from memdoctor.predict.planner import plan_for_budget
    from memdoctor.units import format_bytes as format_size
    if ns.batch < 1 or ns.world_size < 1 or (ns.seq is not None and ns.seq < 1):
        raise UsageError("--batch, --seq and --world-size must be at least 1")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            cands = plan_for_budget(ns.model, ns.batch, ns.seq, ns.budget, world_size=ns.world_size)
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[0] if str(exc) else "bad input") from None
    fitting = [c for c in cands if c.fits]
    if ns.json:
        print(json.dumps([c.to_dict() for c in (fitting or cands[:5])], indent=2))
    else:
        shown = fitting or cands[:5]
        print(f"{ns.model} batch {ns.batch}" + (f" seq {ns.seq}" if ns.seq else "") +
              f", budget {format_size(ns.budget)}: " +
              (f"{len(fitting)} plans fit, first choice on top" if fitting else
               "no plan fits; the closest ones:"))
        print(f"{'plan':<44} {'peak reserved':>13} {'cost':>6} {'H200 s':>7}  note")
        for c in shown:
            print(f"{str(c.plan):<44} {format_size(c.predicted_peak_reserved):>13} {c.cost:>6.2f} "
                  f"{c.step_seconds:>7.3f}  {c.note}")
    return EXIT_OK if fitting else EXIT_OOM


COMMANDS = {"trace": cmd_trace, "diagnose": cmd_diagnose, "explain": cmd_explain, "tui": cmd_tui,
            "report": cmd_report, "estimate": cmd_estimate, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:        # everything after `--` belongs to the user's script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    ns = parser.parse_args(argv)
    ns.script_args = script_args
    if not ns.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return COMMANDS[ns.command](ns)
    except UsageError as exc:
        print(f"memdoctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:   # one line, never a traceback, for memdoctor's own failures
        from memdoctor.run import RunFileError
        if isinstance(exc, RunFileError):
            print(f"memdoctor: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"memdoctor: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("MEMDOCTOR_DEBUG"):
            raise
        return EXIT_INTERNAL
