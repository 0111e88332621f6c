"""`memdoctor diagnose`: name the cause of an OOM, from a script, a log, a snapshot or saved runs."""
from __future__ import annotations

import contextlib
import os
import sys

from memdoctor.cli.common import (EXIT_OK, EXIT_OOM, EXIT_SCRIPT_FAILED, UsageError, add_script_args, check_script,
                                  need_extra, script_argv)
from memdoctor.cli.launcher import launched
from memdoctor.cli.progress import working
from memdoctor.cli.trace import default_run_path, exit_for, traced


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="name the cause of an OOM: from a script, a log, a snapshot or a run")
    add_script_args(p, optional=True)
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
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    given = [x for x in (ns.script, ns.log, ns.snapshot, ns.run) if x]
    if len(given) != 1:
        raise UsageError("give exactly one of: SCRIPT, --log FILE, --snapshot FILE, --run FILE [FILE ...]")
    if getattr(ns, "try_fix", None) is not None:
        return _diagnose_try(ns)
    if ns.log:
        return _diagnose_log(ns)
    from memdoctor.diagnosis import diagnose, facts_from_run
    from memdoctor.report.json import diagnosis_json, dumps
    if ns.script:
        check_script(ns.script)
        result = traced(ns)
        run, code = result.run, exit_for(result)
        if launched(run):
            return _diagnose_launched(ns, run, code)
        if ns.output:
            from memdoctor.capture.ranks import path_for
            run.save(path_for(run, ns.output))
    elif ns.snapshot:
        from memdoctor.capture.snapshot import SnapshotError, read_snapshot
        try:
            run = read_snapshot(ns.snapshot)
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
    if ns.json:
        print(dumps(diagnosis_json(findings, facts, run)))
    else:
        from memdoctor.report.text import print_diagnosis
        print_diagnosis(findings, facts)
    if ns.report:
        _write_report(ns.report, run, findings, facts)
    return code


def _diagnose_launched(ns, run, code: int) -> int:
    """One of several ranks (torchrun, accelerate launch): each rank saves its run; rank 0
    waits for the others' and prints one diagnosis of them all; the others print nothing."""
    from memdoctor.cli.launcher import done, gather, release_peers, save_for_rank, speaks, wait_for_rank0
    base = ns.output or default_run_path(ns.script)
    save_for_rank(run, base)
    if not speaks(run):
        if run.ooms:
            # the others may be blocked in a collective this rank left: it leaves now, with 0 so
            # that the launcher lets rank 0 run on to report, which exits 3 for it
            release_peers()
            return 0
        wait_for_rank0(base)
        return code
    try:
        ns.run = gather(run, base)
        merged = _diagnose_ranks(ns)
    finally:
        done(base)
    return merged if merged == EXIT_OOM else code


def _diagnose_ranks(ns) -> int:
    """Several runs, one per rank: each diagnosed, the findings merged, the ranks named."""
    from memdoctor.capture.ranks import rank_of
    from memdoctor.diagnosis import diagnose, facts_from_run
    from memdoctor.diagnosis.merge import first_oom, merge_findings
    from memdoctor.report.json import dumps, ranks_json
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
    if ns.json:
        print(dumps(ranks_json(diagnosed, merged, first)))
    else:
        from memdoctor.report.text import ranks_lines
        print("\n".join(ranks_lines(diagnosed, merged, first)))
    if ns.report:
        rank, run, _, facts, findings = next(d for d in diagnosed if first is None or d[0] == first[0])
        _write_report(ns.report, run, findings, facts)
    return EXIT_OOM if first is not None else EXIT_OK


def _diagnose_try(ns) -> int:
    """SCRIPT as written and with --try FIX injected, side by side; exit as the after run."""
    from memdoctor.remedies.inject import FixError, compare, parse_fix
    if not ns.script:
        raise UsageError("--try needs a SCRIPT to run again")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # its ranks would meet again in a second process group the launcher's store still
        # holds the first one's addresses for
        raise UsageError("--try runs the script twice in each process, which a launch of several ranks cannot; "
                         "under the launcher, apply the fix in the script (memdoctor.remedies.prepare) and diagnose "
                         "again, or --try it on one rank")
    try:
        fix = parse_fix(ns.try_fix)
    except FixError as exc:
        raise UsageError(str(exc)) from None
    check_script(ns.script)
    from memdoctor.diagnosis import diagnose, facts_from_run
    from memdoctor.report.json import comparison_json, dumps
    try:
        with working(ns, f"running {ns.script} as written, then with {ns.try_fix}"), \
                contextlib.redirect_stdout(sys.stderr if ns.json else sys.stdout):
            tried = compare(ns.script, script_argv(ns), fix, budget=ns.budget, source=ns.source)
    except FixError as exc:
        raise UsageError(str(exc)) from None
    sides = []
    for run in (tried.before, tried.after):
        facts = facts_from_run(run)
        sides.append((run, facts, diagnose(facts)))
    data = comparison_json(tried, sides[0], sides[1], ns.budget)
    if ns.output:
        tried.after.save(ns.output)
    if ns.json:
        print(dumps(data))
    else:
        from memdoctor.report.text import comparison_lines
        print("\n".join(comparison_lines(data, ns.script)))
    if ns.report:
        (before, facts, findings), (after, after_facts, after_findings) = sides
        _write_report(ns.report, before, findings, facts, other_run=after, other_findings=after_findings,
                      other_facts=after_facts)
    after = data["after"]
    if after["oom"]:
        return EXIT_OOM
    return EXIT_OK if after["exit_code"] in (0, None) else EXIT_SCRIPT_FAILED


def _write_report(path: str, run, findings, facts, **after) -> None:
    """The HTML report, after the diagnosis is printed; without plotly, a UsageError naming
    the extra to install."""
    need_extra("plotly", "report", "the HTML report")
    from memdoctor.report.html import write_report
    write_report(path, run, findings, facts, **after)



def _diagnose_log(ns) -> int:
    from memdoctor.capture.oomlog import LogError, scan_file
    from memdoctor.diagnosis import diagnose, facts_from_oom
    from memdoctor.report.json import diagnosis_json, dumps, log_without_oom_json
    try:
        found = scan_file(ns.log)
    except LogError as exc:
        raise UsageError(str(exc)) from None
    if not found:
        if ns.json:
            print(dumps(log_without_oom_json()))
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
