"""The user's line of each finding: where the memory it accounts for was made, or for
memory kept alive (a list that grows, gradients zeroed in place) the line that keeps it.

One place for every rule: a rule may name its blocks (`Finding.blocks`); otherwise they
are picked here from the facts by the rule's id. Of those blocks, the line that made the
most bytes wins; passes never back-propagated point at the line that called the model;
rules about the failed request itself point at the line that asked.
"""
from __future__ import annotations

import bisect
from collections import Counter

from memdoctor.run import Block, Category, Phase, Run, Source

W, G, S = Category.WEIGHTS.value, Category.GRADIENTS.value, Category.OPTIMIZER_STATE.value
ACT, TMP, INP = Category.ACTIVATIONS.value, Category.TEMPORARIES.value, Category.INPUTS.value
# rules about the request that failed or the device, not about memory a line made
_AT_THE_OOM = {"oversized-request", "fragmentation", "other-processes", "device-full"}


def attach_sources(findings, facts) -> None:
    """Set `finding.source` on each finding whose line can be found. Never raises."""
    run: Run | None = getattr(facts, "run", None)
    if run is None or not (run.sources or run.meta.get("kept_by")):
        return
    for finding in findings:
        try:
            finding.source = source_of(finding, facts, run)
        except Exception:           # a line is a help, never a reason to lose the finding
            finding.source = None


def source_of(finding, facts, run: Run) -> dict | None:
    oom_line = run.source_at(run.ooms[0].source) if run.ooms else None
    if finding.rule in _AT_THE_OOM:
        return _entry(oom_line, "asked for the memory that did not fit") if oom_line else None
    blocks = list(finding.blocks) or _blocks_for(finding.rule, facts)
    made = _made_at(run, blocks)
    if finding.rule == "eval-without-no-grad":
        site = _call_site(run, blocks)
        if site is not None:
            out = _entry(site, "calls the model with grad mode on; no backward ever reaches it")
            if made is not None and made != site:
                out["made_at"] = _entry(made, "made the memory")
            return out
    kept = _kept_by(run, blocks, share=0 if finding.rule == "leak" else KEPT_SHARE,
                    in_forward=finding.rule != "activations")
    if kept is not None:
        source, holder = kept
        what = "gradients, zeroed in place and not freed" if holder == "gradients zeroed in place" \
            else f"tensors added to `{holder}`"
        out = _entry(source, f"keeps them alive ({what})")
        if made is not None and made != source:
            out["made_at"] = _entry(made, "made them")
        return out
    if made is not None:
        return _entry(made, "made the memory")
    return _entry(oom_line, "asked for the memory that did not fit") if oom_line else None


def _entry(source: Source, role: str) -> dict:
    return {**source.to_dict(), "role": role}


def _blocks_for(rule: str, f) -> list[Block]:
    """The blocks a rule's finding accounts for, from the facts."""
    focus = f.focus_blocks
    if rule == "leak":
        return f.leaked
    if rule == "eval-without-no-grad":
        return [b for b in focus if b.phase == Phase.FORWARD_NO_BACKWARD.value]
    if rule == "data-on-device":
        return list(getattr(f, "dataset", None) or []) or [
            b for b in focus if b.category == INP and b.phase == Phase.OTHER.value]
    if rule == "grads-during-forward":
        return [b for b in focus if b.category == G]
    if rule == "large-logits":     # the projection's line, not the labels' (a multi-hot target is as wide)
        return [b for b in f.logits if b.category != INP and b.phase != Phase.OTHER.value] or f.logits
    if rule == "optimizer-step-temporaries":
        return [b for b in focus if b.phase == Phase.OPTIMIZER.value and b.category == TMP]
    if rule == "activations":
        step = f.focus.step if f.focus is not None else None
        return [b for b in focus if b.category == ACT and b.step == step] or [b for b in focus if b.category == ACT]
    if rule == "model-states":
        return [b for b in focus if b.category in (W, G, S)]
    return sorted(focus, key=lambda b: b.nbytes, reverse=True)[:20]


def _made_at(run: Run, blocks: list[Block]) -> Source | None:
    """The line that made the most of these blocks' bytes."""
    by_line: Counter = Counter()
    for b in blocks:
        if b.source >= 0:
            by_line[b.source] += b.nbytes
    if not by_line:
        return None
    return run.source_at(by_line.most_common(1)[0][0])


def _call_site(run: Run, blocks: list[Block]) -> Source | None:
    """The user's line that called the model whose passes made the most of these blocks'
    bytes (a model defined in the script makes its memory inside its own forward; the
    fix, no_grad around the call, goes where it is called)."""
    calls = sorted((c["seq_start"], c["seq_end"] if type(c.get("seq_end")) is int else run.num_events, c["site"])
                   for c in run.meta.get("forward_calls", []) if isinstance(c, dict)
                   and type(c.get("seq_start")) is int and isinstance(c.get("site"), list) and len(c["site"]) == 3)
    if not calls:
        return None
    starts = [c[0] for c in calls]
    by_site: Counter = Counter()
    for b in blocks:
        i = bisect.bisect_right(starts, b.alloc_seq) - 1
        if i >= 0 and b.alloc_seq < calls[i][1]:
            by_site[tuple(calls[i][2])] += b.nbytes
    if not by_site:
        return None
    file, line, function = by_site.most_common(1)[0][0]
    return Source(str(file), int(line), str(function))


KEPT_SHARE = 0.1        # a container holding less of a finding's bytes does not say what keeps them


def _in_a_forward(run: Run, source) -> bool:
    line = run.source_at(source) if type(source) is int else None
    return line is not None and line.function == "forward"


def _kept_by(run: Run, blocks: list[Block], share: float = KEPT_SHARE,
             in_forward: bool = True) -> tuple[Source, str] | None:
    """The line that keeps the most of these blocks' bytes alive (`share` of them at least:
    a leak's list may hold its tensors inside a dict, which the search for holders does not
    open, so any of them will do there), and what holds them. `in_forward` off: a list local
    to a module's forward (each step's outputs of a recurrent loop, joined at its end) is the
    pass's own working list, not what keeps saved activations alive: their graph does."""
    kept = run.meta.get("kept_by") or []
    if not kept or not blocks:
        return None
    size = {b.id: b.nbytes for b in blocks}
    best, best_bytes = None, 0
    for entry in kept:
        if not in_forward and "." not in str(entry.get("holder", "")) and _in_a_forward(run, entry.get("source")):
            continue
        held = sum(size.get(i, 0) for i in entry.get("blocks", ()) if type(i) is int)
        if held > best_bytes and type(entry.get("source")) is int:
            best, best_bytes = entry, held
    if best is None or best_bytes < share * sum(size.values()):
        return None             # a list holding a sliver of them (attention weights kept for a plot)
    source = run.source_at(best["source"])
    return (source, str(best.get("holder", ""))) if source is not None else None
