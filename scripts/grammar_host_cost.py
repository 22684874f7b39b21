"""The host's grammar work per structured step, timed on this machine: the root masks of a batch of JSON grammars
(a plain masked step), one committed token consumed by each, and a chain of drafts masked (a speculative one),
node by node and in llguidance's parallel fill.

    python scripts/grammar_host_cost.py --rows 32 --nodes 4

The grammars are a JSON schema like docs/benchmarks.md's load (a name, a body string), each inside a string after
text of the bundled tokenizer, the drafts the text that follows (all allowed).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import jspec
    from jspec.structured_outputs import StructuredOutputsParams
    from jspec.structured_outputs.grammar import GrammarCompiler
    from jspec.structured_outputs.tree_masks import _constrain_row, constrain_tree, root_bitmask
    from jspec.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=4, help="a chain's nodes, the root included")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(jspec.bundled_model())
    vocab = tokenizer.get_vocab_size()
    compiler = GrammarCompiler(tokenizer, vocab, (2,))
    schema = StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "body": {"type": "string"}},
        "required": ["name", "body"], "additionalProperties": False}, disable_any_whitespace=True)
    matchers, chains = [], []
    for row in range(args.rows):
        matcher = compiler.matcher(schema)
        assert matcher.consume_tokens(matcher.compute_ff_tokens())  # the first key, forced
        ids = tokenizer.encode(f'"def f(x): return x + {row} * y - z + w * {row}', add_special_tokens=False).ids
        valid = matcher.validate_tokens(ids)
        assert valid > args.nodes, (valid, args.nodes)
        cut = valid - args.nodes + 1
        assert matcher.consume_tokens(ids[:cut])
        matchers.append(matcher)
        chains.append(ids[cut - 1:cut - 1 + args.nodes])
    tokens = np.asarray(chains)
    chain = np.tril(np.ones((args.nodes, args.nodes), bool))[None].repeat(args.rows, axis=0)

    def timed(name: str, call) -> None:
        call()
        start = time.perf_counter()
        for _ in range(args.repeats):
            call()
        print(f"{name}: {(time.perf_counter() - start) / args.repeats * 1e3:.3f} ms per {args.rows} rows")

    def consume() -> None:
        for matcher, row in zip(matchers, tokens):
            assert matcher.consume_token(int(row[1]))
            matcher.rollback(1)

    def node_by_node() -> None:
        out = np.full((args.rows, args.nodes, (vocab + 31) // 32), -1, np.int32)
        depth = chain.sum(axis=-1) - 1
        for b, matcher in enumerate(matchers):
            _constrain_row(matcher, tokens[b].copy(), chain[b], depth[b], out[b], args.nodes, vocab, True)

    timed("root masks (a plain masked step)", lambda: root_bitmask(matchers, vocab))
    timed("one token consumed and rolled back, each", consume)
    timed(f"a chain of {args.nodes} nodes masked node by node", node_by_node)
    timed(f"a chain of {args.nodes} nodes masked (parallel fill)", lambda: constrain_tree(matchers, tokens, chain,
                                                                                          vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
