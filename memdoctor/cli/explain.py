"""`memdoctor explain`: what a rule detects, why it runs out of memory, and the fix."""
from __future__ import annotations

from memdoctor.cli.common import EXIT_OK, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="what a rule detects, why it runs out of memory, and the fix")
    p.add_argument("rule", nargs="?", help="a rule id; without one, list them")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
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
