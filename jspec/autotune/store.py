"""Where auto's numbers are kept: this device's step costs and acceptance cached as JSON per (backend, device
kind, JAX version, model, drafters, batch size, max_seq_len, mesh) (:func:`cache_key`), the same on every process of
a multi-process run (:func:`same_on_every_process`), and what a model ships beside its parts: its step-cost prior
(STEP_COST_FILE, scripts/calibrate_auto.py --step-costs) and its calibration profile (PROFILE_FILE)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Sequence

import jax
import numpy as np

from jspec.auto import AutoChoice
from jspec.autotune.timing import timed_acceptance, timing_key

logger = logging.getLogger("jspec.auto")

PROFILE_FILE = "acceptance_profile.json"
STEP_COST_FILE = "step_costs.json"


def mesh_layout(tensor_parallel_size: int, data_parallel_size: int, mesh, num_processes: int) -> str:
    """The device layout a step cost depends on, for :func:`cache_key`: "" for one device in one process."""
    if mesh is not None:
        devices = "mesh " + ",".join(f"{name}={size}" for name, size in mesh.shape.items())
    elif tensor_parallel_size == data_parallel_size == 1:
        devices = ""
    else:
        devices = f"tp{tensor_parallel_size} dp{data_parallel_size}"
    return devices if num_processes == 1 else f"{devices} processes {num_processes}".strip()


def cache_key(target_dir: str, drafters: Sequence[str], batch_size: int, max_seq_len: int, dtype: str | None,
              layout: str = "") -> str:
    """What a step cost depends on: device, JAX, the model's files' identity, drafters, batch and cache size, and
    ``layout`` (the device mesh the engines run on; "" for one device)."""
    device = jax.devices()[0]
    ident = [jax.default_backend(), getattr(device, "device_kind", ""), jax.__version__, str(batch_size),
             str(max_seq_len), str(dtype), *drafters]
    if layout:  # "" keeps the keys of one-device caches written before layouts were keyed
        ident.append(f"layout {layout}")
    for name in ("config.json", "jspec.json", os.path.join("params", "_METADATA")):
        path = os.path.join(target_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                ident.append(hashlib.sha256(f.read()).hexdigest())
    return hashlib.sha256("\n".join(ident).encode()).hexdigest()[:24]


def read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as error:
        logger.warning("auto: ignoring the unreadable cache %s (%s); measuring again", path, error)
        return None


def same_on_every_process(value: dict) -> dict:
    """``value`` (JSON-able) as process 0 has it, on every process of a multi-process run (jax.distributed);
    ``value`` itself with one process. The candidates' runs are collective programs: every process must time the
    same candidates in the same order and choose the same one, whatever its own cache file or clock says."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buffer = data if jax.process_index() == 0 else np.zeros(size, np.uint8)
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8).tobytes())


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def load_step_cost_prior(model_dir: str) -> list[dict]:
    """The step-cost tables shipped beside a model (STEP_COST_FILE in its directory or its parent, as the bundle
    keeps it; written by scripts/calibrate_auto.py --step-costs), or [] when it ships none. Each entry:
    {"backend", "batch_size", "max_seq_len", "dtype", "layout", "streamed", "host", "date",
    "step_seconds": {timing key: seconds}}."""
    for directory in (model_dir, os.path.dirname(os.path.abspath(model_dir))):
        path = os.path.join(directory, STEP_COST_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                return list(json.load(f)["entries"])
    return []


def prior_entry(prior: Sequence[dict], *, batch_size: int, max_seq_len: int, dtype: str | None, layout: str,
                streamed: bool) -> dict | None:
    """The entry of ``prior`` measured on this backend at exactly this batch size, cache size, dtype, device
    layout and timing mode, or None: step costs measured at other shapes do not transfer."""
    want = {"backend": jax.default_backend(), "batch_size": batch_size, "max_seq_len": max_seq_len,
            "dtype": dtype, "layout": layout, "streamed": streamed}
    return next((e for e in prior if all(e.get(k) == v for k, v in want.items())), None)


def prior_entry_of(choice: AutoChoice, *, batch_size: int, max_seq_len: int, dtype: str | None, layout: str,
                   streamed: bool, host: str, date: str) -> dict:
    """One entry of a model's step-cost prior (:func:`load_step_cost_prior`): the step costs ``choice`` was made
    with, timed on this device (scripts/calibrate_auto.py --step-costs writes them)."""
    if choice.from_prior:
        raise ValueError("prior_entry_of: this choice's step costs are the shipped ones, not timed here")
    step_seconds = {timing_key(e.candidate, timed_acceptance(e.candidate, e.accepted_per_step), streamed):
                    e.step_seconds for e in choice.estimates}
    return {"backend": jax.default_backend(), "batch_size": batch_size, "max_seq_len": max_seq_len, "dtype": dtype,
            "layout": layout, "streamed": streamed, "host": host, "date": date, "step_seconds": step_seconds}


def reject_prior(choice: AutoChoice, measured_speedup: float) -> None:
    """Records in ``choice``'s cache that the shipped step costs it chose by did not hold on this device (the
    chosen method ran at ``measured_speedup`` x plain decoding), so that the next choice times every candidate
    here. Nothing happens for a choice made from this device's own timings or with no cache."""
    if not choice.from_prior or choice.cache_path is None or jax.process_index() != 0:
        return
    cached = read_json(choice.cache_path) or {}
    cached["prior_rejected"] = {"method": choice.best.candidate.label, "measured_speedup": measured_speedup,
                                "expected_speedup": choice.expected_speedup}
    write_json(choice.cache_path, cached)


def load_profile(model_dir: str) -> dict | None:
    """{label: accepted drafts per step} shipped beside a model (PROFILE_FILE in its directory or its parent, as
    the bundle keeps it), or None."""
    for directory in (model_dir, os.path.dirname(os.path.abspath(model_dir))):
        path = os.path.join(directory, PROFILE_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)["accepted"]
    return None
