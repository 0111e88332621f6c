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
                        "AutoModelForImageClassification")):
        code = main(["estimate", *args, "--batch", "2", "--seq", "64", "--json"])
        assert code == 0 and json.loads(capsys.readouterr().out)["config"]["task"] == kind


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
