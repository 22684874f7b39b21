"""``jspec bench-serve``: the OpenAI-compatible server under load, speculative vs plain, in one run (like vLLM's
``benchmark_serving.py``); what it measures and checks is in ``run.py``'s docstring (``jspec bench-serve --help``).

One job per module:

    schedule.py   the arrival schedule: --request-rates parsed, Poisson send times, a rate's label
    figures.py    one request's timings, per-token latencies and percentiles; one pass summarized
    client.py     sending a pass: the streaming /v1/completions client, or straight to a slot engine
    servers.py    the servers a pass runs against: two launched in this process, or one at --base-url
    counters.py   jspec serve's /metrics counters scraped, and what their change over passes says
    offline.py    the offline ``generate`` reference, timed in every round
    criteria.py   the three checks, per round and over rounds
    report.py     the table printed at the end
    chart.py      the PNG chart (--chart)
    run.py        the rounds of passes, and the command line (``main``)
"""

from jspec.tools.bench_serve.chart import write_chart
from jspec.tools.bench_serve.client import run_pass, served_model
from jspec.tools.bench_serve.criteria import combine_checks, criteria
from jspec.tools.bench_serve.figures import (PassSummary, RequestResult, inter_token_latencies, summarize,
                                             summarize_pass, time_per_output_token, tokens_per_chunk)
from jspec.tools.bench_serve.offline import median_offline
from jspec.tools.bench_serve.report import print_report
from jspec.tools.bench_serve.run import main
from jspec.tools.bench_serve.schedule import SEQUENTIAL, parse_rates, poisson_offsets
from jspec.tools.bench_serve.servers import free_port, uvicorn_thread

__all__ = ["SEQUENTIAL", "PassSummary", "RequestResult", "combine_checks", "criteria", "free_port",
           "inter_token_latencies", "main", "median_offline", "parse_rates", "poisson_offsets",
           "print_report", "run_pass", "served_model", "summarize", "summarize_pass", "time_per_output_token",
           "tokens_per_chunk", "uvicorn_thread", "write_chart"]
