"""``jspec serve``'s step-program and acceptance counters: scraped from GET /metrics (or a slot engine's registry),
their change over passes, and what that change says (speculative chunk share, acceptance length)."""

from __future__ import annotations


def scrape_counters(base_url: str) -> dict[str, float]:
    """``jspec serve``'s step-program and acceptance counters from GET /metrics ({} from servers without them)."""
    import httpx

    try:
        return parse_counters(httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text)
    except Exception:  # noqa: BLE001 -- another server's metrics, or none: the figures are extras
        return {}


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {"chunks_<program>": chunks run, "sum"/"count": of jspec:acceptance_length}."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "jspec:chunks_total":
                counters[f"chunks_{sample.labels.get('program')}"] = sample.value
            elif sample.name in ("jspec:acceptance_length_sum", "jspec:acceptance_length_count"):
                counters[sample.name.split("_")[-1]] = sample.value
    return counters


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def counter_figures(delta: dict[str, float]) -> dict[str, float | None]:
    """What the counters' change over passes says: the share of chunks that ran a speculative program (the whole
    tree or the short chain), the short chain's share, and the mean tokens committed per verify step of a running
    request."""
    whole, short = delta.get("chunks_speculative", 0.0), delta.get("chunks_speculative_short", 0.0)
    total = whole + short + delta.get("chunks_plain", 0.0)
    return {"speculative_chunk_share": (whole + short) / total if total else None,
            "short_chunk_share": short / total if total else None,
            "acceptance_length": delta["sum"] / delta["count"] if delta.get("count") else None}

