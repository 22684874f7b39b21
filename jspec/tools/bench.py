"""``jspec bench`` (= ``python scripts/benchmark.py``): every generation method side by side, in one run.

    jspec bench                                  # bundled code model, 16 HumanEval prompts, batch 1/4/16, peers
    jspec bench --batch-sizes 1 --num-prompts 8 --repeats 3 --out bench-results
    jspec bench --synthetic llama3-8b,llama3-1b --out $OUT      # GPU roofline mode (jspec/tools/roofline/)
    jspec bench --kernel-sweep --out $OUT        # paged tree attention against HBM bandwidth (kernel_sweep.py)

Methods (greedy, the same prompts and max_new_tokens): ``plain`` (drafter=None, the baseline), EAGLE-3 with
chain (``--chain-depth`` drafts), static and dynamic trees (``--num-draft-tokens`` nodes), the draft model
(dynamic tree) and n-gram prompt lookup (tree, and chain of ``--ngram-depth`` drafts)
(``jspec.tools.eval_acceptance``'s ``method_specs``), at each batch size. Per batch size: a warm-up pass of every method
over all prompts (it compiles every bucket; its compile seconds are reported apart), then ``--repeats`` rounds,
each timing one pass of every method in turn (interleaved, so drift on a shared machine hits every method of a
round alike); the median tokens/s is reported, and the speedup is the median over rounds of the method's tokens/s
over ``plain``'s in the same round. Every method's output is compared with plain's token for token and the
mismatches are counted (they must be 0; they are reported, never hidden).

Peers at batch 1, on the same weights (exported to Hugging Face format into a temp dir) and prompts, float32 on
the CPU: transformers' plain ``generate``, assisted generation with the draft model (``assistant_model=``),
and prompt lookup (``prompt_lookup_num_tokens=``); their outputs are compared with jspec plain's too.

Writes ``bench.json`` (every figure), ``bench.png`` (tokens/s by method and batch; per-step acceptance histogram)
under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from jspec.tools.parallel_args import add_parallel_args, mesh_kwargs, start_processes

PEERS = ("hf-plain", "hf-assisted", "hf-prompt-lookup")


@dataclasses.dataclass
class Row:
    """One method at one batch size. tokens_per_second: median over the timed passes (all prompts each); speedup:
    median over rounds of tokens/s / plain's in the same round (peers: over jspec plain's median);
    acceptance_length: tokens committed per target step (1 for plain; None for peers, which do not report it);
    accepted_hist[k]: fraction of steps that accepted exactly k drafts; mismatches: prompts whose output differs
    from jspec plain's at the same batch size (None for plain itself)."""

    method: str
    batch_size: int
    tokens_per_second: float
    tokens_per_second_runs: list[float]
    speedup: float | None
    acceptance_length: float | None
    num_generated_tokens: int
    compile_seconds: float
    mismatches: int | None
    accepted_hist: list[float]
    peer: bool = False
    spec: dict | None = None
    quantization: str | None = None


def quantizations(text: str) -> list[str | None]:
    """--quantization's comma-separated list ("none" for the checkpoint's weights) -> schemes, None first if given."""
    from models.quantization import SCHEMES

    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name != "none" and name not in SCHEMES]
    if not names or bad:
        raise ValueError(f"--quantization {text!r}: expected a comma-separated list of none, {', '.join(SCHEMES)}")
    schemes = [None if name == "none" else name for name in dict.fromkeys(names)]
    return sorted(schemes, key=lambda scheme: scheme is not None)  # the checkpoint's weights first: the peers' baseline


def method_label(scheme: str | None, method: str) -> str:
    return method if scheme is None else f"{method} ({scheme})"


def acceptance_histogram(accepted_per_position: Sequence[float]) -> list[float]:
    """Fraction of steps accepting at least i + 1 drafts (i = 0..D-1) -> fraction accepting exactly k (k = 0..D)."""
    at_least = [1.0] + list(accepted_per_position) + [0.0]
    return [max(at_least[k] - at_least[k + 1], 0.0) for k in range(len(at_least) - 1)]


# --- jspec methods ----------------------------------------------------------------------------------------------

def jspec_rows(target: str, drafters: dict[str, str | None], prompts: Sequence[str], methods: Sequence[str],
               batch_sizes: Sequence[int], args: argparse.Namespace,
               on_row: Callable[[Row], None]) -> tuple[list[Row], dict[int, list[list[int]]], list[list[int]]]:
    """Every method at every batch size -> (rows, plain outputs per batch size, the prompts' token ids).

    Per batch size: a warm-up pass of every method (it compiles), then ``args.repeats`` rounds that time one pass
    of every method each, interleaved, so a slow spell of a shared machine hits all methods of a round alike.
    Speedup is the median over rounds of (method / plain) in the same round.
    """
    from tqdm import tqdm

    import jspec
    from jspec.tools.eval_acceptance import method_drafter, method_specs, run_method
    from jspec.tools.force_accept import force_accept_from_env

    specs = method_specs(args.num_draft_tokens, args.num_steps, args.topk, args.chain_depth, args.ngram_depth,
                         args.selection)
    order = sorted(methods, key=lambda m: m != "plain")
    schemes = quantizations(args.quantization)
    keys = [(scheme, method) for scheme in schemes for method in order]  # every method on each weight format
    force_accept = force_accept_from_env()
    engines = {}
    for scheme, method in keys:
        name, spec = specs[method]
        engines[scheme, method] = jspec.SpecEngine.from_pretrained(
            target, drafter=method_drafter(name, drafters), spec=spec, max_batch_size=max(batch_sizes),
            max_seq_len=args.max_seq_len, dtype=args.dtype, force_accept=force_accept if name else None,
            quantization=scheme, **mesh_kwargs(args))
    baseline = (schemes[0], "plain")
    ids = engines[baseline].encode(prompts)
    bar = tqdm(total=len(keys) * len(batch_sizes) * (1 + args.repeats), desc="jspec passes", unit="pass")
    rows, plain_outputs = [], {}
    for batch in batch_sizes:
        warm = {}
        for key in keys:
            warm[key] = run_method(engines[key], ids, batch, args.max_new_tokens)
            bar.update()
        plain_outputs[batch] = warm[baseline][0]
        speeds = {key: [] for key in keys}
        for _ in range(args.repeats):
            for key in keys:
                again, stats = run_method(engines[key], ids, batch, args.max_new_tokens)
                if again != warm[key][0]:
                    raise RuntimeError(f"{method_label(*key)}: greedy outputs changed between passes at batch "
                                       f"{batch}: not deterministic")
                speeds[key].append(stats["num_generated_tokens"] / stats["run_seconds"])
                bar.update()
        for scheme, method in keys:
            outputs, stats = warm[scheme, method]
            plain = (scheme, "plain")  # lossless against plain decoding of the same weights
            speedup = None if method == "plain" else statistics.median(
                [s / p for s, p in zip(speeds[scheme, method], speeds[plain])])
            mismatches = None if method == "plain" else sum(a != b for a, b in zip(outputs, warm[plain][0]))
            spec = specs[method][1]
            row = Row(method_label(scheme, method), batch, statistics.median(speeds[scheme, method]),
                      speeds[scheme, method], speedup, stats["acceptance_length"], stats["num_generated_tokens"],
                      stats["compile_seconds"], mismatches, acceptance_histogram(stats["accepted_per_position"]),
                      spec=dataclasses.asdict(spec) if spec else None, quantization=scheme)
            rows.append(row)
            on_row(row)
    bar.close()
    return rows, plain_outputs, ids


# --- transformers peers -----------------------------------------------------------------------------------------

def export_hf(converted_dir: str, out_dir: str) -> str:
    """Writes the converted checkpoint ``converted_dir`` back to HF format (same weights) at ``out_dir``."""
    from models.checkpoint import load_llama, read_hf_config, write_hf_llama

    _, params, _ = load_llama(converted_dir)
    write_hf_llama(out_dir, read_hf_config(converted_dir), params)
    return out_dir


def time_hf(model, prompts: Sequence[list[int]], max_new_tokens: int, repeats: int,
            **generate_kwargs) -> tuple[list[list[int]], list[float]]:
    """transformers ``generate`` one prompt at a time, greedy: a warm-up pass, then ``repeats`` timed passes ->
    (new tokens per prompt, tokens/s per pass)."""
    import torch

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

    def one_pass():
        outputs, start = [], time.perf_counter()
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([list(prompt)])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=pad, **generate_kwargs)
                outputs.append(out[0, len(prompt):].tolist())
        return outputs, sum(len(o) for o in outputs) / (time.perf_counter() - start)

    outputs, _ = one_pass()
    return outputs, [one_pass()[1] for _ in range(repeats)]


def peer_rows(target: str, draft: str | None, prompts_ids: Sequence[list[int]], reference: list[list[int]],
              plain_tps: float, args: argparse.Namespace, on_row: Callable[[Row], None]) -> list[Row]:
    """transformers' plain, assisted (draft model) and prompt-lookup generate at batch 1."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jspec-bench-hf-") as tmp:
        load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        model = load(export_hf(target, os.path.join(tmp, "target")))
        assistant = load(export_hf(draft, os.path.join(tmp, "draft"))) if draft else None
        kinds = {"hf-plain": {}, "hf-prompt-lookup": {"prompt_lookup_num_tokens": args.num_draft_tokens - 1}}
        if assistant is not None:
            kinds["hf-assisted"] = {"assistant_model": assistant}
        for name in [p for p in PEERS if p in kinds and p in args.peers]:
            outputs, speeds = time_hf(model, prompts_ids, args.max_new_tokens, args.repeats, **kinds[name])
            tps = statistics.median(speeds)
            mismatches = sum(a != b for a, b in zip(outputs, reference))
            row = Row(name, 1, tps, speeds, tps / plain_tps, None, sum(len(o) for o in outputs), 0.0, mismatches,
                      [], peer=True)
            rows.append(row)
            on_row(row)
    return rows


# --- output -----------------------------------------------------------------------------------------------------

def print_table(rows: Sequence[Row]) -> None:
    """A rich table (plain text when rich is not installed)."""
    header = ["method", "batch", "tokens/s", "speedup", "accept len", "mismatch", "compile s"]
    cells = [[r.method, str(r.batch_size), f"{r.tokens_per_second:.1f}",
              "-" if r.speedup is None else f"{r.speedup:.2f}x",
              "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}",
              "-" if r.mismatches is None else str(r.mismatches), f"{r.compile_seconds:.1f}"] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        for line in [header] + cells:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        return
    table = Table(title="jspec bench (speedup: over jspec plain at the same batch size)")
    for h in header:
        table.add_column(h, justify="left" if h == "method" else "right", no_wrap=True)
    for r, c in zip(rows, cells):
        table.add_row(*c, style="red" if r.mismatches else None)
    Console(width=None if sys.stdout.isatty() else 132).print(table)


def write_chart(rows: Sequence[Row], path: str) -> bool:
    """bench.png: tokens/s per method grouped by batch size (peers at batch 1), and the acceptance histogram of
    each speculative method at the smallest batch. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    methods = list(dict.fromkeys(r.method for r in rows))
    batches = sorted({r.batch_size for r in rows})
    fig, (speed_ax, hist_ax) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r.tokens_per_second for r in rows if r.method == method and r.batch_size == b), 0.0)
                  for b in batches]
        speed_ax.bar(np.arange(len(batches)) + i * width, values, width, label=method)
    speed_ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2, [f"batch {b}" for b in batches])
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_title("throughput (median of timed passes)")
    speed_ax.legend(fontsize=7)
    spec_rows = [r for r in rows if r.batch_size == batches[0] and len(r.accepted_hist) > 1]
    for i, r in enumerate(spec_rows):
        bar = 0.8 / max(len(spec_rows), 1)
        hist_ax.bar(np.arange(len(r.accepted_hist)) + 1 + i * bar, r.accepted_hist, bar, label=r.method)
    hist_ax.set_xlabel("tokens committed per target step (accepted drafts + 1)")
    hist_ax.set_ylabel("fraction of steps")
    hist_ax.set_title(f"acceptance, batch {batches[0]}")
    if spec_rows:
        hist_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def environment() -> dict[str, Any]:
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "machine": platform.machine()}


# --- command line -----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from jspec.tools.bundled import DEFAULT_SPEC
    from jspec.tools.eval_acceptance import DEFAULT_METHODS

    parser = argparse.ArgumentParser(prog="jspec bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", default=None,
                        help="GPU roofline mode on random weights (e.g. llama3-8b,llama3-1b); every other argument "
                             "goes to jspec.tools.roofline")
    parser.add_argument("--kernel-sweep", nargs="?", const="full", default=None, choices=["full", "small"],
                        help="time the paged tree-attention kernel against the device's memory bandwidth "
                             "(jspec.tools.kernel_sweep; 'small': a CPU smoke check) and write kernel_sweep.json "
                             "under --out, instead of the methods")
    parser.add_argument("--aot", default=None, metavar="DEPLOYMENT[,DEPLOYMENT]",
                        help="compile the engine's programs for these TPU or GPU deployments on this machine "
                             "(libtpu, XLA's GPU compiler; no TPU or GPU: pip install -e '.[aot]', and "
                             "JAX_PLATFORMS=cpu for a GPU), e.g. llama3-8b/v5e-1/int8 or llama3-70b/h100-8/bfloat16, "
                             "and write aot.json under --out: step bytes and flops per device, HBM floors, memory "
                             "per device (jspec.tools.aot_table)")
    parser.add_argument("--aot-methods", default="plain,eagle3-chain,eagle3-dynamic16,eagle3-dynamic,dflash-block",
                        help="--aot: the methods compiled (jspec.tools.aot_programs.METHODS)")
    parser.add_argument("--aot-batch-size", type=int, default=8, help="--aot: rows of the compiled programs")
    parser.add_argument("--aot-server", action="store_true",
                        help="--aot: the server's paged step programs instead (a chunk, its log-probabilities "
                             "form, a structured-outputs step) over the KV pool it would allocate there, with "
                             "their memory per device; aot_server.json (jspec.tools.aot_server)")
    parser.add_argument("--kernel-impl", default="auto",
                        choices=["auto", "pallas", "interpret", "tpu", "tpu_interpret"],
                        help="--kernel-sweep: the kernels' lowering (pallas_kernels.impl)")
    parser.add_argument("--target", default=None, help="converted target (default: the bundled code model)")
    parser.add_argument("--eagle3", default=None, help="converted EAGLE-3 head (default: the bundled one)")
    parser.add_argument("--draft", default=None, help="converted draft model (default: the bundled one)")
    parser.add_argument("--dflash", default=None, help="converted DFlash or DSpark drafter (method 'dflash': its "
                        "whole block as a chain)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated jspec methods")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated transformers peers ('' for none)")
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated")
    parser.add_argument("--num-prompts", type=int, default=16, help="the first N HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per method and batch (median)")
    parser.add_argument("--num-draft-tokens", type=int, default=16, help="tree nodes per step, root included")
    parser.add_argument("--num-steps", type=int, default=6, help="dynamic tree depth")
    parser.add_argument("--chain-depth", type=int, default=5, help="drafts per step of the model-drafted chains")
    parser.add_argument("--ngram-depth", type=int, default=9, help="drafts per step of the n-gram chain")
    parser.add_argument("--topk", type=int, default=DEFAULT_SPEC.topk, help="dynamic tree branching")
    parser.add_argument("--selection", default=DEFAULT_SPEC.selection, choices=["eagle2", "top1_chain"],
                        help="dynamic trees: EAGLE-2's (best cumulative scores) or keep the top-1 chain to full depth")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--quantization", default="none",
                        help="comma-separated weight formats to run every method on, side by side: none (the "
                             "checkpoint's), int8, fp8, int4 (qwix weight-only; speedups and mismatches are against "
                             "plain decoding of the same weights)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--out", default="bench-results", help="directory for bench.json and bench.png")
    add_parallel_args(parser)
    return parser


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} {text!r}: expected positive integers")
    return values


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """Validates everything before any model loads -> (methods, batch sizes)."""
    from jspec.tools.eval_acceptance import method_specs

    for name in ("num_prompts", "max_new_tokens", "repeats", "chain_depth", "ngram_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    methods = [m for m in args.methods.split(",") if m]
    known = method_specs(args.num_draft_tokens, args.num_steps, args.topk, args.chain_depth, args.ngram_depth,
                         args.selection)
    unknown = [m for m in methods if m not in known]
    if unknown or "plain" not in methods:
        raise ValueError(f"--methods {args.methods!r}: expected 'plain' and some of {list(known)}")
    if "dflash" in methods and args.dflash is None:
        raise ValueError("--methods dflash needs --dflash DIR (a converted DFlash or DSpark drafter)")
    quantizations(args.quantization)
    args.peers = [p for p in args.peers.split(",") if p]
    bad_peers = [p for p in args.peers if p not in PEERS]
    if bad_peers:
        raise ValueError(f"--peers {bad_peers}: expected some of {list(PEERS)}")
    return methods, _int_list(args.batch_sizes, "batch-sizes")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = build_parser().parse_known_args(argv)
    if args.synthetic is not None:
        from jspec.tools.roofline import main as synthetic_main
        return synthetic_main(argv)
    args = build_parser().parse_args(argv)
    if args.kernel_sweep is not None:
        return kernel_sweep(args)
    if args.aot is not None:
        from jspec.tools.aot_table import run_aot_table, run_server_table

        split = lambda text: [part.strip() for part in text.split(",") if part.strip()]
        try:
            if args.aot_server:
                run_server_table(split(args.aot), split(args.aot_methods), rows=args.aot_batch_size, out_dir=args.out)
            else:
                run_aot_table(split(args.aot), split(args.aot_methods), args.aot_batch_size, out_dir=args.out)
        except (ValueError, RuntimeError) as error:
            print(f"jspec bench: error: {error}", file=sys.stderr)
            return 2
        return 0
    methods, batch_sizes = _check_args(args)
    start_processes(args)
    import jspec
    from jspec.drafters import resolve as resolve_drafter
    from jspec.train.corpus import human_eval_prompts

    target = args.target or jspec.bundled_model()
    drafters = {"eagle3": args.eagle3, "draft": args.draft, "dflash": args.dflash}
    prompts = [p["prompt"] for p in human_eval_prompts()[:args.num_prompts]]
    os.makedirs(args.out, exist_ok=True)
    report = {"environment": environment(), "args": vars(args), "rows": []}

    from tqdm import tqdm

    def on_row(row: Row) -> None:
        report["rows"].append(dataclasses.asdict(row))
        _write_json(report, os.path.join(args.out, "bench.json"))
        extra = "" if row.acceptance_length is None else f", acceptance {row.acceptance_length:.2f}"
        tqdm.write(f"[bench] {row.method} batch {row.batch_size}: {row.tokens_per_second:.1f} tokens/s"
              f"{'' if row.speedup is None else f' ({row.speedup:.2f}x)'}{extra}, mismatches {row.mismatches}",
              )

    rows, plain_outputs, ids = jspec_rows(target, drafters, prompts, methods, batch_sizes, args, on_row)
    if args.peers and 1 in plain_outputs:
        plain_tps = next(r.tokens_per_second for r in rows if r.method == "plain" and r.batch_size == 1)
        draft_dir = resolve_drafter(args.draft or "draft", target)[1] if "hf-assisted" in args.peers else None
        rows += peer_rows(target, draft_dir, ids,
                          plain_outputs[1], plain_tps, args, on_row)
    print_table(rows)
    chart = os.path.join(args.out, "bench.png")
    print(f"[bench] wrote {os.path.join(args.out, 'bench.json')}"
          + (f" and {chart}" if write_chart(rows, chart) else " (no chart: pip install matplotlib)"))
    return 0


def kernel_sweep(args: argparse.Namespace) -> int:
    """``jspec bench --kernel-sweep``: the paged tree-attention sweep, printed row by row and written whole."""
    from jspec.tools.kernel_sweep import run_kernel_sweep

    report = run_kernel_sweep(args.kernel_impl, small=args.kernel_sweep == "small", iters=args.repeats * 5,
                              echo=lambda line: print(line, flush=True))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel_sweep.json")
    _write_json(report, path)
    print(f"[bench] wrote {path}")
    return 0


def _write_json(report: dict, path: str) -> None:
    """Atomic: a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
