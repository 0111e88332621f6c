"""Writes data/char/{train,val}.bin and meta.pkl as nanoGPT's data/shakespeare_char/prepare.py
does (a 65-character vocabulary, uint16 ids), from random characters: run in a copy of nanoGPT,
then train with --dataset=char."""
import os
import pickle

import numpy as np

os.makedirs("data/char", exist_ok=True)
chars = [chr(c) for c in range(32, 97)]          # 65 characters, like tiny shakespeare's
rng = np.random.default_rng(0)
rng.integers(0, len(chars), size=200_000, dtype=np.uint16).tofile("data/char/train.bin")
rng.integers(0, len(chars), size=20_000, dtype=np.uint16).tofile("data/char/val.bin")
with open("data/char/meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                 "stoi": {c: i for i, c in enumerate(chars)}}, f)
