"""The options that name a transformers model (--hf TYPE with size flags, or --hf-config FILE),
shared by `memdoctor estimate` and `memdoctor plan`; parsing them imports no torch."""
from __future__ import annotations

import argparse

from memdoctor.cli.common import UsageError

__all__ = ["add_hf_args", "hf_model"]


def add_hf_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a transformers model, random weights, nothing downloaded (as accelerate "
                             "estimate-memory takes hub ids)")
    g.add_argument("--hf", metavar="TYPE", help="a model type: llama, qwen2, mistral, gpt2, t5, bert, vit, ... "
                   "(sized by the flags below, else by the config's defaults)")
    g.add_argument("--hf-config", metavar="FILE", help="a config.json (or the folder holding it)")
    g.add_argument("--layers", type=int, metavar="N", help="hidden layers")
    g.add_argument("--hidden", type=int, metavar="N", help="hidden size")
    g.add_argument("--heads", type=int, metavar="N", help="attention heads")
    g.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads (grouped-query attention)")
    g.add_argument("--vocab", type=int, metavar="N", help="vocabulary size")
    g.add_argument("--intermediate", type=int, metavar="N", help="MLP (feed-forward) size")


def hf_model(ns):
    """The HfModel the options name, or None; UsageError for sizes without a model."""
    from memdoctor.predict.hf_models import SIZE_FLAGS, HfModel
    sizes = {attr: getattr(ns, flag) for flag, attr in SIZE_FLAGS.items() if getattr(ns, flag, None) is not None}
    if ns.hf is None and ns.hf_config is None:
        if sizes:
            flags = ", ".join("--" + f.replace("_", "-") for f, a in SIZE_FLAGS.items() if a in sizes)
            raise UsageError(f"{flags} size a transformers model: give --hf TYPE or --hf-config FILE")
        return None
    if ns.hf is not None and ns.hf_config is not None:
        raise UsageError("give --hf TYPE or --hf-config FILE, not both")
    bad = [f for f, v in sizes.items() if v < 1]
    if bad:
        raise UsageError("model sizes must be at least 1")
    return HfModel(ns.hf, ns.hf_config, sizes)
