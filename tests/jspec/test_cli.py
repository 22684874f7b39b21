"""The jspec command: convert and generate end to end, and one-line errors for bad input."""

import json

from jspec.cli import main
from jspec.demo_model import write_random_hf_checkpoint

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1}


def test_convert_then_generate_json(tmp_path, capsys):
    hf = write_random_hf_checkpoint(str(tmp_path / "hf"), config=SMALL)
    assert main(["convert", "--src", hf, "--dst", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "out"), "--max-new-tokens", "5", "--json",
                 "def f(x):", "import os"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["texts"]) == 2
    assert all(1 <= len(ids) <= 5 for ids in result["token_ids"])
    assert result["stats"]["acceptance_length"] == 1.0


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error:") and "missing" in err and "Traceback" not in err
    assert err.count("\n") == 1
