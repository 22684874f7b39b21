"""The table printed at the end: every pass (rich when installed, else plain text), the offline figures and the
checks."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jspec.tools.bench_serve.figures import PassSummary
from jspec.tools.bench_serve.schedule import rate_label


def format_ms(stats: dict, key: str) -> str:
    return "-" if stats.get(key) is None else f"{stats[key]:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _spec_share(counters: dict) -> str:
    """The speculative chunks' share, and the short chain's among them where it ran."""
    short = counters.get("short_chunk_share")
    return _share(counters.get("speculative_chunk_share")) + (f" ({_share(short)} short)" if short else "")


def table_rows(passes: Sequence[PassSummary]) -> tuple[list[str], list[list[str]]]:
    header = ["rate", "server", "ok/n", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
              "TPOT p50", "spec chunks"]
    rows = [[rate_label(p.rate), p.server, f"{p.completed}/{p.num_requests}", f"{p.request_throughput:.2f}",
             f"{p.output_throughput:.1f}", format_ms(p.ttft_ms, "p50"), format_ms(p.ttft_ms, "p90"),
             format_ms(p.ttft_ms, "p99"), format_ms(p.itl_ms, "p50"), format_ms(p.itl_ms, "p90"),
             format_ms(p.itl_ms, "p99"), format_ms(p.tpot_ms, "p50"),
             _spec_share(p.server_counters)]
            for p in passes]
    return header, rows


def print_report(passes: Sequence[PassSummary], offline: dict | None, checks: Sequence[dict]) -> None:
    """A rich table of every pass (plain text when rich is not installed), then the offline figures and checks."""
    header, rows = table_rows(passes)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for line in [header] + rows:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    else:
        table = Table(title="jspec bench-serve (latencies in ms; ITL per token)")
        for h in header:
            table.add_column(h, justify="left" if h in ("rate", "server") else "right", no_wrap=True)
        for p, r in zip(passes, rows):
            table.add_row(*r, style="red" if p.failed else None)
        Console(width=None if sys.stdout.isatty() else 132).print(table)
    if offline is not None:
        for key, figure in offline.items():
            if isinstance(figure, dict):
                print(f"offline {key}: {figure['tokens_per_second']:.1f} tokens/s (median of "
                      f"{len(figure.get('tokens_per_second_runs', [0]))}; acceptance {figure['acceptance_length']:.2f})")
        if "speedup_batch1" in offline:
            print(f"offline speedup at batch 1: {offline['speedup_batch1']:.2f}x (median over rounds)")
    for check in checks:
        print(f"{'HOLDS' if check['holds'] else 'FAILS'}  {check['name']}: {check['measured']} "
              f"(target {check['target']})")

