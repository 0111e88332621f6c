"""Run every rule on the facts, rank the findings: what to fix first comes first."""
from __future__ import annotations

import logging
from pathlib import Path

from memdoctor.diagnosis.base import FREE_FIX, PARTIAL, Finding, Remedy, fits
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.registry import FALLBACK, RULES, load
from memdoctor.diagnosis.sources import attach_sources
from memdoctor.remedies.framework_terms import framework_of, in_terms_of

log = logging.getLogger("memdoctor")
REST_OF_STEP_RULES = ("leak", "data-on-device")


def diagnose(facts: Facts, select: list[str] | None = None) -> list[Finding]:
    findings: list[Finding] = []
    for rule_id in select or RULES:
        try:
            found = load(rule_id).check(facts)
        except Exception as exc:        # one broken rule must not hide the others
            log.warning("memdoctor: rule %s failed: %r", rule_id, exc)
            continue
        if found is not None:
            findings.append(found)
    if not findings and select is None:
        for rule_id in FALLBACK:
            found = load(rule_id).check(facts)
            if found is not None:
                findings.append(found)
    for finding in findings:
        _add_pending_state(finding, facts)
        _add_forward_rest(finding, facts)
        _keep_the_batch_whole(finding, facts)
        _fitting_first(finding, facts)
    _one_prediction_per_plan(findings, facts)
    for finding in findings:
        if finding.tier == FREE_FIX and finding.fits_after_fix is False:
            finding.tier = PARTIAL      # what the fixed run makes later still leaves it out of memory
    attach_sources(findings, facts)
    _in_framework_terms(findings, facts)
    return rank(findings)


def _in_framework_terms(findings: list[Finding], facts: Facts) -> None:
    """Each plan also in the settings of the framework that drives the run (a Trainer user
    edits TrainingArguments, not memdoctor's Plan)."""
    framework = framework_of((facts.run.meta.get("frameworks") or []) if facts.run else [])
    if framework is None:
        return
    for finding in findings:
        for remedy in finding.remedies:
            if remedy.plan:
                try:
                    terms = in_terms_of(remedy.plan, framework)
                    remedy.in_framework = f"{framework}: {terms}" if terms else None
                except ValueError as exc:       # a plan the framework's translation refuses
                    log.debug("memdoctor: %s in %s terms: %s", remedy.plan, framework, exc)


def _add_pending_state(finding: Finding, facts: Facts) -> None:
    """Rules predict from the moment of the OOM; if that came before the optimizer made
    its state (or, in a training forward, before backward made the gradients and, on CUDA,
    its thread's cuBLAS workspaces), the fixed run's later steps carry them on top."""
    pending = (facts.pending_state_bytes + facts.pending_grad_bytes + facts.pending_workspace_bytes
               if facts.source == "run" else 0)
    if _rest_of_step_applies(finding, facts):
        pending = facts.pending_state_bytes + facts.step_rest_bytes     # the grads and workspaces among it
    if not pending or finding.rule == "model-states":      # model-states counts it already
        return
    for remedy in finding.remedies:
        if remedy.predicted_peak_bytes is not None:
            remedy.predicted_peak_bytes += pending
    _refit(finding, facts)


def _add_forward_rest(finding: Finding, facts: Facts) -> None:
    """An OOM part-way through a training forward: the fixed run still runs the blocks after
    it, which save what they save (the activations rule scales them with its remedies)."""
    if not facts.forward_rest_bytes or finding.rule == "activations" or _rest_of_step_applies(finding, facts):
        return
    for remedy in finding.remedies:
        if remedy.predicted_peak_bytes is not None:
            remedy.predicted_peak_bytes += facts.forward_rest_bytes
    _refit(finding, facts)
    if facts.forward_rest_note and facts.forward_rest_note not in finding.evidence:
        finding.evidence.append(facts.forward_rest_note)


def _keep_the_batch_whole(finding: Finding, facts: Facts) -> None:
    """A loss that compares the batch's samples with one another (a contrastive loss) changes
    when the batch is split: micro-batches give way to caching the embeddings' gradients
    (GradCache), which splits the passes but computes the loss over the whole batch."""
    if not facts.in_batch_pairs:
        return
    micro = [r for r in finding.remedies if r.plan == "micro=auto"]
    if not micro:
        return
    pair = max(facts.in_batch_pairs, key=lambda b: b.nbytes)
    where = facts.run.sources[pair.source] if facts.run and 0 <= pair.source < len(facts.run.sources) else None
    finding.evidence.append(
        f"the loss compares the batch's samples with one another ({'x'.join(map(str, pair.shape))} "
        f"{pair.name}" + (f" at {Path(where[0]).name}:{where[1]}" if where else "") + "): micro-batches "
        "would change it, each sample meeting fewer others")
    for r in micro:
        finding.remedies[finding.remedies.index(r)] = Remedy(
            "gradient caching (GradCache)",
            "embed the batch in chunks without grad, compute the loss over all the embeddings, then "
            "back-propagate each chunk again with its embeddings' gradients: the same loss and gradients, "
            "a chunk's activations at a time",
            None if r.predicted_peak_bytes is None else r.predicted_peak_bytes + facts.in_batch_pair_bytes, None)


def _rest_of_step_applies(finding: Finding, facts: Facts) -> bool:
    """A fix that takes away tensors made outside the step's own work (kept from earlier steps,
    data) at an OOM in a later step's forward still runs the rest of the step: as the step
    before ran it. Fixes that change the step's work (what backward saves or makes) predict
    from the steps themselves."""
    return facts.step_rest_bytes is not None and finding.rule in REST_OF_STEP_RULES


def _refit(finding: Finding, facts: Facts) -> None:
    """Whether the finding's best fix fits, once its fixes' predictions have changed."""
    predicted = [r.predicted_peak_bytes for r in finding.remedies if r.predicted_peak_bytes is not None]
    if predicted:
        finding.fits_after_fix = fits(facts, min(predicted))


def _fitting_first(finding: Finding, facts: Facts) -> None:
    """A finding's fixes predicted to fit come first, each group in the rule's own order
    (checkpointing a flat stack of single layers keeps each layer's input: micro-batches
    then fit where it does not)."""
    finding.remedies.sort(key=lambda r: fits(facts, r.predicted_peak_bytes) is False)


def _one_prediction_per_plan(findings: list[Finding], facts: Facts) -> None:
    """One plan offered by several findings (micro-batches for the logits and for all the
    step's activations) is one change to the run, so one prediction: that of the finding
    that accounts for the most bytes, which counts the most of what the plan changes (the
    activations rule counts the logits among the activations; the logits rule keeps the
    other activations as they are)."""
    widest: dict[str, Finding] = {}
    for finding in findings:
        for r in finding.remedies:
            if r.plan and r.predicted_peak_bytes is not None and (
                    r.plan not in widest or finding.accounts_for_bytes > widest[r.plan].accounts_for_bytes):
                widest[r.plan] = finding
    predicted_by = {plan: next(r.predicted_peak_bytes for r in f.remedies if r.plan == plan)
                    for plan, f in widest.items()}
    for finding in findings:
        changed = False
        for r in finding.remedies:
            if r.plan in predicted_by and r.predicted_peak_bytes not in (None, predicted_by[r.plan]):
                r.predicted_peak_bytes, changed = predicted_by[r.plan], True
        if changed:
            _refit(finding, facts)
            _fitting_first(finding, facts)


def rank(findings: list[Finding]) -> list[Finding]:
    """By tier (free fixes that alone make it fit, then specific parts, then structural
    causes, then partial fixes), then by the memory each accounts for."""
    return sorted(findings, key=lambda f: (f.tier, -f.accounts_for_bytes))
