"""``jspec bench --aot DEPLOYMENT[,DEPLOYMENT]``: the engine's programs compiled for TPU deployments on this
machine (``jspec.tools.aot_programs``, libtpu's compiler, no TPU), and what the compiler says they cost.

Per deployment and method, from the compiled decode step: flops and bytes accessed per device, the bytes against
the weights one device holds (goal <= 1.1: weights read once a step), the step against the plain step, and the
floors those give on the chip (bytes over HBM bandwidth, flops over peak); from the compiled generate program: the
memory one device needs (arguments + temporaries) against its HBM. Written to ``aot.json`` under ``--out``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import jax

from jspec.tools.aot import tpu_devices
from jspec.tools.aot_programs import DEPLOYMENTS, METHODS, Deployment, compile_engine_programs


def chip_figures(chip: str) -> dict:
    """One device of ``chip``: HBM bytes, HBM bytes/s, bf16 flop/s (Pallas's TPU table for the chip)."""
    from jax.experimental.pallas import tpu as pltpu

    with jax.default_device(tpu_devices(chip)[0]):
        info = pltpu.get_tpu_info()
    return {"hbm_bytes": info.hbm_capacity_bytes, "hbm_bytes_per_second": info.mem_bw_bytes_per_second,
            "bf16_flops_per_second": info.bf16_ops_per_second}


def aot_row(deployment: Deployment, method: str, batch: int) -> dict:
    """One method on one deployment, compiled -> its figures (status "error" with the message on a failure)."""
    row = {"deployment": deployment.name, "method": method, "batch": batch}
    start = time.perf_counter()
    try:
        programs = compile_engine_programs(deployment, method, batch=batch)
    except Exception as error:  # noqa: BLE001 -- one failed program must not end the table
        return {**row, "status": "error", "error": f"{type(error).__name__}: {str(error)[:1000]}",
                "compile_seconds": time.perf_counter() - start}
    cost, memory = programs.step.cost_analysis(), programs.generate.memory_analysis()
    chip = chip_figures(deployment.chip)
    step_bytes, step_flops = float(cost["bytes accessed"]), float(cost["flops"])
    device_bytes = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
    return {**row, "status": "ok", "compile_seconds": time.perf_counter() - start, "seq_len": programs.seq_len,
            "step_flops": step_flops, "step_bytes_accessed": step_bytes,
            "weight_bytes_per_device": programs.weight_bytes_per_device,
            "bytes_over_weights": step_bytes / programs.weight_bytes_per_device,
            "hbm_floor_ms": 1e3 * step_bytes / chip["hbm_bytes_per_second"],
            "compute_floor_ms": 1e3 * step_flops / chip["bf16_flops_per_second"],
            "generate_bytes_per_device": device_bytes, "hbm_bytes_per_device": chip["hbm_bytes"],
            "fits": device_bytes <= chip["hbm_bytes"]}


def run_aot_table(names: Sequence[str], methods: Sequence[str] = METHODS, batch: int = 8,
                  out_dir: str | None = None, echo: Callable[[str], None] = print) -> dict:
    """Every method on every named deployment (:data:`jspec.tools.aot_programs.DEPLOYMENTS`) -> the report, with each
    speculative step's bytes and flops over the plain step's of the same deployment."""
    unknown = [name for name in names if name not in DEPLOYMENTS]
    if unknown or not names:
        raise ValueError(f"--aot {','.join(names)!r}: expected deployments from {', '.join(DEPLOYMENTS)}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods {list(methods)!r}: expected a non-empty subset of {METHODS}")
    for name in names:
        tpu_devices(DEPLOYMENTS[name].chip)  # libtpu is here, or the error that says how to install it
    report = {"batch": batch, "jax": jax.__version__, "rows": []}
    for name in names:
        plain = None
        for method in methods:
            row = aot_row(DEPLOYMENTS[name], method, batch)
            if row["status"] == "ok" and method == "plain":
                plain = row
            if row["status"] == "ok" and plain is not None:
                row["bytes_over_plain"] = row["step_bytes_accessed"] / plain["step_bytes_accessed"]
                row["flops_over_plain"] = row["step_flops"] / plain["step_flops"]
            report["rows"].append(row)
            echo(format_row(row))
            if out_dir is not None:
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, "aot.json"), "w") as f:
                    json.dump(report, f, indent=1)
    return report


def format_row(row: dict) -> str:
    head = f"[aot] {row['deployment']} {row['method']} B{row['batch']}:"
    if row["status"] != "ok":
        return f"{head} {row['error']}"
    ratio = "" if "bytes_over_plain" not in row else (
        f", vs plain: bytes {row['bytes_over_plain']:.2f}x, flops {row['flops_over_plain']:.2f}x")
    return (f"{head} step {row['step_bytes_accessed'] / 2**30:.2f} GiB ({row['bytes_over_weights']:.2f}x the "
            f"weights), {row['step_flops'] / 1e9:.1f} GFLOP; floors {row['hbm_floor_ms']:.2f} ms HBM, "
            f"{row['compute_floor_ms']:.2f} ms compute{ratio}; generate needs "
            f"{row['generate_bytes_per_device'] / 2**30:.1f} of {row['hbm_bytes_per_device'] / 2**30:.0f} GiB "
            f"({'fits' if row['fits'] else 'DOES NOT FIT'}); compiled in {row['compile_seconds']:.0f} s")
