"""The report of one shape: its JSON (rewritten after every row), the ratios of each row to the floor and to
plain decoding, and the tables printed at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Sequence

import jax

from jspec.tools.roofline.floor import target_weight_bytes, tree_bytes
from jspec.tools.roofline.shapes import HEAD_SHARPEN, METHODS, PLAIN, SPECULATIVE, SyntheticModels


def add_ratios(rows: list[dict], bandwidth: float) -> None:
    """Fills floor_seconds, step_over_floor, spec_over_plain_step, tokens_per_second_over_plain in place."""
    plain = {r["batch"]: r for r in rows if r["method"] == PLAIN and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["floor_seconds"] = r["floor_bytes"]["total"] / bandwidth
        r["step_over_floor"] = r["step_seconds"] / r["floor_seconds"]
        base = plain.get(r["batch"])
        r["spec_over_plain_step"] = None if base is None else r["step_seconds"] / base["step_seconds"]
        r["tokens_per_second_over_plain"] = (None if base is None
                                             else r["tokens_per_second"] / base["tokens_per_second"])


def new_report(models: SyntheticModels, bandwidth: float, copy_runs: list[float], copy_bytes: int,
               batches: Sequence[int], repeats: int, budget_seconds: float) -> dict:
    shape = models.shape
    return {
        "name": models.name, "description": shape.description, "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "dtype": shape.dtype,
        "target_config": models.target.to_json_dict(), "eagle3_config": dataclasses.asdict(models.head),
        "dflash_config": shape.dflash_hf, "head_sharpen": HEAD_SHARPEN,
        "specs": {m: dataclasses.asdict(shape.spec(m)) for m in SPECULATIVE},
        "target_param_bytes": tree_bytes(models.params_t),
        "target_weight_bytes_per_forward": target_weight_bytes(models.target, models.params_t),
        "eagle3_param_bytes": tree_bytes(models.params_d["head"]),
        "dflash_param_bytes": tree_bytes(models.params_f),
        "copy_bandwidth_bytes_per_second": bandwidth, "copy_seconds_per_pass": copy_runs,
        "copy_bytes": copy_bytes, "prompt_len": shape.prompt_len, "sequence_bucket": 2 * shape.prompt_len,
        "steps_per_call": shape.steps, "repeats": repeats, "batches": sorted(set(batches)),
        "budget_seconds": budget_seconds, "elapsed_seconds": 0.0, "complete": False,
        "rows": [], "skipped": [],
    }


def write_json(report: dict, out_dir: str | None) -> str | None:
    """Writes ``synthetic_<name>.json`` atomically (a kill never leaves half a file) -> its path."""
    if out_dir is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"synthetic_{report['name']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


TABLE_COLUMNS = ("batch", "method", "k", "accept", "step ms", "floor ms", "step/floor", "step/plain", "tok/s",
                 "tok/s /plain", "compile s", "status")


def table_rows(report: dict) -> list[tuple[str, ...]]:
    """One tuple of cells per row, sorted by (batch, method, k)."""
    lines = []
    order = sorted(report["rows"], key=lambda r: (r["batch"], METHODS.index(r["method"]), r["force_accept"] or 0))
    for r in order:
        k = "-" if r["force_accept"] is None else str(r["force_accept"])
        if r["status"] != "ok":
            lines.append((str(r["batch"]), r["method"], k) + ("",) * 8 + (r["status"],))
            continue
        lines.append((str(r["batch"]), r["method"], k, f"{r['acceptance_length']:.2f}",
                      f"{1e3 * r['step_seconds']:.2f}", f"{1e3 * r['floor_seconds']:.2f}",
                      f"{r['step_over_floor']:.2f}", _fmt(r["spec_over_plain_step"], ".2f"),
                      f"{r['tokens_per_second']:.0f}", _fmt(r["tokens_per_second_over_plain"], ".2f"),
                      f"{r['compile_seconds']:.1f}", "ok" if r["forced_acceptance_reached"] else "ok*"))
    return lines


def table_title(report: dict) -> str:
    return (f"{report['name']} on {report['device']} ({report['platform']}): copy bandwidth "
            f"{report['copy_bandwidth_bytes_per_second'] / 1e9:.0f} GB/s, prompt {report['prompt_len']}, "
            f"{report['elapsed_seconds']:.0f} s, {len(report['skipped'])} skipped")


def format_table(report: dict) -> str:
    """Plain-text table of a report (ok* = acceptance differed from the forced k + 1)."""
    rows = [TABLE_COLUMNS] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = [table_title(report)]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if n == 0:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


def print_table(report: dict) -> None:
    """A rich table on a terminal (when rich is installed), else the plain-text one (logs keep every digit)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is None or not sys.stdout.isatty():
        print(format_table(report), flush=True)
        return
    table = Table(title=table_title(report))
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in table_rows(report):
        table.add_row(*row)
    Console().print(table)


def print_progress(model: str, row: dict) -> None:
    what = f"{model} batch {row['batch']} {row['method']} k={row['force_accept']}"
    if row["status"] != "ok":
        print(f"{what}: {row['status']} {row['error'][:200]}", flush=True)
        return
    print(f"{what}: step {1e3 * row['step_seconds']:.2f} ms ({row['step_over_floor']:.2f}x floor), accept "
          f"{row['acceptance_length']:.2f}, compile {row['compile_seconds']:.1f} s, wall {row['wall_seconds']:.1f} s",
          flush=True)
