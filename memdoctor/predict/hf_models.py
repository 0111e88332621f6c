"""transformers models the way users name them, for `memdoctor estimate` and `memdoctor plan`:
a model type with size flags (`--hf llama --layers 16 --hidden 2048 --kv-heads 8`), or a
config.json (`--hf-config path/config.json`), built with random weights, nothing downloaded.

The model class follows from the config: a causal LM for decoder-only types, a
sequence-to-sequence LM for encoder-decoders, a masked LM for encoders, an image classifier
for vision configs, CTC for speech encoders; its batch is what a data loader gives it
(token ids with an all-ones attention mask and labels; pixel values and class labels; 10 s of
16 kHz audio and a transcript), and the loss is the one the model computes from its labels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["HfModel", "SIZE_FLAGS"]

# --flag -> the config attribute it sets (transformers' attribute_map turns these into each
# model's own names: n_layer, n_embd, d_model, ...)
SIZE_FLAGS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "intermediate": "intermediate_size",
}

# (auto class, kind) tried in order: the first whose mapping knows the config's class
_TASKS = (
    ("AutoModelForCausalLM", "tokens"),
    ("AutoModelForSeq2SeqLM", "seq2seq"),
    ("AutoModelForMaskedLM", "tokens"),
    ("AutoModelForImageClassification", "image"),
    ("AutoModelForCTC", "audio"),
)


@dataclass
class HfModel:
    """A transformers configuration named by model type or config file, with size overrides."""
    model_type: str | None = None
    config_path: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)     # config attribute -> value

    def __post_init__(self) -> None:
        if (self.model_type is None) == (self.config_path is None):
            raise ValueError("name a transformers model type (--hf TYPE) or a config file (--hf-config FILE)")

    @property
    def name(self) -> str:
        return self.model_type or os.path.basename(os.path.abspath(self.config_path or ""))

    def config(self):
        """The transformers config, sizes applied; ValueError for an unknown type, a bad file
        or a size the model does not have."""
        try:
            import transformers
        except ImportError:
            raise ValueError("--hf and --hf-config need transformers: pip install transformers") from None
        try:
            if self.model_type is not None:
                cfg = transformers.AutoConfig.for_model(self.model_type)
            else:
                path = self.config_path
                if os.path.isdir(path):
                    path = os.path.join(path, "config.json")
                if not os.path.isfile(path):
                    raise ValueError(f"no such config file: {self.config_path}")
                cfg = transformers.AutoConfig.from_pretrained(path)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"not a transformers configuration: {first[:200]}") from None
        except OSError as exc:
            raise ValueError(f"cannot read the config: {str(exc).splitlines()[0][:200]}") from None
        for attr, value in self.sizes.items():
            if not hasattr(cfg, attr):
                flag = next((f for f, a in SIZE_FLAGS.items() if a == attr), attr)
                raise ValueError(f"a {cfg.model_type} config has no {attr} (--{flag.replace('_', '-')})")
            setattr(cfg, attr, int(value))
        if getattr(cfg, "use_cache", None):
            cfg.use_cache = False               # training: no key/value cache
        return cfg

    def task(self, cfg) -> tuple[str, str]:
        """(auto class, batch kind) for the config."""
        import transformers
        for auto, kind in _TASKS:
            mapping = getattr(transformers, auto)._model_mapping
            if type(cfg) in mapping:
                return auto, kind
        raise ValueError(f"memdoctor cannot train a {cfg.model_type} config: it is not a causal, "
                         "sequence-to-sequence or masked LM, an image classifier or a CTC model")

    def default_seq(self, cfg) -> int:
        limit = getattr(cfg, "max_position_embeddings", None) or 1024
        return int(min(1024, limit))

    def builder(self, batch: int, seq: int | None = None, image_size: int | None = None,
                optimizer: str = "adamw") -> tuple[Callable, dict]:
        """(build() returning (model, optimizer, batch, loss_fn), the configuration for the report)."""
        cfg = self.config()
        auto, kind = self.task(cfg)
        if kind == "seq2seq":               # labels are shifted right from these (a hub config sets them)
            if getattr(cfg, "pad_token_id", None) is None:
                cfg.pad_token_id = 0
            if getattr(cfg, "decoder_start_token_id", None) is None:
                cfg.decoder_start_token_id = cfg.pad_token_id
        seq = int(seq or self.default_seq(cfg))
        size = int(image_size or getattr(cfg, "image_size", 224) or 224)
        if isinstance(getattr(cfg, "image_size", None), (list, tuple)):
            size = int(image_size or cfg.image_size[0])
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        labels = int(getattr(cfg, "num_labels", 2) or 2)

        def build():
            import transformers

            from memdoctor.predict.models import make_optimizer
            model = getattr(transformers, auto).from_config(cfg)
            model.train()
            return model, make_optimizer(optimizer, model), _batch(kind, batch, seq, size, vocab, labels), _loss

        config = {"model": f"{cfg.model_type} (transformers, random weights)", "hf": self.model_type, "hf_config": os.path.abspath(self.config_path) if self.config_path else None,
                  "model_type": cfg.model_type, "task": auto, "batch": batch,
                  "seq": seq if kind in ("tokens", "seq2seq") else None,
                  "image_size": size if kind == "image" else None, "sizes": dict(self.sizes), "optimizer": optimizer}
        return build, config


def _batch(kind: str, n: int, seq: int, size: int, vocab: int, labels: int) -> dict[str, Any]:
    import torch
    if kind in ("tokens", "seq2seq"):
        ids = torch.randint(0, max(vocab, 2), (n, seq))
        return {"input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long), "labels": ids.clone()}
    if kind == "image":
        return {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, labels, (n,))}
    samples = 16000 * 10
    return {"input_values": torch.randn(n, samples), "labels": torch.randint(1, max(vocab, 2), (n, 100))}


def _loss(model, batch):
    return model(**batch).loss
