"""Plan: which remedies to apply, as a value and as a short string.

The string form ("bf16,ckpt=full,micro=4096") is what the CLI takes and prints, so this
module must not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

PRECISIONS = ("bf16", "fp16", "bf16-true")
# the frameworks' names for the same precisions (Lightning's Trainer(precision=...))
PRECISION_ALIASES = {"bf16-mixed": "bf16", "16-mixed": "fp16", "fp16-mixed": "fp16"}
CHECKPOINT_MODES = ("full", "selective")
OPTIMIZERS = ("fused", "adamw-8bit", "adamw-bf16", "in-backward", "in-backward-8bit")
ZERO_STAGES = (1, 2, 3)

_FORMS = (
    "bf16 | fp16 | bf16-true (or bf16-mixed, 16-mixed), ckpt=full|selective|N, micro=N|auto, "
    f"opt={'|'.join(OPTIMIZERS)}, zero={'|'.join(map(str, ZERO_STAGES))}"
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Plan:
    """A combination of remedies; None everywhere means "change nothing".

    precision: "bf16"/"fp16" autocast (fp16 with a loss scaler), "bf16-true" bf16 weights
    with fp32 master copies (Lightning's "bf16-mixed" and "16-mixed" are read as bf16 and
    fp16). checkpointing: "full", "selective", or the number of leading blocks to
    checkpoint. micro_batch: samples per micro-batch, or "auto" (halve on OOM).
    optimizer: an optimizer swap. zero: a ZeRO stage.
    """

    precision: Union[str, None] = None
    checkpointing: Union[str, int, None] = None
    micro_batch: Union[int, str, None] = None
    optimizer: Union[str, None] = None
    zero: Union[int, None] = None

    def __post_init__(self) -> None:
        if self.precision in PRECISION_ALIASES:
            object.__setattr__(self, "precision", PRECISION_ALIASES[self.precision])
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} or None, not {self.precision!r}")
        ckpt = self.checkpointing
        if ckpt is not None and ckpt not in CHECKPOINT_MODES and not (_is_int(ckpt) and ckpt >= 1):
            raise ValueError(
                f"checkpointing must be 'full', 'selective', a block count >= 1 or None, not {ckpt!r}"
            )
        micro = self.micro_batch
        if micro is not None and micro != "auto" and not (_is_int(micro) and micro >= 1):
            raise ValueError(f"micro_batch must be a size >= 1, 'auto' or None, not {micro!r}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS} or None, not {self.optimizer!r}")
        if self.zero is not None and not (_is_int(self.zero) and self.zero in ZERO_STAGES):
            raise ValueError(f"zero must be one of {ZERO_STAGES} or None, not {self.zero!r}")

    def is_empty(self) -> bool:
        return all(v is None for v in (self.precision, self.checkpointing, self.micro_batch,
                                       self.optimizer, self.zero))

    def __str__(self) -> str:
        parts = []
        if self.precision is not None:
            parts.append(self.precision)
        if self.checkpointing is not None:
            parts.append(f"ckpt={self.checkpointing}")
        if self.micro_batch is not None:
            parts.append(f"micro={self.micro_batch}")
        if self.optimizer is not None:
            parts.append(f"opt={self.optimizer}")
        if self.zero is not None:
            parts.append(f"zero={self.zero}")
        return ",".join(parts) or "none"

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """Read the short form, e.g. "bf16,ckpt=full,micro=4096"; "none" is the empty plan."""
        if not isinstance(text, str):
            raise ValueError(f"a plan string is needed, not {type(text).__name__}")
        stripped = text.strip().lower()
        if stripped in ("", "none"):
            return cls()
        fields: dict[str, object] = {}
        for item in stripped.split(","):
            item = item.strip()
            if not item:
                raise ValueError(f"empty item in plan {text!r}; accepted: {_FORMS}")
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                key, value = "precision", key
            elif key == "precision":
                pass
            elif key in ("ckpt", "checkpointing"):
                key = "checkpointing"
                value = _int_or_word(value, CHECKPOINT_MODES, item)
            elif key in ("micro", "micro_batch"):
                key = "micro_batch"
                value = _int_or_word(value, ("auto",), item)
            elif key in ("opt", "optimizer"):
                key = "optimizer"
            elif key == "zero":
                value = _int_or_word(value, (), item)
            else:
                raise ValueError(f"unknown item {item!r} in plan {text!r}; accepted: {_FORMS}")
            if key == "precision":
                value = PRECISION_ALIASES.get(value, value)
            if key == "precision" and value not in PRECISIONS:
                raise ValueError(f"unknown item {item!r} in plan {text!r}; accepted: {_FORMS}")
            if key in fields:
                raise ValueError(f"plan {text!r} sets {key} twice")
            fields[key] = value
        return cls(**fields)


def _int_or_word(value: str, words: tuple[str, ...], item: str) -> object:
    if value in words:
        return value
    if value.isascii() and value.isdigit() and len(value) <= 18:   # "²" is a digit to str.isdigit
        return int(value)
    raise ValueError(f"bad value in {item[:40]!r}; accepted: {_FORMS}")
