"""build() of one zoo architecture, for `memdoctor estimate` and `memdoctor plan`:

    memdoctor estimate benchmarks/zoo/zoo_script.py --plan bf16 -- llama 4
    memdoctor estimate benchmarks/zoo/zoo_script.py -- t5 8 --own-checkpointing

It reads ARCH BATCH [--own-checkpointing] from sys.argv when build() is called."""
from __future__ import annotations

import argparse
import sys

from zoo_models import ZOO
from zoo_models import build as build_arch


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="zoo_script.py")
    ap.add_argument("arch", choices=list(ZOO))
    ap.add_argument("batch", type=int)
    ap.add_argument("--own-checkpointing", action="store_true")
    return ap.parse_args(argv)


def build():
    args = _args(sys.argv[1:])
    return build_arch(args.arch, args.batch, own_checkpointing=args.own_checkpointing)


if __name__ == "__main__":
    args = _args(sys.argv[1:])
    model, optimizer, batch, loss_fn = build()
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    print(f"{args.arch}: loss {loss.item():.3f}, {sum(p.numel() for p in model.parameters()):,} parameters")
