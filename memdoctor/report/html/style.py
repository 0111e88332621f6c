"""The report's colours and the unit its charts' byte axes are drawn in."""
from __future__ import annotations

import numpy as np

from memdoctor.run import Phase

CATEGORY_COLORS = {
    "weights": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#b07aa1",
    "activations": "#59a14f", "temporaries": "#edc948", "inputs": "#76b7b2", "other": "#bab0ac",
}
PHASE_COLORS = {
    Phase.FORWARD.value: "rgba(78,121,167,0.10)",
    Phase.BACKWARD.value: "rgba(242,142,43,0.12)",
    Phase.OPTIMIZER.value: "rgba(176,122,161,0.16)",
    Phase.FORWARD_NO_BACKWARD.value: "rgba(214,39,40,0.16)",
}
OOM_COLOR, BUDGET_COLOR, PEAK_COLOR = "#d62728", "#7f0000", "#222222"


def axis_unit(top: float) -> tuple[str, int]:
    if top >= 2 * 1024**3:
        return "GiB", 1024**3
    if top >= 1024**2:
        return "MiB", 1024**2
    return "KiB", 1024


def scaled(values, scale: int) -> list:
    arr = np.asarray(values, dtype=np.float64) / scale
    return np.round(arr, 4).tolist()
