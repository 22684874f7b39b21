"""``jspec bench --aot DEPLOYMENT[,DEPLOYMENT]``: the engine's programs compiled for TPU and GPU deployments on
this machine (``jspec.tools.aot_programs``: libtpu's compiler, XLA's GPU compiler; no TPU or GPU), and what the
compiler says they cost.

Per deployment and method, from the compiled decode step, per device: its flops; the bytes of its arguments
(weights and the decode state: what a step must read at least once) and the bytes accessed as XLA's cost analysis
counts them (which also counts each copy the TPU compiler makes into VMEM ahead of a matmul; on a GPU, where a
compile-only program has no cost analysis, XLA's HloCostAnalysis of the optimized module, which counts nothing
inside a custom call such as a Triton kernel), each against the weights the device holds (goal <= 1.1: weights read
once a step); the step against the plain step; the floors on the chip (argument bytes over HBM bandwidth, flops over
peak). From the compiled generate program: the memory one device needs (arguments, outputs, temporaries) against
its HBM. Written to ``aot.json`` under ``--out``.

``--aot-server``: the server's paged step programs instead (``jspec.tools.aot_server``: a chunk of steps, its
log-probabilities form, a structured-outputs step) over the KV pool the server would allocate on the chip, each
with the memory a device needs against its HBM; ``aot_server.json``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import jax

from jspec.tools.aot import chip_figures, cost_of, devices_for
from jspec.tools.aot_programs import DEPLOYMENTS, METHODS, Deployment, compile_engine_programs
from jspec.tools.aot_server import VARIANTS, compile_server_step, describe


def aot_row(deployment: Deployment, method: str, batch: int, **shape) -> dict:
    """One method on one deployment, compiled -> its figures (status "error" with the message on a failure)."""
    row = {"deployment": deployment.name, "method": method, "batch": batch}
    start = time.perf_counter()
    try:
        programs = compile_engine_programs(deployment, method, batch=batch, **shape)
    except Exception as error:  # noqa: BLE001 -- one failed program must not end the table
        return {**row, "status": "error", "error": f"{type(error).__name__}: {str(error)[:1000]}",
                "compile_seconds": time.perf_counter() - start}
    cost, memory = cost_of(programs.step), programs.generate.memory_analysis()
    chip = chip_figures(deployment.chip)
    step_bytes, step_flops = float(cost["bytes accessed"]), float(cost["flops"])
    step_arguments = float(programs.step.memory_analysis().argument_size_in_bytes)
    device_bytes = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
    return {**row, "status": "ok", "compile_seconds": time.perf_counter() - start, "seq_len": programs.seq_len,
            "step_flops": step_flops, "step_bytes_accessed": step_bytes,
            "weight_bytes_per_device": programs.weight_bytes_per_device,
            "bytes_over_weights": step_bytes / programs.weight_bytes_per_device,
            "step_argument_bytes": step_arguments,
            "arguments_over_weights": step_arguments / programs.weight_bytes_per_device,
            "hbm_floor_ms": 1e3 * step_arguments / chip["hbm_bytes_per_second"],
            "bytes_accessed_ms": 1e3 * step_bytes / chip["hbm_bytes_per_second"],
            "compute_floor_ms": 1e3 * step_flops / chip["bf16_flops_per_second"],
            "generate_bytes_per_device": device_bytes, "hbm_bytes_per_device": chip["hbm_bytes"],
            "fits": device_bytes <= chip["hbm_bytes"], **({"uncounted_custom_calls": cost["custom_calls"]}
                                                          if "custom_calls" in cost else {})}


def run_aot_table(deployments: Sequence[str | Deployment], methods: Sequence[str] = METHODS, batch: int = 8,
                  out_dir: str | None = None, echo: Callable[[str], None] = print, **shape) -> dict:
    """Every method on every deployment (a name from :data:`jspec.tools.aot_programs.DEPLOYMENTS`, or one given
    whole) -> the report, with each speculative step's bytes and flops over the plain step's of the same deployment.
    ``shape``: prompt_len, seq_len for ``compile_engine_programs``."""
    deployments = _checked(deployments, methods)
    report = {"batch": batch, "jax": jax.__version__, "rows": []}
    for deployment in deployments:
        plain = None
        for method in methods:
            row = aot_row(deployment, method, batch, **shape)
            if row["status"] == "ok" and method == "plain":
                plain = row
            if row["status"] == "ok" and plain is not None:
                row["bytes_over_plain"] = row["step_bytes_accessed"] / plain["step_bytes_accessed"]
                row["flops_over_plain"] = row["step_flops"] / plain["step_flops"]
            report["rows"].append(row)
            echo(format_row(row))
            _write(out_dir, "aot.json", report)
    return report


def _checked(deployments: Sequence[str | Deployment], methods: Sequence[str]) -> list[Deployment]:
    """The deployments (names resolved), once each compiler they need is here; ValueError naming a bad name."""
    unknown = [d for d in deployments if isinstance(d, str) and d not in DEPLOYMENTS]
    if unknown or not deployments:
        raise ValueError(f"--aot {','.join(map(str, deployments))!r}: expected deployments from "
                         f"{', '.join(DEPLOYMENTS)}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods {list(methods)!r}: expected a non-empty subset of {METHODS}")
    deployments = [DEPLOYMENTS[d] if isinstance(d, str) else d for d in deployments]
    for deployment in deployments:
        devices_for(deployment.chip, deployment.chips)  # its compiler is here, or the error that says how to install it
    return deployments


def _write(out_dir: str | None, name: str, report: dict) -> None:
    """The report so far, rewritten whole after each row (nothing half-written: a temporary file renamed)."""
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def format_row(row: dict) -> str:
    head = f"[aot] {row['deployment']} {row['method']} B{row['batch']}:"
    if row["status"] != "ok":
        return f"{head} {row['error']}"
    ratio = "" if "bytes_over_plain" not in row else (
        f", vs plain: bytes {row['bytes_over_plain']:.2f}x, flops {row['flops_over_plain']:.2f}x")
    return (f"{head} step reads {row['step_argument_bytes'] / 2**30:.2f} GiB of arguments "
            f"({row['arguments_over_weights']:.2f}x the weights), {row['step_bytes_accessed'] / 2**30:.2f} GiB "
            f"accessed as the compiler counts ({row['bytes_over_weights']:.2f}x), {row['step_flops'] / 1e9:.1f} "
            f"GFLOP; floors {row['hbm_floor_ms']:.2f} ms HBM, "
            f"{row['compute_floor_ms']:.2f} ms compute{ratio}; generate needs "
            f"{row['generate_bytes_per_device'] / 2**30:.1f} of {row['hbm_bytes_per_device'] / 2**30:.0f} GiB "
            f"({'fits' if row['fits'] else 'DOES NOT FIT'}); compiled in {row['compile_seconds']:.0f} s")


def run_server_table(deployments: Sequence[str | Deployment], methods: Sequence[str] = METHODS,
                     variants: Sequence[str] = VARIANTS, rows: int = 8, out_dir: str | None = None,
                     echo: Callable[[str], None] = print, **shape) -> dict:
    """The server's step programs (``jspec.tools.aot_server``) for every method and variant on every deployment,
    over the KV pool the server would allocate there -> the report (``aot_server.json`` under ``out_dir``).
    ``shape``: seq_len, block_size, max_total_tokens for ``compile_server_step``."""
    deployments = _checked(deployments, methods)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants {list(variants)!r}: expected a non-empty subset of {VARIANTS}")
    report = {"rows": rows, "jax": jax.__version__, "programs": []}
    for deployment in deployments:
        for method in methods:
            for variant in variants:
                start = time.perf_counter()
                head = {"deployment": deployment.name, "method": method, "variant": variant, "rows": rows}
                try:
                    row = {**describe(compile_server_step(deployment, method, variant, rows=rows, **shape)),
                           "status": "ok"}
                except Exception as error:  # noqa: BLE001 -- one failed program must not end the table
                    row = {**head, "status": "error", "error": f"{type(error).__name__}: {str(error)[:1000]}"}
                row["compile_seconds"] = time.perf_counter() - start
                report["programs"].append(row)
                echo(format_server_row(row))
                _write(out_dir, "aot_server.json", report)
    return report


def format_server_row(row: dict) -> str:
    head = f"[aot server] {row['deployment']} {row['method']} {row['variant']} R{row['rows']}:"
    if row["status"] != "ok":
        return f"{head} {row['error']}"
    workspace = row.get("workspace_bytes_per_device")
    sized = "" if workspace is None else f" (beside a {workspace / 2**30:.2f} GiB workspace)"
    return (f"{head} a pool of {row['pool_tokens']:,} token slots{sized}; {row['programs']} program(s), needing "
            f"{row['memory_bytes_per_device'] / 2**30:.1f} of {row['hbm_bytes_per_device'] / 2**30:.0f} GiB a device "
            f"({'fits' if row['fits'] else 'DOES NOT FIT'}); compiled in {row['compile_seconds']:.0f} s")
