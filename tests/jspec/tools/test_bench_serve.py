"""jspec bench-serve (jspec/tools/bench_serve/): the Poisson schedule, the percentile and per-token latency
arithmetic on known inputs, the SSE client against a scripted server, and one small run against real
in-process servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from jspec.tools import bench_serve as bs
from jspec.tools.bench_serve import run as bs_run  # where main looks up load_engines
from jspec.tools.bench_serve.counters import counter_delta, counter_figures, parse_counters
from jspec.tools.bench_serve.report import table_rows

# --- the schedule -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.5, 2.0, 10.0])
def test_poisson_gaps_have_mean_one_over_rate(rate):
    offsets = bs.poisson_offsets(4000, rate, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    # the mean of 3999 exponential gaps: standard error 1/rate/sqrt(3999) ~ 1.6% of the mean; 5% is > 3 sigma
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.05)
    assert gaps.std() == pytest.approx(1.0 / rate, rel=0.08)  # exponential: std = mean


def test_poisson_schedule_is_seeded():
    a, b = bs.poisson_offsets(50, 1.0, seed=7), bs.poisson_offsets(50, 1.0, seed=7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, bs.poisson_offsets(50, 1.0, seed=8))


def test_infinite_rate_sends_everything_at_once():
    np.testing.assert_array_equal(bs.poisson_offsets(9, math.inf, seed=0), np.zeros(9))
    np.testing.assert_array_equal(bs.poisson_offsets(1, 3.0, seed=0), [0.0])


@pytest.mark.parametrize("text, rates", [("1", [1.0]), ("0.5, 2,inf", [0.5, 2.0, math.inf]), ("inf,", [math.inf])])
def test_parse_rates(text, rates):
    assert bs.parse_rates(text) == rates


@pytest.mark.parametrize("text, message", [("", "expected"), ("1,x", "'x' is not a number"), ("0", "not > 0"),
                                           ("-1", "not > 0"), ("nan", "not > 0")])
def test_bad_rates_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        bs.parse_rates(text)


@pytest.mark.parametrize("flags, message", [
    (["--request-rates", "fast"], "not a number"),
    (["--num-prompts", "0"], "--num-prompts 0"),
    (["--max-tokens", "64", "--max-seq-len", "64"], "no room"),
])
def test_bad_arguments_are_refused_before_any_model_loads(flags, message, monkeypatch):
    monkeypatch.setattr(bs_run, "load_engines", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=message):
        bs.main(flags)


# --- figures ----------------------------------------------------------------------------------------------------

def test_summary_percentiles_on_known_values():
    stats = bs.summarize(list(range(1, 101)))  # 1..100; numpy's linear interpolation: p = 1 + 0.99 q
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert bs.summarize([0.002, 0.004], scale=1e3) == pytest.approx({"mean": 3.0, "p50": 3.0, "p90": 3.8,
                                                                     "p99": 3.98})
    assert bs.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_inter_token_latency_is_per_token_from_the_servers_counts():
    # chunks at 0.1 s (2 tokens: the first, TTFT), 0.3 s (4 tokens), 0.4 s (1 token)
    r = bs.RequestResult(0, ttft=0.1, latency=0.45, output_tokens=7, chunk_times=[0.1, 0.3, 0.4],
                         chunk_texts=["ab", "cdef", "g"], chunk_token_counts=[2, 4, 1])
    assert bs.inter_token_latencies(r) == pytest.approx([0.05] * 4 + [0.1])
    assert bs.time_per_output_token(r) == pytest.approx((0.45 - 0.1) / 6)


def test_inter_token_latency_shares_usage_tokens_by_text_without_counts():
    # 8 tokens, texts of 2, 4 and 2 characters -> 2, 4 and 2 tokens
    r = bs.RequestResult(0, ttft=0.1, latency=0.5, output_tokens=8, chunk_times=[0.1, 0.5, 0.7],
                         chunk_texts=["ab", "cdef", "gh"])
    assert bs.tokens_per_chunk(r) == pytest.approx([2.0, 4.0, 2.0])
    assert bs.inter_token_latencies(r) == pytest.approx([0.1] * 4 + [0.1] * 2)


def test_pass_summary_counts_only_completed_requests():
    ok = [bs.RequestResult(i, ttft=0.1 * (i + 1), latency=1.0, output_tokens=10, chunk_times=[0.1 * (i + 1), 1.0],
                           chunk_texts=["a", "b"], chunk_token_counts=[1, 9]) for i in range(3)]
    failed = bs.RequestResult(3, error="HTTP 503: busy")
    summary = bs.summarize_pass("spec", 2.0, ok + [failed], duration=2.0)
    assert (summary.completed, summary.failed, summary.output_tokens) == (3, 1, 30)
    assert summary.output_throughput == pytest.approx(15.0)
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.ttft_ms["p50"] == pytest.approx(200.0)
    assert summary.errors == ["HTTP 503: busy"]


def _pass(server, rate, tps):
    return bs.PassSummary(server, rate, 4, 4, 0, 1.0, 4.0, int(tps), tps, {}, {}, {}, {}, "usage", [])


def test_criteria_of_one_round():
    passes = [_pass("spec", bs.SEQUENTIAL, 190.0), _pass("plain", bs.SEQUENTIAL, 100.0),
              _pass("spec", math.inf, 500.0), _pass("plain", math.inf, 600.0)]
    offline = {"spec_batch1": {"tokens_per_second": 400.0}, "plain_batch1": {"tokens_per_second": 200.0},
               "spec_batch4": {"tokens_per_second": 600.0}}
    checks = {c["name"][:3]: c for c in bs.criteria(passes, offline, batch_size=4)}
    assert checks["(a)"]["ratio"] == pytest.approx(1.9 / 2.0)
    assert checks["(b)"]["ratio"] == pytest.approx(500 / 600)
    assert checks["(c)"]["per_rate"] == pytest.approx({"seq": 1.9, "inf": 500 / 600})
    assert checks["(c)"]["ratio"] == pytest.approx(500 / 600)
    assert [c["name"][:3] for c in bs.criteria(passes, None, 4)] == ["(c)"]  # no offline figures


def test_checks_take_the_median_over_rounds():
    def round_(a, b, seq, inf):
        return [{"name": "(a)", "ratio": a, "low": 0.9, "high": 1.1, "detail": ""},
                {"name": "(b)", "ratio": b, "low": 0.8, "high": None, "detail": ""},
                {"name": "(c)", "ratio": min(seq, inf), "low": 0.95, "high": None, "detail": "",
                 "per_rate": {"seq": seq, "inf": inf}}]

    checks = {c["name"]: c for c in bs.combine_checks([round_(0.5, 0.7, 1.2, 0.9), round_(1.0, 0.9, 1.3, 1.0),
                                                       round_(1.05, 0.85, 0.8, 1.1)])}
    assert checks["(a)"]["ratio"] == 1.0 and checks["(a)"]["holds"] and checks["(a)"]["ratios"] == [0.5, 1.0, 1.05]
    assert checks["(b)"]["ratio"] == 0.85 and checks["(b)"]["holds"] and checks["(b)"]["target"] == ">= 0.80"
    # (c): per rate medians 1.2 and 1.0, then the worst of them (not the median of each round's worst, 0.9)
    assert checks["(c)"]["per_rate"] == {"seq": 1.2, "inf": 1.0} and checks["(c)"]["ratio"] == 1.0
    assert checks["(c)"]["holds"]
    assert not bs.combine_checks([round_(1.2, 0.7, 1, 1)])[0]["holds"]  # (a) above 1.10 fails too


def test_offline_rounds_take_the_median():
    rounds = [{"spec_batch1": {"tokens_per_second": t, "acceptance_length": 2.0},
               "plain_batch1": {"tokens_per_second": 100.0, "acceptance_length": 1.0}} for t in (300.0, 150.0, 200.0)]
    merged = bs.median_offline(rounds)
    assert merged["spec_batch1"]["tokens_per_second"] == 200.0
    assert merged["spec_batch1"]["tokens_per_second_runs"] == [150.0, 200.0, 300.0]
    assert merged["speedup_batch1"] == 2.0  # the median of the rounds' own speedups


def test_report_table_and_chart(tmp_path, capsys):
    stats = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    passes = [bs.PassSummary(s, r, 4, 4, 0, 1.0, 4.0, 100, t, stats, stats, stats, stats, "token_ids", [])
              for s, r, t in (("spec", bs.SEQUENTIAL, 200.0), ("plain", bs.SEQUENTIAL, 100.0),
                              ("spec", math.inf, 300.0), ("plain", math.inf, 250.0))]
    offline = {"spec_batch1": {"tokens_per_second": 190.0, "acceptance_length": 3.0},
               "plain_batch1": {"tokens_per_second": 100.0, "acceptance_length": 1.0},
               "spec_batch4": {"tokens_per_second": 310.0, "acceptance_length": 3.0},
               "plain_batch4": {"tokens_per_second": 260.0, "acceptance_length": 1.0}, "speedup_batch1": 1.9}
    path = tmp_path / "chart.png"
    assert bs.write_chart(passes, offline, 4, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bs.print_report(passes, offline, bs.combine_checks([bs.criteria(passes, offline, 4)]))
    out = capsys.readouterr().out
    assert "seq" in out and "inf" in out and "300.0" in out and "HOLDS" in out


def test_counters_count_the_short_chain_as_speculative():
    text = ('jspec:chunks_total{program="speculative"} 3.0\n'
            'jspec:chunks_total{program="speculative_short"} 5.0\n'
            'jspec:chunks_total{program="plain"} 2.0\n'
            'jspec:acceptance_length_sum 20.0\njspec:acceptance_length_count 10.0\n')
    figures = counter_figures(counter_delta({}, parse_counters(text)))
    assert figures == {"speculative_chunk_share": 0.8, "short_chunk_share": 0.5, "acceptance_length": 2.0}
    stats = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    spec = bs.PassSummary("spec", math.inf, 4, 4, 0, 1.0, 4.0, 100, 100.0, stats, stats, stats, stats, "token_ids",
                          [], server_counters=figures)
    assert table_rows([spec])[1][0][-1] == "80% (50% short)"


# --- the client against a scripted SSE server -------------------------------------------------------------------

def scripted_app():
    """A /v1/completions that streams 'a', 'bc', 'def' (1, 2, 3 token ids), 50 ms apart, then usage and [DONE];
    /v1/models lists 'fake'."""
    import fastapi
    from fastapi.responses import StreamingResponse

    app = fastapi.FastAPI()
    seen = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        seen.append(body)

        async def events():
            for text in ("a", "bc", "def"):
                await asyncio.sleep(0.05)
                choice = {"index": 0, "text": text, "finish_reason": None, "token_ids": list(range(len(text)))}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 6}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


def test_client_times_chunks_and_counts_tokens_from_a_scripted_server():
    app, seen = scripted_app()
    with bs.uvicorn_thread(app, "127.0.0.1", bs.free_port()) as url:
        assert bs.served_model(url) == "fake"
        results, duration = asyncio.run(bs.run_pass(url, "fake", ["x", [1, 2]], 6, math.inf, seed=5))
    seen.sort(key=lambda body: body["seed"])  # both were sent at once
    assert [b["seed"] for b in seen] == [5, 6] and seen[1]["prompt"] == [1, 2]
    assert seen[0]["stream"] and seen[0]["stream_options"] == {"include_usage": True} and seen[0]["return_token_ids"]
    for r in results:
        assert r.ok and r.output_tokens == 6 and r.tokens_from == "usage" and r.finish_reason == "length"
        assert r.chunk_token_counts == [1, 2, 3] and r.chunk_texts == ["a", "bc", "def"]
        assert 0.04 < r.ttft < r.chunk_times[-1] <= r.latency < duration
        assert len(bs.inter_token_latencies(r)) == 5  # the 2 + 3 tokens after the first chunk


def test_failed_requests_are_recorded_not_raised():
    with bs.uvicorn_thread(scripted_app()[0], "127.0.0.1", bs.free_port()) as url:
        results, _ = asyncio.run(bs.run_pass(url + "/nowhere", "fake", ["x"], 4, bs.SEQUENTIAL, seed=0))
    assert not results[0].ok and results[0].error.startswith("HTTP 404")


# --- end to end -------------------------------------------------------------------------------------------------

# slow: bench-serve end to end against real servers; default tier: its arithmetic and report tests
@pytest.mark.slow
def test_small_run_against_real_in_process_servers(tmp_path):
    """The bundled model behind both in-process servers (spec: jspec serve's default drafter; plain), over HTTP
    and straight to their slot engines (--direct), 4 HumanEval prompts cut to fit max_seq_len 128, 8 tokens,
    sequential and all at once, 2 rounds; no offline reference (its compiles would double the time)."""
    out = tmp_path / "serve.json"
    assert bs.main(["--num-prompts", "4", "--max-tokens", "8", "--max-seq-len", "128", "--max-batch-size", "2",
                    "--request-rates", "inf", "--no-offline", "--direct", "--repeats", "2", "--json", str(out),
                    "--json-requests"]) == 0
    report = json.loads(out.read_text())
    passes = {(p["server"], p["rate"]): p for p in report["passes"]}
    assert set(passes) == {(s, r) for s in ("spec", "plain", "spec-direct", "plain-direct") for r in ("seq", "inf")}
    assert report["prompts_cut"] == 3  # HumanEval's first 4 prompts: 140, 166, 105 and 148 tokens > 120
    for p in passes.values():
        assert p["completed"] == 8 and p["failed"] == 0 and p["output_throughput"] > 0  # 2 rounds pooled
        assert 8 <= p["output_tokens"] <= 64 and p["tokens_from"] == ("token_ids" if "direct" in p["server"] else
                                                                          "usage")
        assert p["ttft_ms"]["p50"] > 0 and p["itl_ms"]["p50"] is not None
    # greedy: both servers return the same tokens for every prompt, whatever the load
    texts = {(r["server"], r["rate"]): [q["text_sha1"] for q in r["results"]] for r in report["requests"]}
    assert texts[("spec", "inf")] == texts[("plain", "inf")] == texts[("plain", "seq")]
    tokens = {(p["server"], p["rate"]): p["output_tokens"] for p in report["passes"]}
    assert tokens[("spec-direct", "inf")] == tokens[("plain-direct", "seq")] == tokens[("spec", "inf")]
    assert report["cost_tables"]["spec"] and report["cost_tables"]["plain"] is None  # only a drafter adapts


def test_cli_forwards_every_argument(monkeypatch):
    from jspec.tools.cli import main

    seen = []
    monkeypatch.setattr(bs, "main", lambda argv: seen.append(argv) or 3)
    assert main(["bench-serve", "--request-rates", "1,inf", "--max-tokens", "9", "--debug"]) == 3
    assert seen == [["--request-rates", "1,inf", "--max-tokens", "9"]]


def test_base_url_benchmarks_one_running_server(tmp_path, monkeypatch):
    """--base-url: one column, text prompts, the model named by GET /v1/models; nothing loads."""
    monkeypatch.setattr(bs_run, "load_engines", lambda *a: pytest.fail("a model was loaded"))
    app, seen = scripted_app()
    out = tmp_path / "serve.json"
    with bs.uvicorn_thread(app, "127.0.0.1", bs.free_port()) as url:
        assert bs.main(["--base-url", url, "--num-prompts", "3", "--max-tokens", "6", "--request-rates", "50,inf",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(p["server"], p["rate"]) for p in report["passes"]] == [("server", "seq"), ("server", "50"),
                                                                    ("server", "inf")]
    assert all(p["completed"] == 3 and p["output_tokens"] == 18 for p in report["passes"])
    assert report["offline"] is None and [c["name"][:3] for c in report["criteria"]] == []
    assert all(isinstance(b["prompt"], str) and b["model"] == "fake" for b in seen)
