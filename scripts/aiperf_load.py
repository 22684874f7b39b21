"""A real load client against `jspec serve`: NVIDIA's AIPerf (``pip install aiperf``, in a venv of its own: it
brings transformers 5) runs the mixed load of ``scripts/serve_load.py`` (HumanEval prompts, their last 400
characters, ``max_tokens`` from {8, 32, 64, 128}, greedy) as a single-turn dataset, streamed at a fixed concurrency,
against one `jspec serve` and against ``jspec serve --data-parallel-size N`` (N replicas behind sglang-router), and
prints what AIPerf measured of each: output tokens/s, requests/s, TTFT, inter-token latency and request latency.

    python scripts/aiperf_load.py --aiperf /path/to/venv/bin/aiperf --json aiperf.json

AIPerf counts tokens with the bundled model's tokenizer (its directory, no download) and reads the server's usage
(``--use-server-token-count``). Extra ``jspec serve`` flags for both go after ``--``.

Every server is up at once (started one at a time), and ``--rounds`` AIPerf runs each in alternating order (A B,
B A, ...). ``--server NAME=FLAGS`` (repeatable) runs other servers instead of one server and the fleet;
``--request NAME=JSON`` adds fields to every request sent to server NAME (AIPerf's ``--extra-inputs``), for instance
a JSON schema on every request against none:

    python scripts/aiperf_load.py --aiperf ... --rounds 4 --settle --server "default=" --server "grammar=" \
        --request 'grammar={"structured_outputs": {"json": {...}}}'
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from serve_load import MAX_TOKENS, Served, load, request_extras  # noqa: E402

METRICS = {  # AIPerf's record name -> (this script's label, the statistic read)
    "output_token_throughput": ("output tokens/s", "avg"),
    "request_throughput": ("requests/s", "avg"),
    "time_to_first_token": ("TTFT p50 ms", "p50"),
    "inter_token_latency": ("ITL p50 ms", "p50"),
    "request_latency": ("latency p50 ms", "p50"),
}


def dataset(path: pathlib.Path, num: int, seed: int) -> None:
    """The load as AIPerf's single_turn JSONL: one request a line, its prompt and output length."""
    with open(path, "w") as f:
        for request in load(num, seed, MAX_TOKENS):
            f.write(json.dumps({"text": request["prompt"], "output_length": request["max_tokens"]}) + "\n")


def profile(aiperf: str, server: Served, data: pathlib.Path, out: pathlib.Path, args, extra: dict | None = None
            ) -> dict[str, float]:
    """One AIPerf run against ``server`` (``extra``: fields added to every request body) -> the figures of
    :data:`METRICS`."""
    import jspec

    command = [aiperf, "profile", "--model", server.model, "--url", server.base, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", str(jspec.bundled_model()), "--input-file", str(data),
               "--custom-dataset-type", "single_turn", "--concurrency", str(args.concurrency), "--request-count",
               str(args.num_requests), "--warmup-request-count", str(args.concurrency), "--extra-inputs",
               "temperature:0", "--use-server-token-count", "--output-artifact-dir", str(out), "--ui", "none"]
    if extra:
        command += ["--extra-inputs", json.dumps(extra)]
    subprocess.run(command, check=True)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    records = json.loads(found[-1].read_text())
    return {label: float(records[name][stat]) for name, (label, stat) in METRICS.items() if name in records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable (its own venv's)")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--data-parallel-size", type=int, default=2, help="replicas behind the router (0: none)")
    parser.add_argument("--server", action="append", default=None, metavar="NAME=FLAGS",
                        help="servers to run instead of one server and the fleet, with their jspec serve flags "
                             "(repeatable)")
    parser.add_argument("--request", action="append", default=[], metavar="NAME=JSON",
                        help="fields added to every request body sent to server NAME (repeatable)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="AIPerf runs per server, every server up at once and the order alternating (A B, B A, "
                             "...); each figure is the mean of the runs")
    parser.add_argument("--settle", action="store_true",
                        help="before measuring, run the load through each server unmeasured until a pass sets off no "
                             "compile on first use (serve_load.py's --settle)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--json", default=None)
    parser.add_argument("serve_flags", nargs="*", help="extra jspec serve flags (after --)")
    args = parser.parse_args(argv)
    common = ["--max-seq-len", str(args.max_seq_len), *args.serve_flags]
    if args.server:
        named = [s.partition("=") for s in args.server]
        if any(not name or not sep for name, sep, _ in named) or len({n for n, _, _ in named}) < len(named):
            parser.error(f"--server {args.server}: expected distinct NAME=FLAGS")
        setups = [(name, [*shlex.split(flags), *common]) for name, _, flags in named]
    else:
        setups = [("one server", common)]
        if args.data_parallel_size:
            setups.append((f"{args.data_parallel_size} replicas + router",
                           ["--data-parallel-size", str(args.data_parallel_size), *common]))
    try:
        extras = request_extras(args.request, {name for name, _ in setups})
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in setups}
    with tempfile.TemporaryDirectory() as work:
        data = pathlib.Path(work) / "load.jsonl"
        dataset(data, args.num_requests, args.seed)
        servers: list[Served] = []
        try:
            for name, flags in setups:  # one at a time: a server warming up would slow the other's
                servers.append(Served(name, flags))
                if args.settle:  # the load's programs compiled before AIPerf measures (serve_load's --settle)
                    servers[-1].settle([{**r, "temperature": 0.0, **extras.get(name, {})}
                                        for r in load(args.num_requests, args.seed, MAX_TOKENS)])
            for round_ in range(args.rounds):
                for server in (servers if round_ % 2 == 0 else servers[::-1]):
                    out = pathlib.Path(work) / f"{len(runs[server.name])}-{servers.index(server)}"
                    runs[server.name].append(profile(args.aiperf, server, data, out, args, extras.get(server.name)))
        finally:
            for server in servers:
                server.stop()
    results = {name: {label: float(np.mean([r[label] for r in figures if label in r]))
                      for label in figures[0]} for name, figures in runs.items()}
    labels = [label for label, _ in METRICS.values()]
    print(f"{'':24}" + "".join(f"{label:>16}" for label in labels))
    for name, figures in results.items():
        print(f"{name:24}" + "".join(f"{figures.get(label, float('nan')):16.1f}" for label in labels))
    if args.rounds > 1:
        for name, figures in runs.items():
            rates = [r.get(labels[0], float("nan")) for r in figures]
            print(f"{name} output tokens/s by run: {', '.join(f'{rate:.1f}' for rate in rates)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(flags=common, servers=dict(setups), requests=extras, concurrency=args.concurrency,
                           num_requests=args.num_requests, seed=args.seed, rounds=args.rounds, results=results,
                           runs=runs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
