"""A remedy's plan in the terms of the framework that drives the user's run: one line a
Trainer, Lightning or accelerate user can act on, where `Plan(...)` is memdoctor's own API
they cannot plug into `trainer.train()`."""
from __future__ import annotations

from memdoctor.remedies.framework_settings import settings_for
from memdoctor.remedies.plan import Plan

# where each framework takes its settings
_WHERE = {"transformers": "TrainingArguments({})", "lightning": "Trainer({})", "accelerate": "its config file, {}"}
# micro-batches of a quarter, as each framework accumulates gradients
_QUARTER = {"transformers": "TrainingArguments(per_device_train_batch_size=a quarter of it, "
                            "gradient_accumulation_steps=4 times it): the same effective batch",
            "lightning": "Trainer(accumulate_grad_batches=4 times it) with a quarter of the DataLoader's "
                         "batch_size: the same effective batch",
            "accelerate": "Accelerator(gradient_accumulation_steps=4 times it) with a quarter of the "
                          "DataLoader's batch_size, stepping inside `with accelerator.accumulate(model):`"}


def framework_of(frameworks: list[str]) -> str | None:
    """The one whose settings the user edits: the Trainer over the accelerate under it."""
    for name in ("transformers", "lightning", "accelerate"):
        if name in frameworks:
            return name
    return None


def in_terms_of(plan: str, framework: str) -> str | None:
    """`plan` (a remedy's) as one line of `framework`'s settings; None where it has none."""
    parsed = Plan.parse(plan)
    parts = []
    if parsed.micro_batch == "auto":
        parts.append(_QUARTER[framework])
        parsed = Plan.parse(",".join(p for p in plan.split(",") if not p.startswith("micro")) or "")
        if not str(parsed):
            return "; ".join(parts)
    settings = settings_for(parsed, framework)
    values = {k: v for k, v in settings.values.items() if not (framework == "accelerate" and v in ("NO", "no"))}
    if values:
        parts.append(_WHERE[framework].format(", ".join(f"{k}={v!r}" for k, v in values.items())))
    parts += [why for why in settings.unsupported.values()]
    return "; ".join(parts) or None
