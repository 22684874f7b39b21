"""The serving engine's step costs on Llama-3 shapes (random bf16 weights on the device): per occupancy bucket,
seconds per step of the paged server's plain and speculative (EAGLE-3 chain) step programs, and of the chain cut
after ``--short-draft-len`` drafts at the busiest buckets, greedy and with a sampled row, as the load adapter's
start-up table measures them, and the acceptance each bucket needs for a verify pass to pay (speculative step /
plain step).

    python scripts/serve_costs.py --synthetic llama3-8b --rows 1,8,32 --out costs.json     # on a GPU
    python scripts/serve_costs.py --synthetic tiny --rows 1,4                              # CPU smoke check

Costs do not depend on the weights' values (every shape is static); the table is measured at the longest
context (``--max-seq-len``), chunks of ``--steps-per-chunk`` steps, page gathers and write-backs included.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.engine import SpecEngine
from jspec.serve.slots import SlotEngine
from jspec.tools.roofline.shapes import CHAIN, SHAPES, build_models


def measure(name: str, rows: list[int], max_seq_len: int, steps_per_chunk: int,
            short_draft_len: int | None = None) -> dict:
    models = build_models(name)
    shape = models.shape
    drafter = Eagle3Drafter(models.head, models.target, shape.spec(CHAIN), max_seq_len, shape.dtype)
    engine = SpecEngine(models.target, models.params_t, drafter=drafter, drafter_params=models.params_d,
                        max_batch_size=max(rows), max_seq_len=max_seq_len, dtype=shape.dtype)
    slots = SlotEngine(engine, max_seq_len=max_seq_len, steps_per_chunk=steps_per_chunk, row_buckets=rows,
                       seq_buckets=(max_seq_len,), max_num_seqs=max(rows), max_num_batched_tokens=256,
                       max_total_tokens=max(rows) * max_seq_len + 4096, enable_prefix_caching=False,
                       short_draft_len=short_draft_len)
    prompt = np.random.default_rng(0).integers(1, models.target.vocab_size, 200).tolist()
    began = time.perf_counter()
    costs = slots.warm_up(prompt).to_dict()
    ready = time.perf_counter() - began
    table = []
    for r in rows:
        row = {"rows": r}
        for side in ("", "sampled_"):
            spec, plain = costs[f"{side}spec_step_seconds"][r], costs[f"{side}plain_step_seconds"][r]
            row.update({f"{side}spec_ms": 1e3 * spec, f"{side}plain_ms": 1e3 * plain,
                        f"{side}break_even": spec / plain})
            short = (costs[f"{side}short_step_seconds"] or {}).get(r)
            if short is not None:
                row.update({f"{side}short_ms": 1e3 * short, f"{side}short_break_even": short / plain})
        table.append(row)
    return dict(shape=name, device=str(jax.devices()[0]), jax_version=jax.__version__, max_seq_len=max_seq_len,
                steps_per_chunk=steps_per_chunk, chain=shape.spec(CHAIN).num_steps,
                short_draft_len=slots.short_draft_len, warm_up_seconds=ready,
                rows=table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8,32", help="occupancy buckets, comma-separated")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--steps-per-chunk", type=int, default=4)
    parser.add_argument("--short-draft-len", type=int, default=None,
                        help="the short chain's drafts (default: the server's, a quarter of the chain; 0: none)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    result = measure(args.synthetic, rows, args.max_seq_len, args.steps_per_chunk, args.short_draft_len)
    print(f"{result['shape']} on {result['device']}: ready in {result['warm_up_seconds']:.0f} s; "
          f"EAGLE-3 chain of {result['chain']} (short: {result['short_draft_len']}), context {result['max_seq_len']}")
    print(f"{'rows':>5} {'plain ms':>9} {'spec ms':>8} {'break-even':>10} {'short ms':>9} {'break-even':>10} "
          f"{'sampled plain':>14} {'spec':>7} {'break-even':>10}")
    for row in result["rows"]:
        short = (f"{row['short_ms']:>9.2f} {row['short_break_even']:>10.2f}" if "short_ms" in row
                 else f"{'-':>9} {'-':>10}")
        print(f"{row['rows']:>5} {row['plain_ms']:>9.2f} {row['spec_ms']:>8.2f} {row['break_even']:>10.2f} {short} "
              f"{row['sampled_plain_ms']:>14.2f} {row['sampled_spec_ms']:>7.2f} {row['sampled_break_even']:>10.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
