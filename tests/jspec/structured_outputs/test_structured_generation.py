"""Structured generation on the bundled model: every output matches its constraint, and speculative decoding with
each bundled drafter gives plain decoding's greedy tokens under the same grammar (each draft-tree node masked by
its own path's grammar state, forced tokens drafted). Acceptance with and without the grammar is printed
(``pytest -s``)."""

import json
import re

import jsonschema
import pytest

import jspec
from tests.jspec.structured_outputs.schemas import SCHEMAS

JSON_PROMPT = "# JSON\nrecord = "
DRAFTERS = {
    "eagle3": jspec.SpecConfig(tree="dynamic", num_steps=4, topk=4, num_draft_tokens=16),
    "draft": jspec.SpecConfig(tree="chain", num_steps=4),
    "ngram": jspec.SpecConfig(tree="chain", num_steps=5),
    "ngram+eagle3": jspec.SpecConfig(tree="chain", num_steps=5),
}
MIXED = [  # (prompt, constraint, check of the output text)
    (JSON_PROMPT, {"json": SCHEMAS[17], "disable_any_whitespace": True},
     lambda text: jsonschema.validate(json.loads(text), SCHEMAS[17])),
    ("# a call\nresult = ", {"regex": r"[a-z_]{1,10}\([0-9]{1,3}\)"},
     lambda text: re.fullmatch(r"[a-z_]{1,10}\([0-9]{1,3}\)", text) or pytest.fail(text)),
    ("def is_even(n):\n    return ", {"choice": ["True", "False", "n % 2 == 0"]},
     lambda text: text in ("True", "False", "n % 2 == 0") or pytest.fail(text)),
    ("x = ", {"grammar": 'start: NUMBER " + " NUMBER\nNUMBER: /[1-9][0-9]{0,2}/'},
     lambda text: re.fullmatch(r"[1-9][0-9]{0,2} \+ [1-9][0-9]{0,2}", text) or pytest.fail(text)),
    ("def add(a, b):\n", None, lambda text: None),  # a row without a grammar beside constrained ones
]


@pytest.fixture(scope="module")
def plain_engine():
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=10, max_seq_len=256,
                                              dtype="float32")


def speculative(plain_engine, drafter):
    return jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=DRAFTERS[drafter],
                                              max_batch_size=10, max_seq_len=256, dtype="float32")


def mixed(engine, **kwargs):
    prompts, constraints, _ = zip(*MIXED)
    return engine.generate(list(prompts), max_new_tokens=40, structured_outputs=list(constraints), **kwargs)


@pytest.fixture(scope="module")
def plain_mixed(plain_engine):
    out = mixed(plain_engine)
    for (_, _, check), text in zip(MIXED, out.texts):
        check(text)
    return out


def test_speculative_equals_plain_under_json_regex_choice_and_grammar(plain_engine, plain_mixed):
    """EAGLE-3's tree under a schema, a regex, a choice and a Lark grammar at once, beside an unconstrained row:
    plain decoding's tokens under the same constraints (each output checked against its constraint)."""
    out = mixed(speculative(plain_engine, "eagle3"))
    assert out.token_ids == plain_mixed.token_ids
    assert out.stats.acceptance_length > 1.0


# slow: sampled outputs under grammars still match them; default tier: the greedy mixed case and test_tree_masks
@pytest.mark.slow
def test_sampled_outputs_match_their_constraints(plain_engine):
    engine = speculative(plain_engine, "eagle3")
    out = mixed(engine, temperature=1.0, seed=[3, 4, 5, 6, 7])
    for (_, _, check), text in zip(MIXED, out.texts):
        check(text)


@pytest.fixture(scope="module")
def plain_schemas(plain_engine):
    """Greedy plain decoding of JSON_PROMPT under each of the 20 schemas, compact JSON (two calls of 10)."""
    constraints = [{"json": s, "disable_any_whitespace": True} for s in SCHEMAS]
    return [t for i in (0, 10) for t in plain_engine.generate([JSON_PROMPT] * 10, max_new_tokens=96,
                                                              structured_outputs=constraints[i:i + 10]).token_ids]


# slow: 20 JSON schemas: every output validates, eagle3 / draft / n-gram / hybrid equal plain decoding under the
# grammar; default tier: test_speculative_equals_plain_under_json_regex_choice_and_grammar (eagle3's tree under a
# schema, a regex, a choice and a Lark grammar at once)
@pytest.mark.slow
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_twenty_json_schemas_validate_and_speculation_equals_plain(plain_engine, plain_schemas, drafter):
    engine = speculative(plain_engine, drafter)
    constraints = [{"json": s, "disable_any_whitespace": True} for s in SCHEMAS]
    token_ids, constrained, free = [], [], []
    for i in (0, 10):
        out = engine.generate([JSON_PROMPT] * 10, max_new_tokens=96, structured_outputs=constraints[i:i + 10])
        token_ids += out.token_ids
        constrained.append(out.stats.acceptance_length)
        free.append(engine.generate([JSON_PROMPT] * 10, max_new_tokens=96).stats.acceptance_length)
        for schema, text in zip(SCHEMAS[i:i + 10], out.texts):
            jsonschema.validate(json.loads(text), schema)
    assert token_ids == plain_schemas
    print(f"{drafter} acceptance over 20 schemas: {sum(constrained) / 2:.2f} constrained, "
          f"{sum(free) / 2:.2f} free")
