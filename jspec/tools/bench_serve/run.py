"""``jspec bench-serve``: the OpenAI-compatible server under load, speculative vs plain, in one run (like vLLM's
``benchmark_serving.py``)::

    jspec bench-serve                                         # launches both servers itself, 32 HumanEval prompts
    jspec bench-serve --num-prompts 16 --max-tokens 64 --request-rates 1,inf --max-batch-size 4 \\
        --json serve.json --chart serve.png
    jspec bench-serve --base-url http://127.0.0.1:8000        # a server already running (one column; vLLM too)

Load: ``--num-prompts`` HumanEval prompts sent to POST /v1/completions (``stream: true``, greedy, ``stream_options:
{"include_usage": true}``) with Poisson arrivals at each of ``--request-rates`` requests/s (exponential
inter-arrival times drawn from ``--seed``; ``inf`` sends them all at once: saturation), plus, first, a sequential
pass (one request after another; ``--no-sequential`` skips it). Per server and rate: request throughput, output
tokens/s (tokens of completed requests / wall time of the pass, first send to last byte), time to first token
(TTFT: send to the first chunk carrying text), inter-token latency (ITL, per token: the gap between two successive
chunks that carry text divided by the tokens in the later one, one sample per token, as ``jspec serve``'s
``jspec_inter_token_latency_seconds`` histogram counts it; tokens per chunk are the server's ``token_ids`` or
``logprobs.tokens`` when it sends them, otherwise the request's ``usage.completion_tokens`` shared among its chunks
in proportion to their text) and time per output token (TPOT: (latency - TTFT) / (tokens - 1), per request), each
as p50/p90/p99. Output tokens are what the server reports it produced (``usage``): the servers stop at EOS, so a
request may return fewer than ``--max-tokens`` (``--ignore-eos`` asks servers that offer it, like vLLM, not to).

Without ``--base-url`` two servers run in this process on 127.0.0.1 (uvicorn in a thread each, one
:class:`jspec.serve.slots.SlotEngine` each, sharing one copy of the weights): ``spec``, the configuration ``jspec
serve`` uses by default (``jspec.tools.bundled.default_method``: the n-gram chain on a CPU), and ``plain``, the same
model with no drafter. Each pass runs on one server while the other idles; the two servers take turns at each rate,
so drift on a shared machine hits both alike. Token ids are sent as the prompt, so the servers and the offline
reference see the same tokens (prompts longer than ``--max-seq-len - --max-tokens`` keep their last tokens).

The offline reference, in the same run on the same engines and prompts (``SpecEngine.generate``, greedy, the
same EOS), timed in every round beside the passes it is compared with (batch 1 at the start of the round, batch
``--max-batch-size`` just before the saturated passes): (a) the speedup of speculative over plain at batch 1, against the servers' speedup in the sequential
pass (criterion: within 10%); (b) speculative ``generate`` tokens/s at batch ``--max-batch-size`` against the
speculative server's at saturation (criterion: >= 0.8x); and (c) the speculative server against the plain one at
every rate (load adaptation should never lose to plain decoding by more than noise; criterion: >= 0.95x).
``--repeats R`` runs R rounds: the table pools their requests; each check is the median of its per-round ratios
(for (c), per rate, then the worst rate).
``--direct`` adds rows ``spec-direct`` and ``plain-direct``: the same passes submitted straight to each server's
slot engine from this process (no HTTP, no detokenizing), which splits the gap to the offline figures between the
scheduler and the HTTP layer. ``--json`` writes every figure (``--json-requests``: and each request's chunk
timings), ``--chart`` a PNG: throughput, TTFT and ITL by rate.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jspec.tools.bench import environment
from jspec.tools.bench_serve.chart import write_chart
from jspec.tools.bench_serve.client import served_model
from jspec.tools.bench_serve.counters import counter_delta, counter_figures
from jspec.tools.bench_serve.criteria import combine_checks, criteria
from jspec.tools.bench_serve.figures import RequestResult, request_record, summarize_pass
from jspec.tools.bench_serve.offline import OfflineReference, median_offline
from jspec.tools.bench_serve.report import format_ms, print_report
from jspec.tools.bench_serve.schedule import SEQUENTIAL, parse_rates, rate_label
from jspec.tools.bench_serve.servers import Target, http_target, launch_servers, load_engines


def run_rounds(targets: dict[str, Target], prompts: Sequence, rates: Sequence[float | str],
               args: argparse.Namespace, reference: OfflineReference | None, report: dict) -> tuple:
    """``args.repeats`` rounds of every pass on every target, the offline reference timed in each round (batch 1
    first, batch max_batch_size just before the saturated passes) -> (requests, seconds and counter changes per
    (server, rate), pooled over rounds; offline figures per round; checks per round). Each pass's requests go to
    ``report["requests"]`` (with --json-requests)."""
    results: dict[tuple, list[RequestResult]] = {}
    seconds: dict[tuple, float] = {}
    deltas: dict[tuple, dict[str, float]] = {}
    offline_rounds: list[dict] = []
    round_checks = []
    for target in targets.values():  # the first request of a server pays for what warm-up left (HTTP, threads)
        target.run(prompts[:1], 4, SEQUENTIAL, args.seed)
    for round_index in range(args.repeats):
        offline_round: dict[str, dict] = {} if reference is None else reference.time(1)
        round_passes = []
        for n, rate in enumerate(rates):
            if reference is not None and rate == math.inf:  # timed beside the saturated passes
                offline_round.update(reference.time(args.max_batch_size))
            for server, target in targets.items():
                before = target.counters()
                got, duration = target.run(prompts, args.max_tokens, rate, args.seed + 1000 * n)
                key = (server, rate)
                delta = counter_delta(before, target.counters())
                results.setdefault(key, []).extend(got)
                seconds[key] = seconds.get(key, 0.0) + duration
                deltas[key] = {k: deltas.get(key, {}).get(k, 0.0) + v for k, v in delta.items()}
                summary = summarize_pass(server, rate, got, duration)
                round_passes.append(summary)
                if args.json_requests:
                    report["requests"].append({"server": server, "rate": rate_label(rate), "round": round_index,
                                               "duration_s": duration, "results": [request_record(r) for r in got]})
                print(f"[bench-serve] round {round_index + 1}/{args.repeats} {server} rate {rate_label(rate)}: "
                      f"{summary.completed}/{summary.num_requests} ok, {summary.output_throughput:.1f} tokens/s, "
                      f"TTFT p50 {format_ms(summary.ttft_ms, 'p50')} ms, "
                      f"ITL p50 {format_ms(summary.itl_ms, 'p50')} ms",
                      flush=True)
        if reference is not None and f"spec_batch{args.max_batch_size}" not in offline_round:
            offline_round.update(reference.time(args.max_batch_size))
        offline_rounds.append(offline_round)
        round_checks.append(criteria(round_passes, offline_round or None, args.max_batch_size))
    return results, seconds, deltas, offline_rounds, round_checks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec bench-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("servers")
    target.add_argument("--base-url", default=None,
                        help="benchmark a server already running there (one column, no offline reference); by "
                             "default two servers (spec, plain) are launched in this process")
    target.add_argument("--model-name", default=None,
                        help="the 'model' field sent (default: the first id of GET /v1/models)")
    target.add_argument("--model", default=None, help="converted target directory (default: the bundled code model)")
    target.add_argument("--drafter", default=None,
                        help="the speculative server's drafter (default: what `jspec serve` runs on this backend, "
                             "jspec.tools.bundled.default_method: 'ngram' chain of 9 on a CPU)")
    target.add_argument("--max-batch-size", type=int, default=8, help="slots per server (and the offline batch)")
    target.add_argument("--max-seq-len", type=int, default=1024, help="prompt + new tokens per request")
    target.add_argument("--steps-per-chunk", type=int, default=4, help="the slot engine's steps per chunk")
    target.add_argument("--no-adapt", action="store_true", help="the spec server never falls back to plain steps")
    target.add_argument("--short-draft-len", type=int, default=None,
                        help="the spec server's short chain (`jspec serve --short-draft-len`; 0: none)")
    target.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="both servers dispatch a chunk before reading the one before back (`jspec serve "
                             "--async-scheduling`; default: on a GPU or TPU, off on a CPU)")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=32, help="the first N HumanEval prompts, per pass")
    load.add_argument("--max-tokens", type=int, default=128, help="new tokens per request at most")
    load.add_argument("--request-rates", default="0.5,1,2,inf",
                      help="Poisson arrival rates in requests/s, comma-separated; inf: all at once")
    load.add_argument("--no-sequential", action="store_true", help="skip the pass of one request after another")
    load.add_argument("--repeats", type=int, default=1,
                      help="rounds of every pass (and of the offline reference beside them); the table pools the "
                           "rounds' requests, each check takes the median of its per-round ratios")
    load.add_argument("--seed", type=int, default=0, help="arrival times; request i gets seed + i")
    load.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos (vLLM's extension; jspec serve has none and stops at EOS)")
    load.add_argument("--no-token-ids", action="store_true",
                      help="do not send return_token_ids (ITL then shares tokens among chunks by text length)")
    load.add_argument("--no-offline", action="store_true", help="skip the offline generate reference")
    load.add_argument("--direct", action="store_true",
                      help="also run every pass straight against each launched server's slot engine (no HTTP): "
                           "rows spec-direct, plain-direct")
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, help="write every figure here")
    out.add_argument("--json-requests", action="store_true",
                     help="--json also holds every request's chunk timings (hundreds of kB)")
    out.add_argument("--chart", default=None, help="write a PNG chart here (throughput, TTFT, ITL by rate)")
    return parser


def check_args(args: argparse.Namespace) -> list[float | str]:
    """Validates before anything loads -> the passes' rates (SEQUENTIAL first unless --no-sequential)."""
    for flag in ("num_prompts", "max_tokens", "max_batch_size", "steps_per_chunk", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if args.max_seq_len <= args.max_tokens:
        raise ValueError(f"--max-seq-len {args.max_seq_len} leaves no room for a prompt beside --max-tokens "
                         f"{args.max_tokens}")
    rates = parse_rates(args.request_rates)
    return ([] if args.no_sequential else [SEQUENTIAL]) + rates


def load_prompts(num_prompts: int) -> list[str]:
    from jspec.train.corpus import human_eval_prompts

    problems = human_eval_prompts()
    if num_prompts > len(problems):
        raise ValueError(f"--num-prompts {num_prompts}: HumanEval has {len(problems)} prompts")
    return [p["prompt"] for p in problems[:num_prompts]]


def fit_prompts(ids: Sequence[list[int]], max_seq_len: int, max_tokens: int) -> tuple[list[list[int]], int]:
    """Keeps each prompt's last max_seq_len - max_tokens tokens -> (prompts, how many were cut)."""
    room = max_seq_len - max_tokens
    return [list(p[-room:]) for p in ids], sum(len(p) > room for p in ids)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    rates = check_args(args)
    texts = load_prompts(args.num_prompts)
    report: dict[str, Any] = {"environment": environment(), "args": vars(args), "passes": [], "requests": [],
                              "cost_tables": {}}
    if args.base_url is not None:
        model_name = args.model_name or served_model(args.base_url)
        target = http_target(args.base_url, model_name, ignore_eos=args.ignore_eos, token_ids=not args.no_token_ids)
        prompts: list = texts
        reference = None
        servers = contextlib.nullcontext({"server": target})
    else:
        spec_engine, plain_engine, config = load_engines(args)
        report["servers"] = config
        prompts, cut = fit_prompts(spec_engine.encode(texts), args.max_seq_len, args.max_tokens)
        report["prompts_cut"] = cut
        reference = None if args.no_offline else OfflineReference({"spec": spec_engine, "plain": plain_engine},
                                                                   prompts, args.max_tokens, args.max_batch_size)
        servers = launch_servers({"spec": spec_engine, "plain": plain_engine}, args, costs=report["cost_tables"])
    with servers as targets:
        results, seconds, deltas, offline_rounds, round_checks = run_rounds(targets, prompts, rates, args,
                                                                            reference, report)
    passes = []
    for (server, rate), got in results.items():  # every round's requests pooled
        summary = summarize_pass(server, rate, got, seconds[(server, rate)])
        summary.server_counters = counter_figures(deltas[(server, rate)])
        passes.append(summary)
        report["passes"].append({**dataclasses.asdict(summary), "rate": rate_label(rate)})
    offline = median_offline(offline_rounds) if reference is not None else None
    report["offline"], report["offline_rounds"] = offline, offline_rounds
    checks = combine_checks(round_checks)
    report["criteria"], report["criteria_rounds"] = checks, round_checks
    print_report(passes, offline, checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=None if args.json_requests else 1, default=_json_default)
        print(f"[bench-serve] wrote {args.json}")
    if args.chart:
        if write_chart(passes, offline, args.max_batch_size, args.chart):
            print(f"[bench-serve] wrote {args.chart}")
        else:
            print("[bench-serve] no chart: pip install matplotlib")
    return 1 if any(p.failed for p in passes) else 0


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")

