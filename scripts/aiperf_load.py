"""A real load client against `jspec serve`: NVIDIA's AIPerf (``pip install aiperf``, in a venv of its own: it
brings transformers 5) runs the mixed load of ``scripts/serve_load.py`` (HumanEval prompts, their last 400
characters, ``max_tokens`` from {8, 32, 64, 128}, greedy) as a single-turn dataset, streamed at a fixed concurrency,
against one `jspec serve` and against ``jspec serve --data-parallel-size N`` (N replicas behind sglang-router), and
prints what AIPerf measured of each: output tokens/s, requests/s, TTFT, inter-token latency and request latency.

    python scripts/aiperf_load.py --aiperf /path/to/venv/bin/aiperf --json aiperf.json

AIPerf counts tokens with the bundled model's tokenizer (its directory, no download) and reads the server's usage
(``--use-server-token-count``). Extra ``jspec serve`` flags for both go after ``--``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from serve_load import MAX_TOKENS, Served, load  # noqa: E402

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


def profile(aiperf: str, server: Served, data: pathlib.Path, out: pathlib.Path, args) -> dict[str, float]:
    """One AIPerf run against ``server`` -> the figures of :data:`METRICS`."""
    import jspec

    command = [aiperf, "profile", "--model", server.model, "--url", server.base, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", str(jspec.bundled_model()), "--input-file", str(data),
               "--custom-dataset-type", "single_turn", "--concurrency", str(args.concurrency), "--request-count",
               str(args.num_requests), "--warmup-request-count", str(args.concurrency), "--extra-inputs",
               "temperature:0", "--use-server-token-count", "--output-artifact-dir", str(out), "--ui", "none"]
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
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--json", default=None)
    parser.add_argument("serve_flags", nargs="*", help="extra jspec serve flags (after --)")
    args = parser.parse_args(argv)
    common = ["--max-seq-len", str(args.max_seq_len), *args.serve_flags]
    setups = [("one server", common)]
    if args.data_parallel_size:
        setups.append((f"{args.data_parallel_size} replicas + router",
                       ["--data-parallel-size", str(args.data_parallel_size), *common]))
    results = {}
    with tempfile.TemporaryDirectory() as work:
        data = pathlib.Path(work) / "load.jsonl"
        dataset(data, args.num_requests, args.seed)
        for index, (name, flags) in enumerate(setups):
            server = Served(name, flags)
            try:
                results[name] = profile(args.aiperf, server, data, pathlib.Path(work) / f"run{index}", args)
            finally:
                server.stop()
    labels = [label for label, _ in METRICS.values()]
    print(f"{'':24}" + "".join(f"{label:>16}" for label in labels))
    for name, figures in results.items():
        print(f"{name:24}" + "".join(f"{figures.get(label, float('nan')):16.1f}" for label in labels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(flags=common, concurrency=args.concurrency, num_requests=args.num_requests,
                           seed=args.seed, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
