"""User-provided drafters (docs/drafters.md): the page's lookup-table drafter, written out as a module outside the
jspec package and registered from there, gives plain decoding's greedy output with drafts accepted (chain and
static tree) and reproducible sampled output; it works by name in from_pretrained, through an entry point
(importlib.metadata, faked here) and on the CLI. Bad registrations, broken plugins and drafters that miss the
protocol are refused with errors that name what is wrong."""

import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import os
import re
import sys

import pytest

import jspec
from jspec.drafters import DRAFTERS, ENTRY_POINT_GROUP, DrafterBase, DrafterEntry, load, register, resolve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]
CHAIN = jspec.SpecConfig(tree="chain", num_steps=3)
BRANCHES = jspec.SpecConfig(tree="static", tree_choices=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
NEW = 24


def doc_blocks(language: str) -> list[str]:
    text = open(os.path.join(REPO, "docs", "drafters.md")).read()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """docs/drafters.md's drafter as the module ``lookup_table`` in a directory outside the package."""
    root = tmp_path_factory.mktemp("user_drafters")
    (root / "lookup_table.py").write_text(doc_blocks("python")[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        sys.modules.pop("lookup_table", None)
        module = importlib.import_module("lookup_table")
        assert not module.__file__.startswith(os.path.join(REPO, "jspec"))
        yield module
        sys.modules.pop("lookup_table", None)


@contextlib.contextmanager
def registry_restored():
    saved = dict(DRAFTERS)
    try:
        yield
    finally:
        DRAFTERS.clear()
        DRAFTERS.update(saved)


@pytest.fixture(autouse=True)
def _restore_registry():
    """Whatever a test registers is gone after it (test_drafter_registry.py checks the built-in table)."""
    with registry_restored():
        yield


def fake_entry_points(monkeypatch, **values: str) -> None:
    """importlib.metadata.entry_points as if an installed package declared ``name = value`` in our group."""
    real = importlib.metadata.entry_points
    eps = [importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in values.items()]

    def entry_points(**params):
        if params.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(eps)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.fixture(scope="module")
def engines(user_module):
    """(chain engine, static-tree engine, plain engine, plain greedy token ids of PROMPTS)."""
    with registry_restored():
        user_module.register_lookup_table()
        chain = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="lookup-table", spec=CHAIN,
                                                 max_batch_size=4, max_seq_len=64)
        branches = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="lookup-table", spec=BRANCHES,
                                                    max_batch_size=4, max_seq_len=64)
    plain = chain.plain()
    return chain, branches, plain, plain.generate(PROMPTS, max_new_tokens=NEW).token_ids


# slow: a user-registered drafter's greedy output = plain with drafts accepted (chain, branching tree); default tier:
# test_docs_python_usage_runs (the docs' usage of the same chain drafter asserts both)
@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "branches"])
def test_greedy_output_is_the_targets_and_drafts_are_accepted(engines, user_module, tree):
    engine = engines[0] if tree == "chain" else engines[1]
    assert type(engine.setup.drafter) is user_module.LookupTableDrafter
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert out.token_ids == engines[3]
    assert out.stats.acceptance_length > 1.0, out.stats  # the table's drafts really are accepted
    assert out.stats.num_verify_steps < sum(len(ids) - 1 for ids in out.token_ids)


# slow: a user drafter's sampled tokens repeat per prompt seed, greedy and sampled share a program; default tier:
# test_per_request_seeds (the same property for the built-in drafters)
@pytest.mark.slow
def test_sampled_output_is_reproducible_per_prompt(engines):
    engine = engines[0]
    out = engine.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=[1, 2, 3])
    again = engine.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=[1, 2, 3])
    reordered = engine.generate(PROMPTS[::-1], max_new_tokens=NEW, temperature=1.0, seed=[3, 2, 1])
    assert out.token_ids == again.token_ids == reordered.token_ids[::-1]
    other = engine.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=[4, 5, 6])
    assert other.token_ids != out.token_ids
    assert engine.num_compiled == 1  # greedy and sampled share the program
def test_docs_python_usage_runs(user_module):
    usage = doc_blocks("python")[1]
    assert "from lookup_table import register_lookup_table" in usage
    namespace = {}
    exec(compile(usage, "docs/drafters.md", "exec"), namespace)  # asserts greedy output == plain decoding's
    assert namespace["out"].stats.acceptance_length > 1.0


def test_the_drafter_refuses_a_dynamic_tree(user_module):
    with pytest.raises(ValueError, match="drafts chains and static trees; got tree='dynamic'"):
        user_module.LookupTableDrafter(jspec.SpecConfig(tree="dynamic"), 64)


class Stateless(DrafterBase):
    def prefill(self, params_t, params_d, ctx):
        return ()

    def propose(self, params_t, params_d, state, root, cache_len, *, sampling=None, key=None):
        raise AssertionError("never traced")


@dataclasses.dataclass(frozen=True)
class NoCommit(Stateless):
    spec: jspec.SpecConfig
    max_seq_len: int


@dataclasses.dataclass  # not frozen: unhashable
class Mutable(Stateless):
    spec: jspec.SpecConfig
    max_seq_len: int

    def commit(self, params_t, params_d, state, ctx):
        return state


def load_as(name, drafter_load):
    register(name, drafter_load, description="a test drafter")
    return load(name, target=None, target_dir=None, spec=CHAIN, max_seq_len=64, dtype="float32")


def test_drafters_missing_the_protocol_are_refused_at_load():
    with pytest.raises(TypeError, match=r"drafter 'no-commit' \(load=.*\) is a NoCommit, which does not implement "
                                        r"the jspec.drafters.Drafter protocol: missing commit\(\)"):
        load_as("no-commit", lambda source: (NoCommit(source.spec, source.max_seq_len), {}))
    with pytest.raises(TypeError, match=r"missing spec, max_seq_len, tap_layers, short_chain_nodes, caches_prefix, "
                                        r"with_max_seq_len\(\), prefill\(\), propose\(\), commit\(\), "
                                        r"prefill_cached\(\), param_specs\(\)"):
        load_as("nothing", lambda source: (object(), {}))
    with pytest.raises(TypeError, match="is a Mutable, which is not hashable.*frozen dataclass"):
        load_as("mutable", lambda source: (Mutable(source.spec, source.max_seq_len), {}))
    with pytest.raises(TypeError, match=r"drafter 'no-params' .* returned Mutable: expected a \(drafter, params\)"):
        load_as("no-params", lambda source: Mutable(source.spec, source.max_seq_len))


def test_bad_registrations_are_refused(user_module):
    user_module.register_lookup_table()
    with pytest.raises(ValueError, match="drafter name 'lookup-table' is already registered.*overwrite=True"):
        user_module.register_lookup_table()
    with pytest.raises(ValueError, match="drafter name 'ngram' is already registered"):
        register("ngram", user_module.load, description="x")
    entry = register("lookup-table", user_module.load, description="replaced", overwrite=True)
    assert DRAFTERS["lookup-table"] is entry and entry.description == "replaced"
    with pytest.raises(ValueError, match="load='not a function' is not callable"):
        register("mine", "not a function", description="x")
    for name in ("", "  ", 3, None):
        with pytest.raises(ValueError, match="expected a non-empty string"):
            register(name, user_module.load, description="x")
    with pytest.raises(ValueError, match="'none' is reserved"):
        register("none", user_module.load, description="x")
    with pytest.raises(ValueError, match="description='': expected a non-empty string"):
        register("mine", user_module.load, description="")
    with pytest.raises(ValueError, match="checkpoint_kind='eagle3' already belongs to drafter 'eagle3'"):
        register("mine", user_module.load, description="x", checkpoint_kind="eagle3")
    with pytest.raises(ValueError, match="bundled_part='mine'"):
        register("mine", user_module.load, description="x", checkpoint_kind="mine", bundled_part="mine")
    assert "mine" not in DRAFTERS


def test_a_user_drafter_with_weights_resolves_by_its_directory(user_module, tmp_path):
    register("tabled", user_module.load, description="x", checkpoint_kind="lookup-table")
    (tmp_path / "jspec.json").write_text(json.dumps({"kind": "lookup-table"}))
    assert resolve(str(tmp_path), None) == ("tabled", str(tmp_path))
    with pytest.raises(ValueError, match="drafter='tabled' loads weights .* pass the drafter's directory"):
        resolve("tabled", None)


def test_entry_points_are_found_when_a_name_is_not_registered(user_module, monkeypatch):
    monkeypatch.setattr(user_module, "ENTRY", DrafterEntry(load=user_module.load, checkpoint_kind=None,
                                                           bundled_part=None, description="as an entry"),
                        raising=False)
    fake_entry_points(monkeypatch, **{"lookup-table": "lookup_table:register_lookup_table",
                                      "as-entry": "lookup_table:ENTRY"})
    assert "lookup-table" not in DRAFTERS
    assert resolve("lookup-table", None) == ("lookup-table", None)
    assert DRAFTERS["lookup-table"].load is user_module.load
    assert resolve("as-entry", None) == ("as-entry", None) and DRAFTERS["as-entry"] is user_module.ENTRY
    with pytest.raises(FileNotFoundError, match=r"drafter='medusa': expected one of \[.*'as-entry', .*'ngram', 'ngram\+eagle3'\]"):
        resolve("medusa", None)


def test_broken_plugins_name_their_entry_point(user_module, monkeypatch):
    fake_entry_points(monkeypatch, missing="no_such_module_for_jspec:register",
                      other="lookup_table:register_lookup_table", text="lookup_table:__name__",
                      raises="lookup_table:LookupTableDrafter")
    with pytest.raises(ValueError, match=r"drafter 'missing': entry point missing = "
                                         r"'no_such_module_for_jspec:register' \(group 'jspec.drafters'\) failed: "
                                         r"ModuleNotFoundError"):
        resolve("missing", None)
    with pytest.raises(ValueError, match="entry point other = .* ran but registered no drafter named 'other'"):
        resolve("other", None)
    with pytest.raises(ValueError, match="entry point raises = .* failed: TypeError"):
        resolve("raises", None)  # the class is called with no arguments
    with pytest.raises(ValueError, match="entry point text = .* it is a str: expected a DrafterEntry or a "
                                         "zero-argument function"):
        resolve("text", None)
    assert not {"missing", "other", "raises", "text"} & set(DRAFTERS)


# slow: jspec generate runs a drafter registered by entry point; default tier: the registry and Python-usage tests
@pytest.mark.slow
def test_cli_generate_with_an_entry_point_drafter(user_module, monkeypatch, tmp_path, capsys):
    from jspec.tools.cli import main

    monkeypatch.setenv("JSPEC_HOME", str(tmp_path))
    fake_entry_points(monkeypatch, **{"lookup-table": "lookup_table:register_lookup_table"})
    assert main(["generate", "--drafter", "lookup-table", "--tree", "chain", "--num-draft-tokens", "4",
                 "--max-tokens", "8", "--max-seq-len", "64", "--no-baseline", "--no-compile-cache", "--json",
                 PROMPTS[0]]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drafter"] == "lookup-table" and report["spec"]["tree"] == "chain"
    plain = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=1, max_seq_len=64)
    assert report["token_ids"] == plain.generate(PROMPTS[:1], max_new_tokens=8).token_ids
    assert main(["generate", "--drafter", "lookup-table", "--tree", "dynamic", "--max-tokens", "8", "--max-seq-len",
                 "64", "--no-compile-cache", PROMPTS[0]]) == 2  # a dynamic tree: refused in one line
    assert "drafts chains and static trees; got tree='dynamic'" in capsys.readouterr().err
    # no tree flag: auto times its candidate chains (calibration fitted into --max-seq-len 64) and picks one
    assert main(["generate", "--drafter", "lookup-table", "--max-tokens", "8", "--max-seq-len", "64", "--no-baseline",
                 "--no-compile-cache", "--json", PROMPTS[0]]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["auto"]["drafter"] in ("lookup-table", None)  # its best chain, or plain if none pays
    assert report["token_ids"] == plain.generate(PROMPTS[:1], max_new_tokens=8).token_ids
