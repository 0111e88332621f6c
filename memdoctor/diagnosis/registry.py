"""The explicit table of rules: id -> module. Selection and `memdoctor explain` read it."""
from __future__ import annotations

import importlib
from types import ModuleType

RULES: dict[str, str] = {
    "oversized-request": "oversized_request",
    "other-processes": "other_processes",
    "fragmentation": "fragmentation",
    "leak": "leak",
    "retained-graph": "retained_graph",
    "eval-without-no-grad": "eval_without_no_grad",
    "optimizer-step-temporaries": "optimizer_step_temporaries",
    "grads-never-stepped": "grads_never_stepped",
    "grads-during-forward": "grads_during_forward",
    "data-on-device": "data_on_device",
    "large-logits": "large_logits",
    "model-states": "model_states",
    "activations": "activations",
}
FALLBACK = {"device-full": "device_full", "working-set": "working_set"}


def load(rule_id: str) -> ModuleType:
    name = RULES.get(rule_id) or FALLBACK.get(rule_id)
    if name is None:
        raise KeyError(rule_id)
    return importlib.import_module(f"memdoctor.diagnosis.rules.{name}")


def explain(rule_id: str) -> str:
    """The rule's documented sections (what, why, example, fix)."""
    module = load(rule_id)
    return (module.__doc__ or rule_id).strip()


def all_ids() -> list[str]:
    return [*RULES, *FALLBACK]
