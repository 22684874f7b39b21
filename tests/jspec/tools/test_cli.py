"""The jspec command: convert and generate end to end (streamed, batched, JSON), the vLLM-style flags, the
subcommands that forward their arguments, and one-line errors for bad input."""

import contextlib
import io
import json
import os

import pytest
from tokenizers import Tokenizer

from jspec.tools.cli import TextStream, main, parse_args
from jspec.tools.demo_model import write_random_hf_checkpoint

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1}
PROMPT = "def f(x):"
NEW = "8"  # --max-tokens for the single-prompt runs: every run below shares its shapes


def run(*argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def completion(stdout: str, prompt: str = PROMPT) -> str:
    """The text printed after the prompt, up to the stats line."""
    block = stdout.split(f"--- {prompt!r}\n", 1)[1].split("\n--- ", 1)[0]
    assert block.startswith(prompt), stdout
    return block[len(prompt):]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A converted random SMALL Llama with a byte-level BPE tokenizer."""
    tmp = tmp_path_factory.mktemp("cli")
    hf = write_random_hf_checkpoint(str(tmp / "hf"), config=SMALL)
    code, _, _ = run("convert", "--src", hf, "--dst", str(tmp / "out"))
    assert code == 0
    return str(tmp / "out")


@pytest.fixture(scope="module")
def plain_json(small_model):
    """``--json`` for PROMPT, greedy, plain decoding: the reference the streamed runs must print."""
    code, out, _ = run("generate", "--model", small_model, "--max-tokens", NEW, "--json", PROMPT)
    assert code == 0
    return json.loads(out)


def test_convert_then_generate_json(small_model, capsys):
    assert main(["generate", "--model", small_model, "--max-new-tokens", "5", "--json",
                 "def f(x):", "import os"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["texts"]) == 2
    assert all(1 <= len(ids) <= 5 for ids in result["token_ids"])
    assert result["stats"]["acceptance_length"] == 1.0
    assert result["sampling"]["max_new_tokens"] == 5 and result["baseline"] is None


def test_max_tokens_is_vllms_name_for_max_new_tokens(plain_json):
    assert parse_args(["generate", "--max-tokens", "7"]).max_new_tokens == 7
    assert plain_json["sampling"]["max_new_tokens"] == int(NEW)
    assert 1 <= len(plain_json["token_ids"][0]) <= int(NEW)


def test_streamed_output_equals_the_generated_one(small_model, plain_json):
    code, out, _ = run("generate", "--model", small_model, "--max-tokens", NEW, PROMPT)
    assert code == 0
    assert completion(out) == plain_json["texts"][0]
    assert "as streamed" in out and "speedup" not in out  # no drafter: no baseline


def test_speculative_stream_equals_plain_decoding_and_counts_steps_as_generate(small_model, plain_json):
    flags = ["generate", "--model", small_model, "--drafter", "ngram", "--tree", "chain", "--num-draft-tokens", "3",
             "--max-tokens", NEW]
    code, out, _ = run(*flags, PROMPT)
    assert code == 0
    assert completion(out) == plain_json["texts"][0]
    stats = [line for line in out.splitlines() if line.startswith("--- ") and "tokens/s" in line]
    assert len(stats) == 2 and "streamed the same way" in stats[1] and "speedup" in stats[1], out
    code, out, _ = run(*flags, "--json", PROMPT)
    report = json.loads(out)
    assert report["token_ids"] == plain_json["token_ids"] and report["speedup"] > 0
    generated = report["stats"]
    assert (f"acceptance length {generated['acceptance_length']:.2f} ({generated['num_verify_steps']} target "
            f"steps)") in stats[0]


def test_no_stream_with_a_stop_token_prints_the_completion_up_to_it(small_model, plain_json):
    ids = plain_json["token_ids"][0]
    if len(ids) < 3:
        pytest.skip(f"the random model stopped after {len(ids)} tokens")
    stop = ids[2]
    expected = ids[:ids.index(stop) + 1]
    code, out, _ = run("generate", "--model", small_model, "--max-tokens", NEW, "--no-stream",
                       "--stop-token-ids", str(stop), PROMPT)
    assert code == 0
    tokenizer = Tokenizer.from_file(os.path.join(small_model, "tokenizer.json"))
    assert completion(out) == tokenizer.decode(expected, skip_special_tokens=True)
    assert "one generate call" in out


def test_stop_token_ids_are_comma_separated_ints():
    assert parse_args(["generate", "--stop-token-ids", "2,13", "--stop-token-ids", "7"]).stop_token_ids == [2, 13, 7]
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()):
        parse_args(["generate", "--stop-token-ids", "two"])
    assert exit_info.value.code == 2


def test_text_stream_holds_back_split_characters(small_model):
    tokenizer = Tokenizer.from_file(os.path.join(small_model, "tokenizer.json"))
    ids = tokenizer.encode("naïve café — 😀 ok", add_special_tokens=False).ids
    prefixes = [tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes)  # the input really splits a character over tokens
    stream = TextStream(tokenizer)
    pieces = [stream.piece(ids[:n]) for n in range(1, len(ids) + 1)] + [stream.piece(ids, final=True)]
    assert "".join(pieces) == "naïve café — 😀 ok"
    assert not any("\ufffd" in piece for piece in pieces)


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error:") and "missing" in err and "Traceback" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["generate", "--drafter", "ngram", "--tree", "dynamic", "--num-draft-tokens", "0", "x"],
    ["generate", "--drafter", "ngram", "--tree", "chain", "--num-draft-tokens", "1", "x"],
    ["generate", "--top-p", "0", "x"],
    ["generate", "--max-tokens", "0", "x"],
])
def test_bad_generate_flags_are_one_line_before_any_compile(small_model, argv):
    code, out, err = run(*argv[:1], "--model", small_model, *argv[1:])
    assert code == 2 and out == ""
    assert err.startswith("jspec: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_a_config_without_a_required_key_is_one_line(tmp_path):
    hf = write_random_hf_checkpoint(str(tmp_path / "hf"), config=SMALL)
    config = dict(SMALL)
    del config["num_attention_heads"]
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    code, _, err = run("convert", "--src", hf, "--dst", str(tmp_path / "out"))
    assert code == 2 and "num_attention_heads" in err and err.count("\n") == 1


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    argv = ["generate", "--model", str(tmp_path / "missing"), "x"]
    argv = ["--debug"] + argv if where == "before" else argv + ["--debug"]
    with pytest.raises(FileNotFoundError, match="missing"):
        main(argv)


@pytest.mark.parametrize("command", ["train-drafter", "train-target"])
def test_training_commands_have_their_own_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: jspec {command}") and "--work-dir" in out and "--warmup-steps" in out


def test_training_flags_are_validated_in_one_line():
    code, _, err = run("train-drafter", "--kind", "eagle3", "--target", "t", "--out", "o", "--work-dir", "w",
                       "--steps", "5", "--warmup-steps", "9")
    assert code == 2 and err == "jspec: error: warmup_steps=9 must be below steps=5\n"


def test_train_drafter_runs_end_to_end(small_model, tmp_path):
    from tests.train_fixtures import tiny_corpus

    target_hf = os.path.join(os.path.dirname(small_model), "hf")
    out = str(tmp_path / "draft_hf")
    code, stdout, _ = run("train-drafter", "--kind", "draft_model", "--num-layers", "1", "--target", target_hf,
                          "--out", out, "--work-dir", str(tmp_path / "work"), "--steps", "2", "--warmup-steps", "1",
                          "--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "2", "--eval-every", "2",
                          "--eval-batches", "1", "--corpus-root", tiny_corpus(str(tmp_path / "corpus")),
                          "--no-progress")
    assert code == 0 and stdout.strip().endswith(f"wrote {out}")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1


def test_bench_forwards_every_argument(monkeypatch):
    import jspec.tools.bench

    seen = []
    monkeypatch.setattr(jspec.tools.bench, "main", lambda argv: seen.append(argv) or 3, raising=False)
    argv = ["--target", "out/llama", "--batch", "1", "-h", "--decay", "-0.5", "extra"]
    assert main(["bench", *argv, "--debug"]) == 3
    assert seen == [argv]  # --debug is jspec's own


def test_bench_help():
    import jspec.tools.bench

    if not hasattr(jspec.tools.bench, "main"):
        pytest.skip("jspec.tools.bench.main is not written yet")
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stdout(io.StringIO()) as out:
        main(["bench", "--help"])
    assert exit_info.value.code == 0 and "usage:" in out.getvalue()
