"""transformers models the way users name them, for `memdoctor estimate` and `memdoctor plan`:
a model type with size flags (`--hf llama --layers 16 --hidden 2048 --kv-heads 8`), or a
config.json (`--hf-config path/config.json`), built with random weights, nothing downloaded.

The model class follows from the config: a causal LM for decoder-only types, a
sequence-to-sequence LM for encoder-decoders, a masked LM for encoders, an image classifier
for vision configs, CTC for speech encoders; its batch is what a data loader gives it
(token ids with an all-ones attention mask and labels; pixel values and class labels; 10 s of
16 kHz audio, or its log-mel features for a model that takes them, and a transcript), and the
loss is the one the model computes from its labels.
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
        or a size the model does not have.

        The sizes go through the config's constructor, as a config file's values do, so the
        fields it derives from them follow: a head size of hidden / heads, key/value heads
        as many as heads where the model type leaves them unset. Where the model sets its own
        key/value heads and --heads alone is given, they keep the model's heads per key/value
        head (Mistral's 32 and 8 become 4 and 1 with --heads 4)."""
        try:
            import transformers
        except ImportError:
            raise ValueError("--hf and --hf-config need transformers: pip install transformers") from None
        try:
            if self.model_type is not None:
                values: dict[str, Any] = {}
                base = transformers.AutoConfig.for_model(self.model_type)
            else:
                path = self.config_path
                if os.path.isdir(path):
                    path = os.path.join(path, "config.json")
                if not os.path.isfile(path):
                    raise ValueError(f"no such config file: {self.config_path}")
                values, _ = transformers.PretrainedConfig.get_config_dict(path)
                if "model_type" not in values:
                    raise ValueError(f"{self.config_path} names no model_type")
                base = transformers.AutoConfig.for_model(values["model_type"], **_without(values, "model_type"))
        except OSError as exc:
            raise ValueError(f"cannot read the config: {str(exc).splitlines()[0][:200]}") from None
        except Exception as exc:            # unknown types, and configs that validate their values
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"not a transformers configuration: {first[:200]}") from None
        if not self.sizes:
            cfg = base
        else:
            fields = _size_fields(base, {a: int(v) for a, v in self.sizes.items()})
            values.update(fields)
            try:
                cfg = transformers.AutoConfig.for_model(base.model_type, **_without(values, "model_type"))
                for name, value in fields.items():  # a constructor that takes no such argument
                    if getattr(cfg, name, None) != value:
                        setattr(cfg, name, value)
            except Exception as exc:        # configs validate in their own ways (ValueError, NotImplementedError, ...)
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                said = " ".join(lines[-1:] if len(lines) > 1 and lines[0].endswith(":") else lines[:1])
                raise ValueError(f"these sizes do not make a {base.model_type} config: "
                                 f"{said[:200] or type(exc).__name__}") from None
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
        own = getattr(cfg, "image_size", None) or 224
        size = int(image_size or (own[0] if isinstance(own, (list, tuple)) else own))     # (224, 224): Hiera
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        labels = int(getattr(cfg, "num_labels", 2) or 2)

        def build():
            import transformers

            from memdoctor.predict.models import make_optimizer
            model_class = getattr(transformers, auto)._model_mapping[type(cfg)]
            if isinstance(model_class, (list, tuple)):  # DeiT's two heads: its plain one first
                model_class = model_class[0]
            model = model_class._from_config(cfg)
            model.train()
            fed = "features" if kind == "audio" and _takes_features(model) else kind
            return model, make_optimizer(optimizer, model), _batch(fed, batch, seq, size, vocab, labels,
                                                                   _mel_bins(cfg)), _loss

        config = {"model": f"{cfg.model_type} (transformers, random weights)", "hf": self.model_type, "hf_config": os.path.abspath(self.config_path) if self.config_path else None,
                  "model_type": cfg.model_type, "task": auto, "batch": batch,
                  "seq": seq if kind in ("tokens", "seq2seq") else None,
                  "image_size": size if kind == "image" else None, "sizes": dict(self.sizes), "optimizer": optimizer}
        return build, config


# generic size -> the fields models name it by where transformers' attribute_map does not
# (encoder-decoders size both stacks; GPT-2, T5, OPT, Falcon name their MLP their own way)
_ALIASES = {
    "num_hidden_layers": ("encoder_layers", "decoder_layers"),
    "num_attention_heads": ("encoder_attention_heads", "decoder_attention_heads"),
    "intermediate_size": ("n_inner", "d_ff", "ffn_dim", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim"),
}


def _fields(base, attr: str) -> list[str]:
    """The fields of `base`'s config that the generic size `attr` sets."""
    mapped = (getattr(type(base), "attribute_map", {}) or {}).get(attr)
    names = [mapped] if mapped else ([attr] if hasattr(base, attr) else [])
    return names + [a for a in _ALIASES.get(attr, ()) if a not in names and a in vars(base)]


def _size_fields(base, sizes: dict[str, int]) -> dict[str, int]:
    """The config's own field -> value for the generic sizes given; ValueError for a size the
    config has no field for, or one it keeps per layer (it refuses to read it as one)."""
    try:
        sizes = _with_kv_heads(base, sizes)
        fields = {}
        for attr, value in sizes.items():
            names = _fields(base, attr)
            if not names:
                flag = next((f for f, a in SIZE_FLAGS.items() if a == attr), attr)
                raise ValueError(f"a {base.model_type} config has no {attr} (--{flag.replace('_', '-')})")
            fields.update({name: value for name in names})
        return fields
    except ValueError:
        raise
    except Exception as exc:        # transformers' per-layer attributes (AmbiguousGlobalPerLayerAttributeError)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"these sizes do not make a {base.model_type} config: {first[:200]}") from None


def _without(values: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != key}


def _with_kv_heads(base, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` with key/value heads for a new head count, where the model sets its own: the
    model's heads per key/value head kept when that divides, else one per head."""
    heads, kv = sizes.get("num_attention_heads"), getattr(base, "num_key_value_heads", None)
    if heads is None or "num_key_value_heads" in sizes or not kv:
        return sizes
    per_kv = max(1, int(base.num_attention_heads) // int(kv))
    return {**sizes, "num_key_value_heads": heads // per_kv if heads % per_kv == 0 else heads}


def _batch(kind: str, n: int, seq: int, size: int, vocab: int, labels: int, bins: int = 80) -> dict[str, Any]:
    import torch
    if kind in ("tokens", "seq2seq"):
        ids = torch.randint(0, max(vocab, 2), (n, seq))
        return {"input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long), "labels": ids.clone()}
    if kind == "image":
        return {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, labels, (n,))}
    samples = 16000 * 10
    transcript = torch.randint(1, max(vocab, 2), (n, 100))
    if kind == "features":              # log-mel frames of the same 10 s, one each 10 ms
        frames = samples // 160
        return {"input_features": torch.randn(n, frames, bins),
                "attention_mask": torch.ones(n, frames, dtype=torch.long), "labels": transcript}
    return {"input_values": torch.randn(n, samples), "labels": transcript}


def _takes_features(model) -> bool:
    """A CTC model fed log-mel features (Parakeet, LASR), not the waveform (wav2vec2)."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return "input_features" in params and "input_values" not in params


def _mel_bins(cfg) -> int:
    """The mel bins the config (or its encoder's) names, else 80."""
    for c in (cfg, getattr(cfg, "encoder_config", None)):
        for name in ("num_mel_bins", "feature_size", "input_feat_size"):
            value = getattr(c, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 80


def _loss(model, batch):
    return model(**batch).loss
