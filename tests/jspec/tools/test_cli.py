"""The jspec command: convert and generate end to end (streamed, batched, JSON), the vLLM-style flags, the
subcommands that forward their arguments, and one-line errors for bad input. (Ctrl-C and the compilation cache,
which need a process of their own: test_cli_process.py.)"""

import contextlib
import io
import json
import os

import pytest
from tokenizers import Tokenizer

import jspec
from jspec.tools import bundled
from jspec.detokenize import TextStream
from jspec.tools.cli import build_parser, main, parse_args
from jspec.tools.generate_cmd import as_flags
from jspec.tools.demo_model import write_random_hf_checkpoint
from tests.compile_cache import session_compile_cache_off

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


@pytest.fixture(autouse=True, scope="module")
def _jspec_home(tmp_path_factory):
    """main() keeps compiled programs under $JSPEC_HOME/compile-cache: a fresh one, not the user's (nor the test
    session's, which main() would leave in charge)."""
    with pytest.MonkeyPatch.context() as patch, session_compile_cache_off():
        patch.setenv("JSPEC_HOME", str(tmp_path_factory.mktemp("jspec-home")))
        yield


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


def test_convert_then_generate_json_prints_what_the_engine_generates(small_model, capsys):
    prompts = ["def f(x):", "import os"]
    assert main(["generate", "--model", small_model, "--max-new-tokens", "5", "--json", *prompts]) == 0
    report = json.loads(capsys.readouterr().out)
    engine = jspec.SpecEngine.from_pretrained(small_model, max_batch_size=2, max_seq_len=1024)
    expected = engine.generate(prompts, max_new_tokens=5)
    assert report["token_ids"] == expected.token_ids and report["texts"] == expected.texts
    assert report["prompts"] == prompts and report["sampling"]["max_new_tokens"] == 5
    for ids in report["token_ids"]:  # 5 new tokens unless EOS came first
        assert len(ids) == 5 or (0 < len(ids) < 5 and ids[-1] in engine.eos_token_ids), ids
    stats = report["stats"]
    assert stats["num_generated_tokens"] == sum(len(ids) for ids in report["token_ids"])
    # plain decoding: one verify step per token after the prefill's
    assert stats["num_verify_steps"] == sum(len(ids) - 1 for ids in report["token_ids"])
    assert report["drafter"] is None and report["spec"] is None and report["baseline"] is None


def test_compiled_programs_are_kept_under_jspec_home_and_the_cache_is_off_after_main(small_model, plain_json,
                                                                                    tmp_path, monkeypatch):
    import jax

    assert os.listdir(os.path.join(os.environ["JSPEC_HOME"], "compile-cache"))  # plain_json's programs
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JSPEC_HOME", str(tmp_path))
    code, out, _ = run("generate", "--model", small_model, "--max-tokens", NEW, "--json", "--no-compile-cache", PROMPT)
    assert code == 0 and json.loads(out)["token_ids"] == plain_json["token_ids"]
    assert not os.path.exists(tmp_path / "compile-cache")


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


# slow: the CLI with the bundled head = plain with fewer steps; default tier:
# test_speculative_stream_equals_plain_decoding_and_counts_steps_as_generate, test_auto's bundled engine
@pytest.mark.slow
def test_bundled_eagle3_generates_plain_decodings_tokens_with_fewer_target_steps():
    flags = ["generate", "--json", "--max-new-tokens", "24", "def fibonacci(n):"]
    code, out, _ = run(*flags, "--no-baseline", "--drafter", "eagle3", "--tree", "dynamic")  # the bundled target with its EAGLE-3 head
    assert code == 0
    speculative = json.loads(out)
    code, out, _ = run(*flags, "--drafter", "none")
    assert code == 0
    plain = json.loads(out)
    assert speculative["drafter"] == "eagle3" and plain["drafter"] is None
    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"][0]) == 24
    assert plain["stats"]["num_verify_steps"] == 23
    assert speculative["stats"]["acceptance_length"] > 1.5  # the trained head's drafts are accepted
    assert speculative["stats"]["num_verify_steps"] < 23 / 1.5


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


def test_empty_prompts_are_refused_by_name(small_model):
    for prompt, what in [("", "empty"), ("  \n", "only whitespace")]:
        code, out, err = run("generate", "--model", small_model, "def f(x):", prompt)
        assert code == 2 and out == ""
        assert err == f"jspec: error: prompt 1 is {what} ({prompt!r}): give the text to continue\n"


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """SMALL with max_position_embeddings=64, converted."""
    tmp = tmp_path_factory.mktemp("short")
    hf = write_random_hf_checkpoint(str(tmp / "hf"), config={**SMALL, "max_position_embeddings": 64})
    assert run("convert", "--src", hf, "--dst", str(tmp / "out"))[0] == 0
    return str(tmp / "out")


def test_max_seq_len_beyond_the_models_positions_is_refused(short_model):
    code, out, err = run("generate", "--model", short_model, "--max-seq-len", "128", PROMPT)
    assert code == 2 and out == ""
    assert err == "jspec: error: --max-seq-len 128 exceeds the model's max_position_embeddings=64\n"
    with pytest.raises(ValueError, match="max_seq_len=128 exceeds the model's max_position_embeddings=64"):
        jspec.SpecEngine.from_pretrained(short_model, max_seq_len=128)
    with pytest.raises(ValueError, match="max_seq_len=128 exceeds the model's max_position_embeddings=64"):
        jspec.SpecEngine.from_pretrained(short_model, drafter=short_model, max_seq_len=128)  # a draft model too


def test_default_max_seq_len_fits_the_model(short_model):
    assert parse_args(["generate"]).max_seq_len is None  # resolved once the model is known
    code, out, _ = run("generate", "--model", short_model, "--max-tokens", "4", "--json", PROMPT)
    assert code == 0 and len(json.loads(out)["token_ids"][0]) >= 1  # 1024 would have been refused
    if bundled.bundled_dir("target") is not None:
        with open(os.path.join(bundled.bundled_dir("target"), "config.json")) as f:
            assert json.load(f)["max_position_embeddings"] >= 1024  # the bundled model takes the plain default


def test_too_long_a_prompt_names_the_flags(short_model):
    code, _, err = run("generate", "--model", short_model, "--max-tokens", "8", "x = 1\n" * 40)
    assert code == 2
    assert err.startswith("jspec: error: prompt 0 has ")
    assert "tokens; with --max-new-tokens 8 that exceeds --max-seq-len 64" in err


def test_engine_argument_names_become_flags():
    assert as_flags("prompt 0 has 30 tokens; with max_new_tokens=8 that exceeds max_seq_len=32") == (
        "prompt 0 has 30 tokens; with --max-new-tokens 8 that exceeds --max-seq-len 32")
    assert as_flags("so use max_seq_len <= 256") == "so use --max-seq-len <= 256"
    assert as_flags("drafter.max_seq_len=3, max_seq_lens=4") == "drafter.max_seq_len=3, max_seq_lens=4"


def test_a_key_error_is_a_bug_and_shows_its_traceback(monkeypatch):
    def broken(args):
        raise KeyError("num_layers")

    from jspec.tools import cli

    add_args, _, help_text, description = cli.OWN_ARGUMENTS["convert"]
    monkeypatch.setitem(cli.OWN_ARGUMENTS, "convert", (add_args, broken, help_text, description))
    with pytest.raises(KeyError, match="num_layers"):
        main(["convert", "--src", "a", "--dst", "b"])


@pytest.mark.parametrize("command, shown", [
    ("generate", ["(default: 128)", "default: auto, the tree with the most expected tokens/s on this device; "
                  "otherwise a chain of 10 tokens for ngram, a dynamic tree of 32", "(default: 0.0)",
                  "(default: 1.0)",
                  "(default: 1024, or the model's max_position_embeddings if smaller)"]),
    ("convert", ["(default: auto)"]),
])
def test_help_shows_the_defaults(command, shown):
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(subparsers.choices[command].format_help().split())
    for piece in shown:
        assert piece in text, piece
    assert "(default: None)" not in text and "(default: False)" not in text


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


# slow: jspec train-drafter through the CLI; default tier: tests/jspec/train/test_train_drafter.py
@pytest.mark.slow
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
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stdout(io.StringIO()) as out:
        main(["bench", "--help"])
    assert exit_info.value.code == 0 and "usage:" in out.getvalue()


@pytest.mark.parametrize("flags, drafter, expected", [
    ([], "ngram", dict(tree="chain", num_steps=9)),
    ([], "eagle3", dict(tree="dynamic", num_steps=8, topk=4, num_draft_tokens=32, selection="top1_chain")),
    (["--selection", "eagle2"], "eagle3", dict(tree="dynamic", num_steps=8, topk=4, num_draft_tokens=32)),
    (["--num-steps", "12", "--num-draft-tokens", "10"], "eagle3",  # no node per depth: EAGLE-2's selection
     dict(tree="dynamic", num_steps=12, topk=4, num_draft_tokens=10)),
    (["--num-draft-tokens", "6"], "ngram", dict(tree="chain", num_steps=5)),
    (["--tree", "dynamic"], "ngram", dict(tree="dynamic", num_steps=9, topk=4, num_draft_tokens=10)),
    (["--tree", "chain", "--num-draft-tokens", "4"], "eagle3", dict(tree="chain", num_steps=3)),
    (["--num-steps", "3", "--topk", "2", "--num-draft-tokens", "8"], "draft",
     dict(tree="dynamic", num_steps=3, topk=2, num_draft_tokens=8, selection="top1_chain")),
    (["--kernels", "tpu_interpret"], "ngram", dict(tree="chain", num_steps=9, kernels="tpu_interpret")),
])
def test_tree_flags_override_the_drafters_default_tree(flags, drafter, expected):
    import jspec
    from jspec.tools.generate_cmd import draft_spec

    args = parse_args(["generate", *flags])
    assert draft_spec(args, drafter) == jspec.SpecConfig(**expected)
    assert draft_spec(args, None) is None


def test_kernels_turn_auto_off_like_the_other_tree_flags():
    from jspec.tools.generate_cmd import wants_auto

    assert wants_auto(parse_args(["generate"]), None)
    assert not wants_auto(parse_args(["generate", "--kernels", "reference"]), None)


def test_selection_on_a_chain_is_refused():
    from jspec.tools.generate_cmd import draft_spec

    with pytest.raises(ValueError, match="--selection top1_chain applies to dynamic trees, not --tree chain"):
        draft_spec(parse_args(["generate", "--tree", "chain", "--selection", "top1_chain"]), "eagle3")
