"""Roofline benchmark on random weights of real model shapes: decode step time against the memory floor.

    python -m jspec.tools.roofline --synthetic llama3-8b,llama3-1b --out DIR [--budget-seconds 480]
    python -m jspec.tools.roofline --synthetic tiny --synthetic-batches 1      # CPU smoke run

The run: build every requested shape's random models, measure the copy bandwidth once, then time the planned
configurations in priority order within one budget. ``synthetic_<name>.json`` is rewritten after every row, so a
killed run leaves its results.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
from typing import Iterator, Sequence

from jspec.tools.roofline.floor import default_copy_bytes, measure_copy_bandwidth
from jspec.tools.roofline.plan import Budget, plan_rows
from jspec.tools.roofline.report import add_ratios, new_report, print_progress, print_table, write_json
from jspec.tools.roofline.shapes import METHODS, SHAPES, build_models
from jspec.tools.roofline.timing import measure_row

DEFAULT_BUDGET_SECONDS = 480.0


@contextlib.contextmanager
def _quiet_engine_warnings() -> Iterator[None]:
    """Every forced-acceptance engine warns that its output is not the target's; once is enough here."""
    logger = logging.getLogger("jspec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_synthetic_models(names: Sequence[str], out_dir: str | None = None,
                         budget_seconds: float = DEFAULT_BUDGET_SECONDS, batches: Sequence[int] = (1, 8, 32),
                         force_accepts: Sequence[int] | None = None, repeats: int = 3, seed: int = 0,
                         copy_bytes: int | None = None, show: bool = True,
                         methods: Sequence[str] = METHODS, mesh=None) -> dict[str, dict]:
    """Benchmarks several shapes under one budget, interleaved by priority -> {name: report}.

    mesh: run every engine through this ("data", "model") mesh (``jspec.sharding.make_mesh``; 1 x 1 checks that
    the mesh code path costs nothing on one device); floors stay the single-device ones.

    force_accepts: the k to time for each tree (None: 0..max_depth of each); copy_bytes: size of the
    bandwidth probe's array (None: 1 GiB on an accelerator, 16 MiB on CPU); methods: a subset of ``METHODS``
    (ratios to plain decoding need "plain").
    """
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"synthetic shapes {list(names)!r}: expected names from {sorted(SHAPES)}")
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"methods={methods!r}: expected a non-empty subset of {METHODS}")
    budget = Budget(budget_seconds)
    copy_bytes = copy_bytes or default_copy_bytes()
    bandwidth, copy_runs = measure_copy_bandwidth(copy_bytes)
    models = [build_models(name, seed) for name in names]
    reports = {m.name: new_report(m, bandwidth, copy_runs, copy_bytes, batches, repeats, budget_seconds)
               for m in models}
    for report in reports.values():
        report["mesh"] = None if mesh is None else {axis: int(size) for axis, size in mesh.shape.items()}
    by_name = {m.name: m for m in models}
    with _quiet_engine_warnings():
        for plan in plan_rows(models, batches, force_accepts, methods):
            report = reports[plan.model]
            reason = budget.skip_reason(plan)
            if reason is not None:
                report["skipped"].append({**plan.key(), "reason": reason})
            else:
                row = measure_row(by_name[plan.model], plan, repeats, seed, mesh)
                budget.record(plan, row)
                report["rows"].append(row)
                add_ratios(report["rows"], bandwidth)
                if show:
                    print_progress(plan.model, row)
            report["elapsed_seconds"] = budget.elapsed
            write_json(report, out_dir)
    for report in reports.values():
        report["complete"] = True
        report["elapsed_seconds"] = budget.elapsed
        write_json(report, out_dir)
        if show:
            print_table(report)
    return reports


def run_synthetic(name: str, out_dir: str | None = None, budget_seconds: float = DEFAULT_BUDGET_SECONDS,
                  batches: Sequence[int] = (1, 8, 32), force_accepts: Sequence[int] | None = None,
                  repeats: int = 3, seed: int = 0, copy_bytes: int | None = None, show: bool = True,
                  methods: Sequence[str] = METHODS, mesh=None) -> dict:
    """Benchmarks one shape (``SHAPES``) -> its report, also written to ``out_dir/synthetic_<name>.json``."""
    return run_synthetic_models([name], out_dir, budget_seconds, batches, force_accepts, repeats, seed,
                                copy_bytes, show, methods, mesh)[name]


# --- command line --------------------------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    """The synthetic benchmark's options (names chosen not to clash with scripts/benchmark.py's)."""
    parser.add_argument("--synthetic", metavar="NAME[,NAME]",
                        help=f"random-weight roofline benchmark of these shapes: {', '.join(SHAPES)}")
    parser.add_argument("--out", help="directory for synthetic_<name>.json (rewritten after every row)")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS,
                        help="no new configuration starts once this would be exceeded (all shapes together)")
    parser.add_argument("--synthetic-batches", type=_int_list, default=(1, 8, 32), metavar="B[,B]")
    parser.add_argument("--synthetic-force-accepts", type=_int_list, default=None, metavar="K[,K]",
                        help="forced acceptances to time (default: 0..depth of each tree)")
    parser.add_argument("--synthetic-repeats", type=int, default=3)
    parser.add_argument("--synthetic-mesh", default=None, metavar="DPxTP",
                        help="run through a (data, model) device mesh, e.g. 1x1 (the mesh code path on one device) "
                             "or 1x8; default: no mesh")


def _mesh(text: str | None):
    """--synthetic-mesh "DPxTP" -> a jspec.sharding mesh (None without the flag)."""
    if text is None:
        return None
    from jspec.sharding import make_mesh

    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if match is None:
        raise ValueError(f"--synthetic-mesh {text!r}: expected DPxTP, e.g. 1x8")
    return make_mesh(tensor_parallel_size=int(match.group(2)), data_parallel_size=int(match.group(1)))


def run_from_args(args: argparse.Namespace) -> dict[str, dict]:
    names = [n.strip() for n in args.synthetic.split(",") if n.strip()]
    return run_synthetic_models(names, args.out, args.budget_seconds, args.synthetic_batches,
                                args.synthetic_force_accepts, args.synthetic_repeats,
                                mesh=_mesh(args.synthetic_mesh))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_synthetic_arguments(parser)
    args = parser.parse_args(argv)
    if not args.synthetic:
        parser.error(f"give --synthetic NAME[,NAME] ({', '.join(SHAPES)})")
    run_from_args(args)
    return 0
