"""`memdoctor estimate` and `memdoctor plan` take a transformers model the way users name one
(--hf TYPE with size flags, --hf-config FILE; random weights, nothing downloaded), and a
SCRIPT's build() sees the script's own arguments in sys.argv for the whole estimate."""
import importlib.util
import json
import textwrap

import pytest

from memdoctor.cli import main

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers")

SMALL_LLAMA = ["--hf", "llama", "--layers", "1", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
               "--vocab", "1000", "--intermediate", "512", "--batch", "2", "--seq", "128"]


@needs_transformers
def test_estimate_a_model_type_with_size_flags(capsys):
    code = main(["estimate", *SMALL_LLAMA, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    cfg = data["config"]
    assert cfg["hf"] == "llama" and cfg["task"] == "AutoModelForCausalLM" and cfg["seq"] == 128
    assert cfg["sizes"] == {"num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "vocab_size": 1000, "intermediate_size": 512}
    assert data["peak_reserved_bytes"] >= data["peak_allocated_bytes"] > 0


@needs_transformers
def test_estimate_a_config_file_and_its_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 128,
                                                      "n_head": 4, "vocab_size": 1000}))
    for target in (tmp_path / "config.json", tmp_path):
        code = main(["estimate", "--hf-config", str(target), "--batch", "2", "--seq", "64"])
        out = capsys.readouterr().out
        assert code == 0 and "estimate for gpt2 (transformers" in out and "seq 64" in out


@needs_transformers
def test_an_encoder_decoder_and_an_image_model_get_their_own_batches(capsys):
    for args, kind in ((["--hf", "t5", "--layers", "1", "--hidden", "128", "--heads", "2", "--vocab", "500"],
                        "AutoModelForSeq2SeqLM"),
                       (["--hf", "vit", "--layers", "1", "--hidden", "96", "--heads", "2", "--intermediate", "192"],
                        "AutoModelForImageClassification"),
                       # a type with two classifier heads, and a config that names no architecture
                       (["--hf", "deit", "--layers", "1", "--hidden", "96", "--heads", "2", "--intermediate", "192"],
                        "AutoModelForImageClassification")):
        code = main(["estimate", *args, "--batch", "2", "--seq", "64", "--json"])
        assert code == 0 and json.loads(capsys.readouterr().out)["config"]["task"] == kind


@needs_transformers
def test_an_image_size_given_as_height_and_width_takes_the_height():
    from memdoctor.predict.hf_models import HfModel
    _, config = HfModel(model_type="hiera").builder(2)          # Hiera's config: image_size (224, 224)
    assert config["image_size"] == 224
    _, config = HfModel(model_type="hiera").builder(2, image_size=160)
    assert config["image_size"] == 160


@needs_transformers
def test_a_ctc_model_fed_log_mel_features_gets_them_and_trains(tmp_path):
    """Parakeet takes log-mel features where wav2vec2 takes the waveform: 10 s of audio as
    1,000 frames of its encoder's mel bins, with their attention mask; a real step trains."""
    import torch

    from memdoctor.predict.fake_step import train_step
    from memdoctor.predict.hf_models import HfModel
    encoder = {"model_type": "parakeet_encoder", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 2, "intermediate_size": 128, "num_mel_bins": 40, "subsampling_conv_channels": 16}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "parakeet_ctc", "vocab_size": 33, "pad_token_id": 32,
                                  "encoder_config": encoder}))
    build, _ = HfModel(config_path=str(config)).builder(2)
    model, optimizer, batch, loss = build()
    assert "input_values" not in batch and tuple(batch["input_features"].shape) == (2, 1000, 40)
    assert tuple(batch["attention_mask"].shape) == (2, 1000)
    train_step(model, optimizer, batch, loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_size_a_config_keeps_per_layer_is_a_one_line_error():
    """Some configs refuse to read a per-layer value as one (transformers'
    AmbiguousGlobalPerLayerAttributeError, dots3_note): a usage error, not an internal one."""
    from memdoctor.predict.hf_models import _size_fields

    class PerLayer:
        model_type = "per_layer"
        num_attention_heads = 8

        def __getattr__(self, name):
            raise RuntimeError(f"'{name}' is a per-layer attribute and may vary across layers")
    with pytest.raises(ValueError, match="these sizes do not make a per_layer config: 'num_key_value_heads' is a per-layer"):
        _size_fields(PerLayer(), {"num_attention_heads": 4})


def _params(cfg) -> int:
    import transformers
    auto = "AutoModelForSeq2SeqLM" if cfg.is_encoder_decoder else "AutoModelForCausalLM"
    return sum(p.numel() for p in getattr(transformers, auto).from_config(cfg).parameters())


@needs_transformers
@pytest.mark.parametrize("model_type, sizes, same_as", [
    # a head size of hidden / heads, key/value heads as many as heads
    ("llama", {"num_attention_heads": 4}, {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64}),
    # Mistral's 4 heads per key/value head kept
    ("mistral", {"num_attention_heads": 4}, {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}),
    # both stacks of an encoder-decoder
    ("bart", {"num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 384},
     {"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
      "encoder_ffn_dim": 384, "decoder_ffn_dim": 384}),
    # models that name their MLP their own way
    ("gpt2", {"num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 384},
     {"n_layer": 1, "n_head": 4, "n_inner": 384}),
    ("t5", {"num_hidden_layers": 1, "intermediate_size": 384}, {"num_layers": 1, "num_decoder_layers": 1, "d_ff": 384}),
])
def test_size_flags_build_the_model_transformers_builds_from_those_sizes(model_type, sizes, same_as):
    import transformers

    from memdoctor.predict.hf_models import HfModel
    small = {"vocab_size": 512, "hidden_size": 256} | ({} if model_type in ("bart", "gpt2", "t5") else
                                                       {"num_hidden_layers": 1, "intermediate_size": 384})
    ours = HfModel(model_type, None, {**small, **sizes}).config()
    theirs = transformers.AutoConfig.for_model(model_type, **{**small, **same_as})
    assert _params(ours) == _params(theirs)


@needs_transformers
def test_size_flags_on_a_config_file_resize_what_the_file_leaves_derived(tmp_path):
    import transformers

    from memdoctor.predict.hf_models import HfModel
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 512, "vocab_size": 512}))
    ours = HfModel(None, str(tmp_path), {"hidden_size": 256, "num_attention_heads": 8}).config()
    assert (ours.head_dim, ours.num_key_value_heads) == (32, 2)
    theirs = transformers.AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                               num_hidden_layers=1, intermediate_size=512, vocab_size=512)
    assert _params(ours) == _params(theirs)


@needs_transformers
@pytest.mark.parametrize("args, says", [
    (["--hf", "bert", "--kv-heads", "2"], "has no num_key_value_heads"),
    (["--layers", "2"], "give --hf TYPE or --hf-config FILE"),
    (["--hf", "no-such-type"], "not a transformers configuration"),
    (["--hf-config", "/no/such/config.json"], "no such config file"),
    (["--hf", "llama", "--model", "gpt2-124m"], "give one of"),
    (["--hf", "llama", "--hf-config", "x.json"], "not both"),
])
def test_bad_transformers_options_are_one_line_usage_errors(capsys, args, says):
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


@needs_transformers
def test_plan_takes_a_transformers_model(capsys):
    code = main(["plan", *SMALL_LLAMA, "--budget", "8GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plans"] and data["plans"][0]["fits"]
    assert main(["plan", "--budget", "8GiB"]) == 2


def test_a_build_that_reads_sys_argv_when_called_sees_the_script_arguments(capsys, tmp_path):
    script = tmp_path / "argv_build.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from torch import nn

        def build():
            width = int(sys.argv[sys.argv.index("--width") + 1])       # read when called, not at import
            model = nn.Linear(width, width)
            return model, None, torch.randn(8, width), lambda m, b: m(b).sum()
    """))
    code = main(["estimate", str(script), "--device", "cpu", "--json", "--", "--width", "96"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["params"] == 96 * 96 + 96
