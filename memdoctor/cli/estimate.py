"""`memdoctor estimate`: predict the peak GPU memory of a configuration without running it."""
from __future__ import annotations

import contextlib
import sys

from memdoctor.cli.common import EXIT_OK, EXIT_OOM, UsageError, check_script, script_argv, size
from memdoctor.cli.hf_args import add_hf_args, hf_model
from memdoctor.cli.progress import working


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict the peak GPU memory of a configuration without running it",
                       epilog="SCRIPT must define build() returning (model, optimizer, batch, loss_fn) or a dict "
                              "with those keys; arguments after -- are passed to it as sys.argv")
    p.add_argument("script", nargs="?", help="a script with build(), instead of --model")
    # the names live in predict.models, which imports torch: `memdoctor estimate` alone lists them
    p.add_argument("--model", metavar="NAME", help="a known model by name; `memdoctor estimate` alone lists them")
    p.add_argument("--batch", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--image-size", type=int, help="image size for resnet50")
    p.add_argument("--precision", choices=("bf16", "fp16", "bf16-true"), help="autocast, or bf16 weights")
    p.add_argument("--checkpointing", metavar="MODE", help="full, selective or a number of blocks")
    p.add_argument("--micro-batch", metavar="N", help="samples per micro-batch (gradient accumulation)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, adafactor; or an optimizer "
                   "remedy on AdamW: fused, adamw-8bit, adamw-bf16, in-backward, in-backward-8bit")
    p.add_argument("--plan", metavar="PLAN", help="a plan string, e.g. bf16,ckpt=full,micro=2")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (DDP, or ZeRO with --zero)")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage over --world-size ranks")
    p.add_argument("--budget", type=size, metavar="SIZE", help="the allocator's limit, e.g. 16GiB "
                   "(the CUDA context and the libraries' memory come on top: about 0.75 GiB on an H200)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device to predict for")
    p.add_argument("--anchors", action="store_true",
                   help="also show torch MemTracker's, DeepSpeed's and accelerate's figures (slower)")
    p.add_argument("--no-gpu-probe", action="store_true",
                   help="use no GPU memory: do not measure cuDNN's convolution workspaces on this machine's GPU")
    p.add_argument("-o", "--output", metavar="RUN", help="also save the predicted run here")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_hf_args(p)
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    hf = hf_model(ns)
    if sum(bool(x) for x in (ns.script, ns.model, hf)) > 1:
        raise UsageError("give one of a SCRIPT, --model or --hf/--hf-config")
    if not ns.script and not ns.model and hf is None:
        from memdoctor.predict.models import MODELS
        raise UsageError(f"give --model NAME, --hf TYPE, --hf-config FILE or a SCRIPT with build(); known models: "
                         f"{', '.join(MODELS)}")
    if ns.script:
        check_script(ns.script)
    from memdoctor.predict.config import estimate_config
    from memdoctor.report.estimate_text import estimate_lines
    from memdoctor.report.json import dumps, estimate_json
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with working(ns, f"estimating {ns.model or ns.script or hf.name}"), contextlib.redirect_stdout(stream):
            est = estimate_config(
                ns.model, ns.script, script_argv(ns), hf=hf, batch=ns.batch, seq=ns.seq, image_size=ns.image_size,
                precision=ns.precision, checkpointing=ns.checkpointing, micro_batch=ns.micro_batch,
                optimizer=ns.optimizer, plan=ns.plan, world_size=ns.world_size, zero=ns.zero,
                budget=ns.budget, device=ns.device, anchors=ns.anchors,
                probe_gpu=False if ns.no_gpu_probe else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ns.output:
        est.run.save(ns.output)
    if ns.json:
        print(dumps(estimate_json(est)))
    else:
        print("\n".join(estimate_lines(est)))
        if ns.output:
            print(f"predicted run saved to {ns.output}")
    return EXIT_OOM if est.fits is False else EXIT_OK
