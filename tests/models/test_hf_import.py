"""A broken Hugging Face source (corrupt safetensors, a config.json field missing, an index without a weight_map)
is a ValueError naming the file and what is wrong, raised before anything is written: nothing is left at dst."""

import contextlib
import io
import json
import os
import re
import shutil

import pytest

from jspec.tools.cli import main
from jspec.tools.demo_model import write_random_hf_checkpoint
from models.checkpoint import convert_hf_checkpoint, convert_hf_llama
from models.checkpoint.hf_params import naming_config

SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1,
}
CONVERTERS = {"convert_hf_checkpoint": convert_hf_checkpoint, "convert_hf_llama": convert_hf_llama}


@pytest.fixture(scope="module")
def valid_hf_dir(tmp_path_factory):
    return write_random_hf_checkpoint(str(tmp_path_factory.mktemp("valid") / "hf"), config=SMALL)


@pytest.fixture
def hf_dir(valid_hf_dir, tmp_path):
    """A fresh copy of the valid source, to break."""
    return shutil.copytree(valid_hf_dir, tmp_path / "hf")


def assert_nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []  # no temp dir left either


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _random_bytes(path):
    path.write_bytes(os.urandom(4096))


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("convert", CONVERTERS.values(), ids=CONVERTERS.keys())
@pytest.mark.parametrize("corrupt, reason", [
    (_truncate, "file not fully covered"),
    (_random_bytes, "header too large"),
    (_empty, "header too small"),
])
def test_corrupt_safetensors_named(hf_dir, tmp_path, convert, corrupt, reason):
    path = hf_dir / "model.safetensors"
    corrupt(path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a readable safetensors file (") + f".*{reason}.*"
                       + re.escape("); truncated or corrupt?")):
        convert(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


def test_corrupt_safetensors_is_a_user_error_in_the_cli(hf_dir, tmp_path):
    """``jspec convert`` prints one error line naming the file (no traceback) and exits 2."""
    _truncate(hf_dir / "model.safetensors")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["convert", "--src", str(hf_dir), "--dst", str(tmp_path / "out")])
    assert code == 2
    assert str(hf_dir / "model.safetensors") in err.getvalue()
    assert "Traceback" not in err.getvalue()
    assert_nothing_written(tmp_path)


def _drop_from_config(hf_dir, field, **changes):
    path = hf_dir / "config.json"
    config = dict(json.loads(path.read_text()), **changes)
    del config[field]
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_field_named_with_the_file(hf_dir, tmp_path, field):
    path = _drop_from_config(hf_dir, field)
    with pytest.raises(ValueError, match=rf"{field}=None.*\(in {re.escape(str(path))}\)"):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


def test_missing_eagle3_config_field_named_with_the_file(hf_dir, tmp_path):
    """A config.json naming an EAGLE-3 architecture goes to the EAGLE-3 converter, which names the file too."""
    path = _drop_from_config(hf_dir, "num_attention_heads", architectures=["LlamaForCausalLMEagle3"],
                             num_hidden_layers=1)
    with pytest.raises(ValueError, match=rf"config.json num_attention_heads=None.*\(in {re.escape(str(path))}\)"):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


def test_a_key_error_reading_config_becomes_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'}: no 'rope_theta' field")):
        with naming_config(str(tmp_path)):
            raise KeyError("rope_theta")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ("[1, 2]", "no 'weight_map'"),
])
def test_bad_index_named(hf_dir, tmp_path, content, message):
    index = hf_dir / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{index}: {message}")):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_bad_config_json_named(hf_dir, tmp_path, content, message):
    path = hf_dir / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        convert_hf_checkpoint(str(hf_dir), str(tmp_path / "out"), progress=False)
    assert_nothing_written(tmp_path)
