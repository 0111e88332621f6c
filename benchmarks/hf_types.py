"""Whether `memdoctor estimate --hf TYPE` gives an answer for transformers' model types as a
user names them: each type in a fresh process, small sizes given by flags (or the config's
own sizes with --config-sizes), the answer or the one-line error, and the time.

    python benchmarks/hf_types.py                        # the types below, 2 layers, hidden 256
    python benchmarks/hf_types.py llama mamba --config-sizes --layers 2
    python benchmarks/hf_types.py --all --workers 2       # every type the five auto classes know

A type that has no such size (a convolutional network has no hidden size, Mamba no heads)
runs at its config's own sizes, and its row says so. A type whose own transformers model
cannot be built or trained from such a config (a special token id past a small vocabulary, a
config that rejects a layer count) is an error of the configuration, not of the estimate;
the row says which by its message. Writes
hf_types_<hardware>_<date>.json (benchmarks/results, or --out) with the command, commit and
versions.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import resultfile  # noqa: E402

TYPES = ("llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 starcoder2 gptj codegen persimmon olmo olmo2 "
         "olmoe cohere granite granitemoe stablelm deepseek_v3 qwen3_moe mixtral phimoe jamba recurrent_gemma "
         "xglm biogpt gpt2 gpt_neox falcon bloom opt mpnet xlm-roberta camembert ernie roformer longformer big_bird "
         "convbert nystromformer bert t5 bart mbart pegasus led whisper vit deit dinov2 convnextv2 regnet resnet "
         "mobilevit levit poolformer cvt data2vec-audio sew unispeech wavlm mamba mamba2 rwkv gpt_neo").split()


def run_one(model_type: str, flags: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "memdoctor", "estimate", "--hf", model_type, *flags, "--json"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "ok": False, "error": f"no answer in {timeout:.0f} s", "seconds": timeout}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 0:
        data = json.loads(proc.stdout)
        return {"type": model_type, "ok": True, "seconds": seconds, "params": data.get("params"),
                "peak_allocated_bytes": data["peak_allocated_bytes"], "peak_reserved_bytes": data["peak_reserved_bytes"]}
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memdoctor:")] or \
        proc.stderr.strip().splitlines() or ["?"]
    return {"type": model_type, "ok": False, "exit": proc.returncode, "seconds": seconds, "error": lines[-1][:300]}


def all_types() -> list[str]:
    """Every model type a causal-LM, seq2seq-LM, masked-LM, image-classification or CTC auto
    class maps: the ones `--hf` can build (memdoctor.predict.hf_models)."""
    from transformers.models.auto import modeling_auto as auto
    names = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
             "MODEL_FOR_CTC_MAPPING_NAMES")
    return sorted({t for n in names for t in getattr(auto, n, {})})


def run_sized(model_type: str, sizes: dict[str, str], tail: list[str], timeout: float) -> dict:
    """run_one, dropping each size flag the type has no such size for (its config's own)."""
    given = dict(sizes)
    while True:
        row = run_one(model_type, [x for kv in given.items() for x in kv] + tail, timeout)
        missing = re.search(r" config has no \w+ \((--[\w-]+)\)", row.get("error", ""))
        if row["ok"] or not missing or missing.group(1) not in given:
            break
        del given[missing.group(1)]
    row["sizes"] = given
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=list(TYPES))
    ap.add_argument("--config-sizes", action="store_true", help="the config's own sizes, bar the flags given")
    ap.add_argument("--layers", default="2")
    ap.add_argument("--batch", default="2")
    ap.add_argument("--seq", default="256")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--all", action="store_true", help="every type the five auto classes know (all_types)")
    ap.add_argument("--workers", type=int, default=1, help="types at a time, each in its own process")
    ap.add_argument("--out", help="folder for the results file (default benchmarks/results)")
    args = ap.parse_args(argv)
    sizes = {"--layers": args.layers} if args.config_sizes else {"--layers": args.layers, "--hidden": "256",
                                                                  "--heads": "4"}
    tail = ["--batch", args.batch, "--seq", args.seq]
    flags = [x for kv in sizes.items() for x in kv] + tail
    types = all_types() if args.all else args.types
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.workers)) as pool:
        for row in pool.map(lambda t: run_sized(t, sizes, tail, args.timeout), types):
            rows.append(row)
            print(f"{row['type']:18s} {'ok' if row['ok'] else 'ERROR':5s} {row['seconds']:6.1f}s  "
                  f"{row.get('error', '')}", flush=True)
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} types estimated")
    import torch  # noqa: F401  (imported for the versions the results file records)
    import transformers  # noqa: F401
    data = {"flags": flags, "rows": rows,
            "summary": {"types": len(rows), "estimated": ok, "errors": [r["type"] for r in rows if not r["ok"]]}}
    print(f"written: {resultfile.save('hf_types', resultfile.hardware('cpu', 1), data, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
