"""Roofline benchmark on random weights of real model shapes: decode step time against the memory floor.

    python -m jspec.tools.roofline --synthetic llama3-8b,llama3-1b --out DIR [--budget-seconds 480]
    python -m jspec.tools.roofline --synthetic tiny --synthetic-batches 1      # CPU smoke run

One job per module:

    shapes.py   the benchmarked shapes (SHAPES) and their random weights, drawn on the device
    floor.py    the memory floor: bytes one decode step reads, and the measured copy bandwidth
    plan.py     which configurations run, in which order, within the budget
    timing.py   timing one configuration (forced acceptance, step time = (t_N - t_1) / verify steps)
    report.py   the JSON report, its ratios to the floor and to plain decoding, the tables
    run.py      the run over every shape, and the command line (``main``)
"""

from jspec.tools.roofline.run import main, run_synthetic, run_synthetic_models

__all__ = ["main", "run_synthetic", "run_synthetic_models"]
