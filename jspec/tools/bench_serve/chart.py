"""The PNG chart (``--chart``): output tokens/s, TTFT and ITL by rate, spec against plain."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jspec.tools.bench_serve.figures import PassSummary
from jspec.tools.bench_serve.schedule import rate_label


def write_chart(passes: Sequence[PassSummary], offline: dict | None, batch_size: int, path: str) -> bool:
    """Output tokens/s, TTFT and ITL (p50 solid, p99 dashed) by rate, one colour per server (its ``-direct`` rows
    dash-dotted, p50 only); the offline ``generate`` figures: batch 1 as crosses at "seq", batch ``batch_size``
    as dotted lines. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(dict.fromkeys(rate_label(p.rate) for p in passes))
    servers = list(dict.fromkeys(p.server for p in passes))
    bases = list(dict.fromkeys(s.removesuffix("-direct") for s in servers))
    color = {s: f"C{bases.index(s.removesuffix('-direct'))}" for s in servers}
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    def series(server: str, figure) -> list[float]:
        mine = {rate_label(p.rate): p for p in passes if p.server == server}
        values = [figure(mine[label]) if label in mine else None for label in labels]
        return [np.nan if v is None else v for v in values]

    for server in servers:
        direct = server.endswith("-direct")
        line = {"color": color[server], "alpha": 0.55 if direct else 1.0, "lw": 1.0 if direct else 1.8}
        axes[0].plot(x, series(server, lambda p: p.output_throughput), "^-." if direct else "o-", label=server,
                     **line)
        for ax, field in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            for q, style in (("p50", "^-." if direct else "o-"), ("p99", None if direct else "s--")):
                if style is not None:
                    ax.plot(x, series(server, lambda p, f=field, q=q: getattr(p, f)[q]), style,
                            label=f"{server} {q}", **{**line, "alpha": line["alpha"] * (1.0 if q == "p50" else 0.6)})
    if offline is not None:
        for server in ("spec", "plain"):
            if server not in color:
                continue
            key = f"{server}_batch{batch_size}"
            if key in offline:
                axes[0].axhline(offline[key]["tokens_per_second"], color=color[server], ls=":",
                                label=f"offline {server} generate, batch {batch_size}")
            if f"{server}_batch1" in offline and "seq" in labels:
                axes[0].plot([labels.index("seq")], [offline[f"{server}_batch1"]["tokens_per_second"]], "x",
                             color=color[server], ms=9, mew=2, label=f"offline {server} generate, batch 1")
    titles = ("output tokens/s (at a rate r: at most r x tokens per request)", "time to first token (ms)",
              "inter-token latency per token (ms)")
    for ax, title in zip(axes, titles):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s; seq: one at a time, inf: all at once)")
        ax.set_title(title, fontsize=10)
        values = np.concatenate([np.asarray(line.get_ydata(), np.float64) for line in ax.get_lines()])
        finite = values[np.isfinite(values)]
        ax.set_ylim(0, 1.6 * (finite.max() if finite.size else 1.0))  # the legend's room above the data
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

