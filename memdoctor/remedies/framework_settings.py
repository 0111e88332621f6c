"""A memdoctor Plan as each framework's own settings: transformers' TrainingArguments fields,
Lightning's Trainer arguments, an accelerate config; and the parts a framework cannot
express, each with what to do instead.

    s = settings_for("bf16,ckpt=full,micro=4", "transformers", batch_size=16)
    TrainingArguments(output_dir="out", **s.values)   # bf16, gradient_checkpointing, 4 x 4
    s.unsupported                                     # {} here; else item -> why, and instead

It writes names and values only: no framework is imported, except that transformers'
own TrainingArguments is read (where it is installed) for the checkpointing field's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from memdoctor.remedies.plan import Plan

FRAMEWORKS = ("transformers", "lightning", "accelerate")

_CKPT_IN_CODE = ("memdoctor.remedies.apply_checkpointing(model, {mode!r}) on the model before training "
                 "(it checkpoints the repeated blocks, for any framework)")


@dataclass
class Settings:
    """A plan in one framework's terms.

    values: transformers: TrainingArguments keyword arguments; lightning: Trainer keyword
    arguments; accelerate: the fields of the config file `accelerate launch --config_file`
    reads. dataloader: keyword arguments for the user's DataLoader where the framework
    leaves the batch to it. env: environment variables for the launch. unsupported: plan
    item -> why the framework cannot express it, and what to do instead.
    """
    framework: str
    plan: str
    values: dict[str, Any] = field(default_factory=dict)
    dataloader: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The settings as a person reads them."""
        out = [f"{self.framework} settings for plan {self.plan}:"]
        out += [f"  {k}={v!r}" for k, v in self.values.items()]
        out += [f"  DataLoader({k}={v!r})" for k, v in self.dataloader.items()]
        out += [f"  {k}={v}  (environment)" for k, v in self.env.items()]
        out += [f"  cannot express {item}: {why}" for item, why in self.unsupported.items()]
        out += [f"  note: {n}" for n in self.notes]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "plan": self.plan, "values": self.values,
                "dataloader": self.dataloader, "env": self.env, "unsupported": self.unsupported,
                "notes": self.notes}


def settings_for(plan: Union[Plan, str], framework: str, batch_size: int | None = None) -> Settings:
    """`plan` in `framework`'s own settings. batch_size: the samples per optimizer step per
    rank now (needed for a plan with micro=N: the accumulation steps are batch_size / N)."""
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; one of {', '.join(FRAMEWORKS)}")
    out = Settings(framework, str(plan))
    {"transformers": _transformers, "lightning": _lightning, "accelerate": _accelerate}[framework](
        plan, out, _accumulation(plan, batch_size))
    return out


def _accumulation(plan: Plan, batch_size: int | None) -> tuple[int, int] | None:
    """(micro-batch, accumulation steps) for micro=N; None without micro-batches."""
    micro = plan.micro_batch
    if micro is None or micro == "auto":
        return None
    if batch_size is None:
        raise ValueError(f"plan {plan} splits the batch into micro-batches of {micro}: give batch_size, "
                         "the samples per step now, to turn it into accumulation steps")
    if batch_size % micro:
        raise ValueError(f"a batch of {batch_size} does not split into micro-batches of {micro}")
    return micro, batch_size // micro


def _transformers(plan: Plan, out: Settings, acc: tuple[int, int] | None) -> None:
    v = out.values
    if plan.precision == "bf16":
        v["bf16"] = True
    elif plan.precision == "fp16":
        v["fp16"] = True
    elif plan.precision == "bf16-true":
        out.unsupported["bf16-true"] = (
            "TrainingArguments has no bf16 weights with fp32 master copies; loading the model with "
            "dtype=torch.bfloat16 keeps bf16 weights without masters (less memory, less exact updates)")
    if plan.checkpointing == "full":
        name = _checkpointing_field()
        v[name] = True
        v[name + "_kwargs"] = {"use_reentrant": False}
    elif plan.checkpointing is not None:
        out.unsupported[f"ckpt={plan.checkpointing}"] = (
            f"{_checkpointing_field()} checkpoints every layer, not a selection; instead: "
            + _CKPT_IN_CODE.format(mode=plan.checkpointing))
    if acc is not None:
        v["per_device_train_batch_size"], v["gradient_accumulation_steps"] = acc
    elif plan.micro_batch == "auto":
        v["auto_find_batch_size"] = True
        out.notes.append("auto_find_batch_size halves the batch on an OOM without accumulating, so the "
                         "effective batch shrinks; memdoctor's micro=auto keeps it")
    opt = plan.optimizer
    if opt == "fused":
        v["optim"] = "adamw_torch_fused"
    elif opt == "adamw-8bit":
        v["optim"] = "adamw_bnb_8bit"
        out.notes.append("adamw_bnb_8bit is bitsandbytes' 8-bit AdamW (pip install bitsandbytes): the same "
                         "state bytes as memdoctor's adamw-8bit, with its own quantization")
    elif opt is not None:
        out.unsupported[f"opt={opt}"] = (
            f"no TrainingArguments optim does this; instead: {_fused_hint(opt)} and pass the new one as "
            "Trainer(optimizers=(optimizer, None))")
    if plan.zero is not None:
        v["deepspeed"] = {"zero_optimization": {"stage": plan.zero},
                          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
        out.notes.append("ZeRO through DeepSpeed (pip install deepspeed); FSDP is the alternative for "
                         "stages 2 and 3: fsdp='shard_grad_op' or 'full_shard'")


def _checkpointing_field() -> str:
    """transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name
    is deprecated, to go in 6): the name the installed version takes."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


_LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true"}


def _lightning(plan: Plan, out: Settings, acc: tuple[int, int] | None) -> None:
    v = out.values
    if plan.precision is not None:
        v["precision"] = _LIGHTNING_PRECISION[plan.precision]
        if plan.precision == "bf16-true":
            out.notes.append("Lightning's bf16-true keeps bf16 weights without memdoctor's fp32 master "
                             "copies: less memory, less exact updates")
    if plan.checkpointing is not None:
        out.unsupported[f"ckpt={plan.checkpointing}"] = (
            "the Trainer has no checkpointing argument (FSDPStrategy's activation_checkpointing_policy "
            "only with FSDP); instead, in LightningModule.configure_model: "
            + _CKPT_IN_CODE.format(mode=plan.checkpointing))
    if acc is not None:
        out.dataloader["batch_size"], v["accumulate_grad_batches"] = acc
    elif plan.micro_batch == "auto":
        out.unsupported["micro=auto"] = (
            "no Trainer argument halves the batch on an OOM; lightning.pytorch.tuner.Tuner(trainer)"
            ".scale_batch_size(model) searches a batch size that fits before training")
    if plan.optimizer is not None:
        out.unsupported[f"opt={plan.optimizer}"] = _OPTIMIZER_IN_CODE.format(
            where="LightningModule.configure_optimizers", fused=_fused_hint(plan.optimizer))
    if plan.zero is not None:
        v["strategy"] = f"deepspeed_stage_{plan.zero}"
        out.notes.append("ZeRO through DeepSpeed (pip install deepspeed); strategy='fsdp' is the "
                         "alternative for stage 3")


_OPTIMIZER_IN_CODE = "the optimizer is the user's code, not a setting; in {where}: {fused}"


def _fused_hint(optimizer: str) -> str:
    if optimizer == "fused":
        return "torch.optim.AdamW(params, fused=True)"
    return f"optimizer, _ = memdoctor.remedies.swap_optimizer(model, optimizer, {optimizer!r})"


def _accelerate(plan: Plan, out: Settings, acc: tuple[int, int] | None) -> None:
    v = out.values
    v["distributed_type"] = "DEEPSPEED" if plan.zero is not None else "NO"
    v["mixed_precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision or "", "no")
    if plan.precision == "bf16-true":
        out.unsupported["bf16-true"] = (
            "accelerate's mixed_precision is autocast only; bf16 weights come from the model's dtype "
            "(model.to(torch.bfloat16)), without fp32 master copies")
    if plan.checkpointing is not None:
        out.unsupported[f"ckpt={plan.checkpointing}"] = (
            "the config has no checkpointing field outside FSDP's fsdp_activation_checkpointing; instead: "
            + ("model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
               "on a transformers model, else " if plan.checkpointing == "full" else "")
            + _CKPT_IN_CODE.format(mode=plan.checkpointing))
    if acc is not None:
        micro, steps = acc
        out.dataloader["batch_size"] = micro
        if plan.zero is not None:
            v.setdefault("deepspeed_config", {})["gradient_accumulation_steps"] = steps
        else:       # the config file has no such field: Accelerator() reads it from the launch
            out.env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(steps)
        out.notes.append("the training loop steps inside `with accelerator.accumulate(model):`")
    elif plan.micro_batch == "auto":
        out.unsupported["micro=auto"] = (
            "not a config field; accelerate.utils.find_executable_batch_size halves the batch on an OOM "
            "around the training function (the effective batch shrinks)")
    if plan.optimizer is not None:
        out.unsupported[f"opt={plan.optimizer}"] = _OPTIMIZER_IN_CODE.format(
            where="the script, before accelerator.prepare", fused=_fused_hint(plan.optimizer))
    if plan.zero is not None:
        v.setdefault("deepspeed_config", {})["zero_stage"] = plan.zero
        out.notes.append("ZeRO through DeepSpeed (pip install deepspeed)")
