"""A Plan in each framework's own settings, and the parts a framework cannot express; the
frameworks' names for precisions read as a Plan."""
import pytest

from memdoctor.integrations import settings_for
from memdoctor.remedies.plan import Plan


@pytest.mark.parametrize("text, precision", [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("bf16-true", "bf16-true"),
                                             ("precision=bf16-mixed", "bf16")])
def test_plan_reads_the_frameworks_precision_names(text, precision):
    assert Plan.parse(text).precision == precision
    assert Plan.parse(f"{text},ckpt=full") == Plan(precision=precision, checkpointing="full")


def test_plan_takes_lightnings_names_in_the_constructor_too():
    assert Plan(precision="16-mixed") == Plan(precision="fp16")
    with pytest.raises(ValueError):
        Plan.parse("32-true")


def test_transformers_fields():
    s = settings_for("bf16,ckpt=full,micro=4,opt=fused", "transformers", batch_size=32)
    ckpt = "activation_checkpointing" if "activation_checkpointing" in s.values else "gradient_checkpointing"
    assert s.values == {"bf16": True, ckpt: True, ckpt + "_kwargs": {"use_reentrant": False},
                        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
                        "optim": "adamw_torch_fused"}
    assert not s.unsupported
    s = settings_for("fp16,ckpt=selective,opt=adamw-8bit,zero=2", "transformers")
    assert s.values["fp16"] and s.values["optim"] == "adamw_bnb_8bit"
    assert s.values["deepspeed"]["zero_optimization"] == {"stage": 2}
    assert set(s.unsupported) == {"ckpt=selective"}
    assert "apply_checkpointing(model, 'selective')" in s.unsupported["ckpt=selective"]


def test_transformers_fields_are_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    s = settings_for("ckpt=full,micro=2,opt=fused", "transformers", batch_size=8)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **s.values)
    assert args.gradient_accumulation_steps == 4 and args.per_device_train_batch_size == 2


def test_lightning_arguments():
    s = settings_for("bf16-mixed,micro=2,zero=3", "lightning", batch_size=8)
    assert s.values == {"precision": "bf16-mixed", "accumulate_grad_batches": 4, "strategy": "deepspeed_stage_3"}
    assert s.dataloader == {"batch_size": 2}
    s = settings_for("16-mixed,ckpt=2,opt=in-backward,micro=auto", "lightning")
    assert s.values == {"precision": "16-mixed"}
    assert set(s.unsupported) == {"ckpt=2", "opt=in-backward", "micro=auto"}


def test_lightning_arguments_build_a_trainer():
    L = pytest.importorskip("lightning.pytorch")
    s = settings_for("bf16,micro=2", "lightning", batch_size=8)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **s.values)
    assert trainer.accumulate_grad_batches == 4 and trainer.precision == "bf16-mixed"


def test_accelerate_config(tmp_path):
    s = settings_for("bf16,micro=4", "accelerate", batch_size=16)
    assert s.values == {"distributed_type": "NO", "mixed_precision": "bf16"}
    assert s.env == {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"} and s.dataloader == {"batch_size": 4}
    s = settings_for("fp16,zero=2,micro=4", "accelerate", batch_size=16)
    assert s.values == {"distributed_type": "DEEPSPEED", "mixed_precision": "fp16",
                        "deepspeed_config": {"gradient_accumulation_steps": 4, "zero_stage": 2}}
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(settings_for("bf16", "accelerate").values))
    assert config_args.ClusterConfig.from_yaml_file(str(path)).mixed_precision == "bf16"


def test_micro_batches_need_the_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        settings_for("micro=4", "lightning")
    with pytest.raises(ValueError, match="does not split"):
        settings_for("micro=3", "transformers", batch_size=8)
    with pytest.raises(ValueError, match="unknown framework"):
        settings_for("bf16", "keras")


def test_lines_name_what_cannot_be_expressed():
    text = "\n".join(settings_for("bf16-true,ckpt=full", "accelerate").lines())
    assert "cannot express bf16-true" in text and "cannot express ckpt=full" in text


def test_checkpointing_a_framework_cannot_express_says_what_to_call_instead():
    """accelerate has no checkpointing setting: a transformers model's own switch comes first;
    the Trainer's selective line names the field the installed TrainingArguments has."""
    full = settings_for("ckpt=full", "accelerate").unsupported["ckpt=full"]
    assert "model.gradient_checkpointing_enable(" in full and "apply_checkpointing(model, 'full')" in full
    selective = settings_for("ckpt=selective", "transformers").unsupported["ckpt=selective"]
    field = settings_for("ckpt=full", "transformers").values
    assert selective.startswith(next(k for k in field if k.endswith("checkpointing")) + " checkpoints every layer")
