"""model-states: weights + gradients + optimizer states alone crowd the budget.

What it detects
    The memory that lives for the whole run (parameters, their gradients and the
    optimizer's state) takes most of the memory available, before a single activation.
Preconditions
    - the run is under pressure (an OOM, or a peak within 20% of the limit);
    - weights + gradients + optimizer state, as they are once every parameter has its
      gradient and its state, take at least half the limit (less cuBLAS's workspaces, which
      no tensor can use, those of autograd's thread too where no backward has run yet);
    - or the OOM came while a model was built on the device or moved (converted) there: an
      `nn.Module.__init__` or `Module._apply` (`.to()`, `.cuda()`, `.double()`) on the
      stack. Its full size is then unknown: the finding gives what was made and asked for.
Why it runs out of memory
    Adam keeps two fp32 tensors per parameter: with fp32 weights and gradients that is 16
    bytes a parameter. A 1.5B-parameter model needs about 23 GiB before its first batch.
Example
    bad:  torch.optim.AdamW(model.parameters())            # 16 bytes a parameter
    good: Plan(optimizer="adamw-8bit")                      # ~10 bytes a parameter
          Plan(optimizer="in-backward")                     # gradients freed as applied
          torchrun --nproc-per-node 2 ... Plan(zero=2)      # states sharded over ranks
Fix
    Store optimizer state in 8 or 16 bits, apply the optimizer step inside backward,
    shard gradients and states over data-parallel ranks (ZeRO-2), or parameters too (ZeRO-3).
    DistributedDataParallel keeps a copy of the gradients in its buckets: counted here, and
    gradient_as_bucket_view=True drops it. LBFGS's state is history_size pairs of
    parameter-sized vectors: a shorter history that fits, or a first-order optimizer.
Known limits
    The optimizer's state is predicted from its class (Adam: two moments a parameter);
    an optimizer memdoctor does not know is counted by the state it has made so far.
"""
from __future__ import annotations

from memdoctor.cuda.blas_workspaces import WORKSPACE_NAME
from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import STRUCTURAL, Finding, Remedy, fits
from memdoctor.diagnosis.facts import Facts

ID = "model-states"
SHARE = 0.5
FROZEN = 0.25           # frozen weights this share of all: a fine-tune of a frozen base
NEGLIGIBLE = 0.01       # a remedy saving under this share of the model states is left out
ADAM_LIKE = ("Adam", "AdamW", "FusedAdamW")      # what Plan's 8-bit, bf16 and in-backward optimizers replace


def frozen_weights(f: Facts) -> int:
    """Weights no optimizer steps, less the copies never called (an EMA model, updated by
    hand): a frozen base or backbone, which needs no fp32 copy."""
    if not f.optimizer:
        return 0
    idle = sum(b.nbytes for b in f.focus_blocks if b.category == "weights" and b.name.endswith("(not called)"))
    return max(f.cat("weights") - f.param_bytes - idle, 0)


def frozen_in_bf16(predicted: int) -> Remedy:
    return Remedy("frozen weights in bf16", "cast the frozen modules to bf16 (or load the base model with "
                  "dtype=torch.bfloat16), keeping the trained parameters in fp32 and the forward under bf16 "
                  "autocast", predicted, None)


def in_backward_applies(f: Facts) -> bool:
    """Whether Plan(optimizer='in-backward') fits the run: one Adam-family optimizer (the
    only kind it replaces) stepping once per back-propagated pass (stepped in backward,
    accumulated gradients would be applied a micro-batch at a time)."""
    optimizers = (f.run.meta.get("optimizers") or []) if f.run else []
    if len(optimizers) != 1 or optimizers[0].get("class") not in ADAM_LIKE:
        return False
    calls = f.run.meta.get("forward_calls") or []
    passes = sum(1 for c in calls if isinstance(c, dict) and c.get("backward"))
    stepped = max((m.step for m in f.run.marks), default=0) if f.run.meta.get("steps_from") == "optimizer" else 0
    return passes <= stepped + 1       # one pass a step (the step running may have had its own)


def _asks_for_a_gradient(f: Facts) -> bool:
    """An OOM in backward asking for a parameter's size while gradients are still to come: the
    request is that gradient, which `grads` (the parameters' size) counts already."""
    request = f.requested_bytes or 0
    return (f.oom_phase == "backward" and request > 0 and f.cat("gradients") + request <= f.param_bytes
            and any(b.category == "weights" and b.nbytes == request for b in f.focus_blocks))


def _mostly_fp32(f: Facts) -> bool:
    weights = [b for b in f.focus_blocks if b.category == "weights"]
    return 2 * sum(b.nbytes for b in weights if b.dtype == "float32") >= sum(b.nbytes for b in weights)


def check(f: Facts) -> Finding | None:
    if f.source == "run" and f.oom and f.oom_building:
        return _while_building(f)
    if not f.under_pressure or f.source != "run" or not f.limit_bytes:
        return None
    buckets = f.ddp_bucket_bytes         # DDP's copy of the gradients, alive the whole run
    states = f.model_state_bytes + buckets
    # what the run's tensors can have: cuBLAS's workspaces (64 MiB on a Hopper GPU) take
    # their share of the limit whatever the model, the backward thread's too before it runs
    workspaces = sum(b.nbytes for b in f.focus_blocks if b.name == WORKSPACE_NAME) + f.pending_workspace_bytes
    if states < SHARE * (f.limit_bytes - workspaces):
        return None
    weights, params = f.cat("weights"), f.param_bytes
    grads = max(f.cat("gradients"), params)
    state = max(f.cat("optimizer_state"), f.state_bytes_full)
    other = max(f.focus_bytes - f.cat("weights") - f.cat("gradients") - f.cat("optimizer_state")
                - (f.requested_bytes or 0 if f.oom_phase == "optimizer" or _asks_for_a_gradient(f) else 0), 0)
    opt = (f.optimizer or {}).get("class", "the optimizer")
    evidence = [
        f"weights {format_bytes(weights)} + gradients {format_bytes(grads)} + {opt} state "
        f"{format_bytes(state)} = {format_bytes(states)}, {100 * states / f.limit_bytes:.0f}% of the "
        f"{format_bytes(f.limit_bytes)} limit" + (f" ({format_bytes(workspaces)} of it cuBLAS's workspaces)"
                                                   if workspaces else ""),
    ]
    if buckets:
        evidence[0] = evidence[0].replace(" = ", f" + DistributedDataParallel's gradient buckets {format_bytes(buckets)} = ")
    if f.oom:
        evidence.append(f"ran out in {f.oom_phase} of step {f.oom_step} asking for {format_bytes(f.requested_bytes)}")
    idle = sum(b.nbytes for b in f.focus_blocks if b.category == "weights" and b.name.endswith("(not called)"))
    base = other + weights
    remedies = []
    if buckets:
        # the gradients become views into the buckets: one copy instead of two
        remedies.append(Remedy("gradients as views into DDP's buckets",
                               "DistributedDataParallel(model, ..., gradient_as_bucket_view=True)",
                               max(f.focus_bytes - buckets, 0), None))
    if opt == "LBFGS":
        # its state is history_size pairs of flat vectors (and a few more): fewer pairs, or a
        # first-order optimizer; the remedies for Adam's moments do not apply
        history, per = (f.optimizer or {}).get("history_size") or 100, params or 1
        # an OOM inside its step: the history built so far is still the step's scratch, not state
        scratch = f.optimizer_temporaries - (f.requested_bytes or 0 if f.oom_phase == "optimizer" else 0)
        base = weights + max(other - scratch, 0)
        # its step holds the history, three more vectors kept and three of scratch (directions, differences)
        pairs = max(min((max(f.limit_bytes - base - grads, 0) // per - 6) // 2, history - 1), 1)
        remedies.append(Remedy("a shorter LBFGS history", f"LBFGS(..., history_size={pairs}) instead of {history}: "
                               f"{pairs} pairs of vectors kept", base + grads + per * (2 * pairs + 6), None))
        remedies.append(Remedy("a first-order optimizer", "AdamW (two moments a parameter) instead of LBFGS's "
                               "history", base + grads + 2 * per, None))
        return Finding(ID, f"model states take {format_bytes(states)} of the {format_bytes(f.limit_bytes)} limit",
                       states, evidence, remedies, STRUCTURAL, fits(f, min(r.predicted_peak_bytes for r in remedies)),
                       {"weights": weights, "gradients": grads, "optimizer_state": state})
    adam = opt in ADAM_LIKE
    if state and adam:
        low = params // 2 if params else state // 4      # two 8-bit moments: 2 bytes a fp32 parameter
        remedies.append(Remedy("8-bit optimizer state", "Plan(optimizer='adamw-8bit'): blockwise 8-bit moments",
                               base + grads + low, "opt=adamw-8bit"))
        remedies.append(Remedy("bf16 optimizer state", "Plan(optimizer='adamw-bf16'): moments in bf16 with stochastic rounding",
                               base + grads + state // 2, "opt=adamw-bf16"))
    largest = (f.optimizer or {}).get("largest_param_bytes", 0)
    if adam and in_backward_applies(f):
        remedies.append(Remedy("optimizer step in backward", "Plan(optimizer='in-backward'): each gradient applied and freed as soon as it is ready",
                               base + state + largest, "opt=in-backward"))
    remedies.append(Remedy("ZeRO-2 over 2 ranks", "torchrun --nproc-per-node 2 with Plan(zero=2): gradients and states sharded",
                           base + (grads + state) // 2, "zero=2"))
    remedies.append(Remedy("ZeRO-3 over 2 ranks", "Plan(zero=3): parameters sharded as well, gathered per layer",
                           other + (weights + grads + state) // 2, "zero=3"))
    frozen = frozen_weights(f)
    if frozen and frozen >= FROZEN * weights and _mostly_fp32(f):
        # a fine-tune's frozen base (LoRA, a frozen backbone) is most of it: it needs no fp32 copy
        evidence.append(f"{format_bytes(frozen)} of the weights get no gradient (frozen)")
        remedies.append(frozen_in_bf16(base - frozen // 2 + grads + state))
    # a fix that saves next to nothing is no fix (8-bit moments of a head's few parameters)
    remedies = [r for r in remedies if r.predicted_peak_bytes < base + grads + state - NEGLIGIBLE * states]
    if idle >= 0.1 * weights:
        # copies of the model that never run here (EMA, a teacher): they can wait on the host
        evidence.append(f"{format_bytes(idle)} of the weights are in modules never called while tracing "
                        f"(EMA copies, a model kept for later)")
        remedies.append(Remedy("keep the idle copies on the host", "move the modules that only get updated "
                               "(EMA) or run later to the CPU, and back when they are used",
                               base - idle + grads + state, None))
    if not remedies:
        return None
    best = min(r.predicted_peak_bytes for r in remedies)
    return Finding(ID, f"model states take {format_bytes(states)} of the {format_bytes(f.limit_bytes)} limit",
                   states, evidence, remedies, STRUCTURAL, fits(f, best),
                   {"weights": weights, "gradients": grads, "optimizer_state": state})


def _while_building(f: Facts) -> Finding:
    """An OOM while the model is built on the device or moved there (`model.to("cuda")`): its
    weights alone do not fit beside what is there already. How big the whole model is, the
    run never got to know: the bytes are what was made of it and what it asked for next."""
    run, cls, how = f.run, f.oom_building.get("module", "the model"), f.oom_building.get("how", "built")
    line = f.run.ooms[0].source if run and run.ooms else -1
    where = run.sources[line] if run and 0 <= line < len(run.sources) else None
    built = sum(b.nbytes for b in f.focus_blocks if b.category in ("weights", "temporaries", "other") and (
        b.source == line or (run and 0 <= b.source < len(run.sources) and run.sources[b.source][2] == "__init__")))
    asked, live = f.requested_bytes or 0, f.focus_bytes
    before = max(live - built - asked, 0)       # the focus holds the request
    doing = "building" if how == "built" else "moving (or converting)"
    evidence = [f"ran out {doing} a {cls}" + (f" (at line {where[1]})" if where else "")
                + f", asking for {format_bytes(asked)} with {format_bytes(built)} of the model made: its weights "
                f"need more than {format_bytes(built + asked)}, before any gradient, optimizer state or activation"]
    if before:
        evidence.append(f"{format_bytes(before)} was on the device before (data, another model)")
    remedies = [
        Remedy("shard the parameters (ZeRO-3 / FSDP)", "build it on the meta device and shard it over the GPUs: "
               "Plan(zero=3) under torchrun, or FSDP's fully_shard", None, "zero=3"),
        Remedy("weights in bf16", "build or load it in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`, or "
               "`.to(torch.bfloat16)` on the CPU first) where only part of it is trained (a frozen base, LoRA)", None),
    ]
    if how == "built" and before >= FROZEN * live:     # (a conversion's old copy is no data)
        remedies.insert(0, Remedy("keep the data on the host", "what was on the device before the model (a "
                                  "preloaded dataset) can stay in pinned CPU memory, each batch moved as it is used",
                                  None))
    return Finding(ID, f"the model does not fit: it ran out {doing} a {cls}, its weights over "
                   f"{format_bytes(built + asked)}"
                   + (f" beside {format_bytes(before)} made before it" if before else ""),
                   built + asked, evidence, remedies, STRUCTURAL, None,
                   {"building": cls, "how": how, "built": built, "requested": asked})

