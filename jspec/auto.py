"""``spec="auto"``: the drafter and tree chosen by measurement, per device and model.

Expected tokens per second of a method = (1 + mean accepted drafts per step) / seconds per step. The two factors
come from different places, because they depend on different things:

- **Seconds per step** depend on the device, the model, the tree and ``max_seq_len``. Each candidate runs with
  ``force_accept`` = its expected accepted drafts, rounded (every step commits that many + 1 tokens, as a real
  step at that acceptance does, so the number of steps is known), and the cost of a step is the difference of two
  runs of different lengths divided by the difference of their step counts: prefill and dispatch cancel. A caller
  that streams one prompt (the CLI) times through ``stream``, one step per chunk: the host sync each step pays
  there is part of its cost, and it favours drafters, which pay it once per several tokens. Where they come from:
  this device's own timings, cached as JSON in ``cache_dir`` per (backend, device kind, JAX version, model,
  drafters, batch size, max_seq_len, mesh); else the model's shipped **prior** (``step_costs.json`` beside its
  parts, timed per backend by scripts/calibrate_auto.py --step-costs) when it was measured at these shapes, so
  that a first run chooses at once; else every candidate is timed now (a minute or more on a CPU: one compile
  each). A prior whose choice then loses to plain decoding on this device is rejected (:func:`reject_prior`) and
  the next run times every candidate; ``jspec tune`` times them whenever asked.
- **Accepted drafts per step** depend on the model and drafter, not the device: the bundled model ships them
  (``acceptance_profile.json`` beside its parts, written by scripts/calibrate_auto.py on calibration prompts
  cut from the Python standard library, not from HumanEval); for any other model they are measured on the same
  calibration prompts at first use and cached with the step costs.

Plain decoding is a candidate (0 accepted drafts, its own step cost), so auto picks it when no drafter pays; a
drafter must be expected to beat it by MIN_GAIN, since a smaller margin is inside the timings' noise.

One approximation: ``ngram+eagle3`` skips the head's drafting forwards on a step where lookup found a draft, and
under forced acceptance the committed drafts make the text repeat, so lookup keeps finding one. Its timed step is
therefore close to the lookup step (plus the head's commit), a lower bound on what a step costs on text where
lookup misses (docs/benchmarks.md compares the expected and the delivered speedup).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Callable, Sequence

import jax
import numpy as np

from jspec.calibration_prompts import CALIBRATION_PROMPTS
from jspec.config import SpecConfig
from jspec.step_cost import step_seconds

logger = logging.getLogger(__name__)

PROFILE_FILE = "acceptance_profile.json"
STEP_COST_FILE = "step_costs.json"
# A drafter must be expected to beat plain decoding by this ratio (the step-cost timings' noise is a few %).
MIN_GAIN = 1.05
# Tokens generated per calibration prompt: `jspec generate`'s default --max-new-tokens. Acceptance grows along a
# completion (a small model repeats itself more as it goes, and prompt lookup finds more), so a shorter
# calibration undercounts it: on the bundled model the n-gram chain of 4 accepted 0.55 drafts per step over 64
# tokens, 1.03 over 128.
CALIBRATION_NEW_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One method auto may choose: a drafter name (None: plain decoding) and its tree."""

    drafter: str | None
    spec: SpecConfig | None

    @property
    def label(self) -> str:
        if self.drafter is None:
            return "plain"
        s = self.spec
        if s.tree == "chain":
            shape = f"chain {s.num_steps}"
        elif s.tree == "dynamic":
            shape = f"dynamic {s.num_steps}x{s.topk}/{s.num_draft_tokens}" + (
                " top1" if s.selection == "top1_chain" else "")
        else:
            shape = f"static {s.tree_size}"
        return f"{self.drafter} {shape}"


def _chain(n: int) -> SpecConfig:
    return SpecConfig(tree="chain", num_steps=n)


def _top1(steps: int, topk: int, tokens: int) -> SpecConfig:
    return SpecConfig(tree="dynamic", num_steps=steps, topk=topk, num_draft_tokens=tokens, selection="top1_chain")


# What auto considers per drafter: few shapes, because each costs one compile when it is timed on a device.
# The EAGLE-3 head's longer chain is left to "ngram+eagle3", which drafts the same chain with lookup in front (at
# least its acceptance, at most its cost plus a lookup). Its chain of 11 (the head drafts 7 of them) and not 7: a
# step where lookup misses verifies the head's 8 nodes either way, and only lookup's steps pay for the longer
# chain, which the timing here charges to every step (docs/results/history.md has the comparison).
CANDIDATE_SPECS: dict[str, tuple[SpecConfig, ...]] = {
    "ngram": (_chain(4), _chain(9)),
    "eagle3": (_chain(3), _top1(6, 3, 12), _top1(8, 4, 24)),
    "ngram+eagle3": (_chain(5), _chain(11)),
    "draft": (_chain(3), _chain(5)),
    "mtp": (_chain(1), _chain(3)),
}


def candidate_specs(drafter: str) -> tuple[SpecConfig, ...]:
    """The trees auto weighs for a drafter: CANDIDATE_SPECS by its name, or by the name a converted directory
    resolves to; a DFlash / DSpark directory's whole block as a chain and half of it; the n-gram shapes for any
    other name."""
    if drafter in CANDIDATE_SPECS:
        return CANDIDATE_SPECS[drafter]
    if os.path.isdir(drafter):
        from jspec.drafters import dflash, resolve

        name, path = resolve(drafter, None)
        if name == "dflash":
            whole = dflash.default_spec(path).num_steps
            return tuple(_chain(n) for n in sorted({max(1, whole // 2), whole}))
        return CANDIDATE_SPECS.get(name, CANDIDATE_SPECS["ngram"])
    return CANDIDATE_SPECS["ngram"]


def candidates(drafters: Sequence[str]) -> list[Candidate]:
    """Plain decoding, then :func:`candidate_specs` of each named drafter."""
    out = [Candidate(None, None)]
    for name in drafters:
        out += [Candidate(name, spec) for spec in candidate_specs(name)]
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    accepted_per_step: float  # mean accepted drafts per verify step (0 for plain decoding)
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return (1.0 + self.accepted_per_step) / self.step_seconds


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The chosen method and every estimate behind it (best first)."""

    drafter: str | None
    spec: SpecConfig | None
    estimates: tuple[Estimate, ...]
    source: str  # where the numbers came from, for the user
    from_prior: bool = False  # the step costs are the model's shipped ones, not this device's (reject_prior)
    cache_path: str | None = None  # the JSON file this device's timings are cached in, None when not cached

    @property
    def best(self) -> Estimate:
        return self.estimates[0]

    @property
    def plain(self) -> Estimate:
        return next(e for e in self.estimates if e.candidate.drafter is None)

    @property
    def expected_speedup(self) -> float:
        return self.best.tokens_per_second / self.plain.tokens_per_second

    def summary(self) -> str:
        return (f"auto chose {self.best.candidate.label}: expected {self.expected_speedup:.2f}x plain decoding "
                f"({self.source})")

    def describe(self) -> str:
        """The whole table: what each candidate was expected to do, best first."""
        lines = [self.summary(), f"{'method':28s} {'accepted/step':>13s} {'step ms':>8s} {'tok/s':>8s} "
                                 f"{'vs plain':>8s}"]
        for e in self.estimates:
            lines.append(f"{e.candidate.label:28s} {e.accepted_per_step:13.2f} {e.step_seconds * 1e3:8.2f} "
                         f"{e.tokens_per_second:8.0f} {e.tokens_per_second / self.plain.tokens_per_second:7.2f}x")
        lines.append("expected tok/s = (1 + accepted drafts per step) / step seconds; plain decoding is a candidate")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"drafter": self.drafter, "spec": dataclasses.asdict(self.spec) if self.spec else None,
                "expected_speedup": self.expected_speedup, "source": self.source, "from_prior": self.from_prior,
                "candidates": [{"method": e.candidate.label, "accepted_per_step": e.accepted_per_step,
                                "step_ms": e.step_seconds * 1e3, "expected_tokens_per_second": e.tokens_per_second}
                               for e in self.estimates]}


def choose(accepted: dict[str, float], step_seconds: dict[str, float], pool: Sequence[Candidate],
           source: str = "", min_gain: float = 1.0) -> AutoChoice:
    """The candidate of ``pool`` with the most expected tokens/s. accepted / step_seconds: by candidate label
    (plain's acceptance is 0 by definition). A candidate missing from either is skipped; plain must be timed.
    A drafter is chosen only when it is expected to beat plain decoding by ``min_gain`` (a ratio >= 1): a
    smaller margin is inside the error of the estimate."""
    if min_gain < 1.0:
        raise ValueError(f"min_gain={min_gain}: expected a ratio >= 1")
    estimates = []
    for candidate in pool:
        label = candidate.label
        if label not in step_seconds or (candidate.drafter is not None and label not in accepted):
            continue
        if step_seconds[label] <= 0:
            raise ValueError(f"step_seconds[{label!r}]={step_seconds[label]}: expected a positive number")
        estimates.append(Estimate(candidate, 0.0 if candidate.drafter is None else float(accepted[label]),
                                  float(step_seconds[label])))
    if not any(e.candidate.drafter is None for e in estimates):
        raise ValueError("choose: plain decoding must be among the timed candidates")
    estimates.sort(key=lambda e: -e.tokens_per_second)
    plain = next(e for e in estimates if e.candidate.drafter is None)
    if estimates[0].tokens_per_second < min_gain * plain.tokens_per_second:
        estimates.remove(plain)
        estimates.insert(0, plain)
    best = estimates[0].candidate
    return AutoChoice(best.drafter, best.spec, tuple(estimates), source)


# --- measuring ----------------------------------------------------------------------------------------------------

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


def _read_json(path: str) -> dict | None:
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


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def measure_step_seconds(make_engine: Callable[[Candidate, int | None], object], candidate: Candidate,
                         prompt: list[int], short: int = 4, long: int = 24, repeats: int = 5, accept: int = 0,
                         streamed: bool = False) -> float:
    """Seconds per step of ``candidate``: ``make_engine(candidate, force_accept)`` runs with force_accept=``accept``
    (every step commits accept + 1 tokens, as a step at that acceptance would); the fastest of ``repeats`` runs of
    ``long`` steps minus the fastest of ``repeats`` of ``short``, over their difference in steps
    (``jspec.step_cost.step_seconds``). ``streamed``: the runs go through ``engine.stream`` one step per chunk, so
    each step also pays its host sync (what a caller streaming one prompt sees); else through ``generate`` (the
    whole loop on the device)."""
    engine = make_engine(candidate, None if candidate.drafter is None else accept)
    per_step = 1 if candidate.drafter is None else accept + 1

    def run(steps: int) -> tuple[float, int]:
        new_tokens = steps * per_step + 1
        if not streamed:
            stats = engine.generate([prompt], max_new_tokens=new_tokens).stats
            return stats.run_seconds, stats.num_verify_steps
        started, chunks = time.perf_counter(), 0
        for _ in engine.stream([prompt], max_new_tokens=new_tokens):
            chunks += 1
        return time.perf_counter() - started, chunks - 1

    # its first runs compile both (their token slots may fall in different power-of-two buckets)
    return step_seconds(run, short=short, long=long, repeats=repeats)


def measure_acceptance(make_engine: Callable[[Candidate, int | None], object], candidate: Candidate,
                       prompts: Sequence[list[int]],
                       max_new_tokens: int = CALIBRATION_NEW_TOKENS) -> float:
    """Mean accepted drafts per verify step of ``candidate`` over ``prompts`` (greedy, one prompt at a time)."""
    engine = make_engine(candidate, None)
    committed = steps = 0.0
    for prompt in prompts:
        stats = engine.generate([prompt], max_new_tokens=max_new_tokens).stats
        committed += stats.acceptance_length * stats.num_verify_steps
        steps += stats.num_verify_steps
    return committed / max(steps, 1.0) - 1.0


def timing_key(candidate: Candidate, accept: int, streamed: bool) -> str:
    return f"{candidate.label} | accept {accept} | {'streamed' if streamed else 'loop'}"


def timed_acceptance(candidate: Candidate, accepted: float) -> int:
    """The force_accept a candidate's step is timed at: its expected accepted drafts, rounded, within its depth."""
    return 0 if candidate.drafter is None else max(0, min(round(accepted), candidate.spec.num_steps))


def calibration_prompts(tokenize: Callable[[str], list[int]], max_seq_len: int) -> tuple[list[list[int]], int]:
    """(CALIBRATION_PROMPTS as token ids, new tokens per prompt), fitted to ``max_seq_len``: at most half of it
    generated, each prompt cut to its last tokens."""
    new_tokens = max(2, min(CALIBRATION_NEW_TOKENS, max_seq_len // 2))
    return [tokenize(p)[-(max_seq_len - new_tokens):] for p in CALIBRATION_PROMPTS], new_tokens


def timing_prompt(tokenize: Callable[[str], list[int]], max_seq_len: int) -> list[int]:
    """The prompt every candidate's step is timed on: CALIBRATION_PROMPTS joined, a code prompt's length (a
    couple of hundred tokens: with CALIBRATION_NEW_TOKENS more, the cache size a `jspec generate` of a typical
    code prompt runs at), cut to its last ``max_seq_len // 4`` tokens where the cache is smaller."""
    return tokenize("\n\n".join(CALIBRATION_PROMPTS))[-max(1, max_seq_len // 4):]


def timing_run_lengths(prompt_len: int, per_step: int, max_seq_len: int,
                       new_tokens: int = CALIBRATION_NEW_TOKENS) -> tuple[int, int]:
    """(short, long) verify steps of a step's two timing runs (:func:`measure_step_seconds`), each committing
    ``per_step`` tokens a step after the prefill's one. Every candidate's runs use the token slots (the cache
    size, ``jspec.batching.pad_batch``'s bucket) of this prompt and ``new_tokens``: attention reads the whole
    cache, so a step's cost depends on it, and the candidates are compared as the same call would run them. The
    long run fills those slots, the short one needs them just as well: one compiled program, differing in steps
    only (a long run on a larger cache than the short one's made the fused loop's step look dearer than the same
    step streamed)."""
    from jspec.batching import next_power_of_two, prompt_bucket

    width = prompt_bucket(prompt_len, max_seq_len)
    slots = lambda steps: min(next_power_of_two(width + steps * per_step + 1), max_seq_len)  # noqa: E731
    target = slots(-(-new_tokens // per_step))
    long = max(2, (target - width - 1) // per_step)
    short = next(n for n in range(1, long + 1) if slots(n) == slots(long))
    return min(short, long - 1), long


def time_candidates(make_engine: Callable[[Candidate, int | None], object], pool: Sequence[Candidate],
                    accepted: dict[str, float], prompt: list[int], *, max_seq_len: int, streamed: bool,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, float]:
    """{timing key: seconds per step} of every candidate of ``pool``, each timed at its expected acceptance
    (``accepted``: {label: accepted drafts per step}) on ``prompt`` (:func:`measure_step_seconds`)."""
    timings = {}
    for candidate in pool:
        accept = timed_acceptance(candidate, accepted.get(candidate.label, 0.0))
        short, long = timing_run_lengths(len(prompt), 1 if candidate.drafter is None else accept + 1, max_seq_len)
        key = timing_key(candidate, accept, streamed)
        timings[key] = measure_step_seconds(make_engine, candidate, prompt, short=short, long=long,
                                            accept=accept, streamed=streamed)
        log(f"auto:   {candidate.label}: {timings[key] * 1e3:.2f} ms per step")
    return timings


# --- the step-cost prior a model ships -------------------------------------------------------------------------

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


def prior_entry_of(choice: "AutoChoice", *, batch_size: int, max_seq_len: int, dtype: str | None, layout: str,
                   streamed: bool, host: str, date: str) -> dict:
    """One entry of a model's step-cost prior (:func:`load_step_cost_prior`): the step costs ``choice`` was made
    with, timed on this device (scripts/calibrate_auto.py --step-costs writes them)."""
    if choice.from_prior:
        raise ValueError("prior_entry_of: this choice's step costs are the shipped ones, not timed here")
    step_seconds = {timing_key(e.candidate, timed_acceptance(e.candidate, e.accepted_per_step), streamed):
                    e.step_seconds for e in choice.estimates}
    return {"backend": jax.default_backend(), "batch_size": batch_size, "max_seq_len": max_seq_len, "dtype": dtype,
            "layout": layout, "streamed": streamed, "host": host, "date": date, "step_seconds": step_seconds}


def reject_prior(choice: "AutoChoice", measured_speedup: float) -> None:
    """Records in ``choice``'s cache that the shipped step costs it chose by did not hold on this device (the
    chosen method ran at ``measured_speedup`` x plain decoding), so that the next choice times every candidate
    here. Nothing happens for a choice made from this device's own timings or with no cache."""
    if not choice.from_prior or choice.cache_path is None or jax.process_index() != 0:
        return
    cached = _read_json(choice.cache_path) or {}
    cached["prior_rejected"] = {"method": choice.best.candidate.label, "measured_speedup": measured_speedup,
                                "expected_speedup": choice.expected_speedup}
    _write_json(choice.cache_path, cached)


def auto_choice(target_dir: str, drafters: Sequence[str], make_engine: Callable[[Candidate, int | None], object],
                tokenize: Callable[[str], list[int]], *, cache_dir: str | None, batch_size: int = 1,
                max_seq_len: int = 1024, dtype: str | None = None, profile: dict | None = None,
                prior: Sequence[dict] = (), streamed: bool = False, min_gain: float = MIN_GAIN, layout: str = "",
                retime: bool = False, log: Callable[[str], None] = lambda s: None) -> AutoChoice:
    """Chooses among plain decoding and ``drafters`` (names) for ``target_dir``. make_engine(candidate,
    force_accept) builds an engine at this batch size and max_seq_len. profile: {label: accepted drafts per step}
    (the shipped one), or None to measure on CALIBRATION_PROMPTS. Each step is timed at its candidate's
    expected acceptance, through ``stream`` when ``streamed`` (one host sync per step, as a caller streaming one
    prompt pays) or ``generate``. A drafter must beat plain decoding by ``min_gain`` (a ratio) to be chosen.

    Step costs come from, in order: this device's own timings cached in ``cache_dir``/auto (None: nothing is
    cached), keyed with ``layout`` (the mesh); the model's shipped ``prior`` (:func:`load_step_cost_prior`) when
    one entry was measured on this backend at these shapes and covers every candidate, and no earlier run here
    rejected it (:func:`reject_prior`); else every candidate is timed now and cached (``retime``: every one,
    whatever is cached). With several processes, process 0's cache and timings decide for all
    (:func:`same_on_every_process`); only it writes the cache."""
    pool = candidates(drafters)
    path = None
    cached = {}
    if cache_dir is not None:
        path = os.path.join(cache_dir, "auto", cache_key(target_dir, drafters, batch_size, max_seq_len, dtype,
                                                         layout) + ".json")
        cached = _read_json(path) or {}
    cached = same_on_every_process(cached)
    timings = {} if retime else dict(cached.get("step_seconds", {}))
    accepted = dict(profile) if profile is not None else dict(cached.get("accepted", {}))
    prompts, new_tokens = calibration_prompts(tokenize, max_seq_len)
    todo = [c for c in pool if c.drafter is not None and c.label not in accepted]
    if todo:
        log(f"auto: measuring the acceptance of {len(todo)} methods on {len(prompts)} calibration prompts")
    for candidate in todo:
        accepted[candidate.label] = measure_acceptance(make_engine, candidate, prompts, new_tokens)
        log(f"auto:   {candidate.label}: {accepted[candidate.label]:.2f} accepted drafts per step")
    keys = {c.label: timing_key(c, timed_acceptance(c, accepted.get(c.label, 0.0)), streamed) for c in pool}
    entry = prior_entry(prior, batch_size=batch_size, max_seq_len=max_seq_len, dtype=dtype, layout=layout,
                        streamed=streamed)
    from_prior = (not retime and entry is not None and "prior_rejected" not in cached
                  and any(k not in timings for k in keys.values())
                  and all(k in entry["step_seconds"] for k in keys.values()))
    if from_prior:
        timings = {k: float(entry["step_seconds"][k]) for k in keys.values()}
    else:
        todo = [c for c in pool if keys[c.label] not in timings]
        if todo:
            why = " (the shipped step costs did not hold here)" if "prior_rejected" in cached else ""
            log(f"auto: timing {len(todo)} methods once on this device{why} (cached in "
                f"{os.path.dirname(path) if path else 'nowhere'})")
        timings.update(time_candidates(make_engine, todo, accepted, timing_prompt(tokenize, max_seq_len),
                                       max_seq_len=max_seq_len, streamed=streamed, log=log))
        timings, accepted = same_on_every_process(timings), same_on_every_process(accepted)
        if path is not None and jax.process_index() == 0 and (
                cached.get("step_seconds") != timings or (profile is None and cached.get("accepted") != accepted)):
            _write_json(path, {"step_seconds": timings, **({} if profile is not None else {"accepted": accepted})})
    steps = {c.label: timings[keys[c.label]] for c in pool}
    if from_prior:
        costs = (f"step costs shipped with the model, measured on {entry.get('host', 'an unnamed host')} "
                 f"(`jspec tune` times them here)")
    else:
        costs = "step costs measured on this device" + (" at the expected acceptance" if profile is not None else "")
    acceptance = "acceptance from the model's calibration profile" if profile is not None else (
        "acceptance measured on this device")
    source = ("streamed " if streamed else "") + f"{costs}; {acceptance}"
    choice = choose(accepted, steps, pool, source, min_gain=min_gain)
    return dataclasses.replace(choice, from_prior=from_prior, cache_path=path)



def load_profile(model_dir: str) -> dict | None:
    """{label: accepted drafts per step} shipped beside a model (PROFILE_FILE in its directory or its parent, as
    the bundle keeps it), or None."""
    for directory in (model_dir, os.path.dirname(os.path.abspath(model_dir))):
        path = os.path.join(directory, PROFILE_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)["accepted"]
    return None


def calibrate_profile(drafters: Sequence[str], make_engine: Callable[[Candidate, int | None], object],
                      tokenize: Callable[[str], list[int]],
                      max_new_tokens: int = CALIBRATION_NEW_TOKENS) -> dict:
    """{"accepted": {label: accepted drafts per step}, ...} of every candidate of ``drafters`` on
    CALIBRATION_PROMPTS (greedy): the profile a model ships as PROFILE_FILE (scripts/calibrate_auto.py)."""
    prompts = [tokenize(p) for p in CALIBRATION_PROMPTS]
    accepted = {c.label: measure_acceptance(make_engine, c, prompts, max_new_tokens)
                for c in candidates(drafters) if c.drafter is not None}
    return {"accepted": accepted, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "note": "mean accepted drafts per verify step, greedy, float32, one prompt at a time; "
                    "written by scripts/calibrate_auto.py"}


# --- the engine auto chooses -------------------------------------------------------------------------------------

AUTO_DRAFTERS = ("eagle3", "ngram+eagle3", "draft", "ngram", "mtp")


def available_drafters(target_dir: str, drafter: str | os.PathLike | None) -> list[str]:
    """The drafters auto weighs for ``target_dir``: ``drafter`` alone when one is named (its trees), else every
    AUTO_DRAFTERS entry that resolves for this model (the bundled model has the head and the draft model)."""
    from jspec.drafters import resolve

    if drafter is not None:
        resolve(os.fspath(drafter), target_dir)
        return [os.fspath(drafter)]
    names = []
    for name in AUTO_DRAFTERS:
        try:
            resolve(name, target_dir)
        except (ValueError, FileNotFoundError):
            continue
        names.append(name)
    return names


def from_pretrained_auto(engine_cls, target_dir: str, drafter: str | os.PathLike | None, *, max_batch_size: int,
                         max_seq_len: int, dtype: str | None, tensor_parallel_size: int = 1,
                         data_parallel_size: int = 1, mesh=None, cache_dir: str | os.PathLike | None = None,
                         log: Callable[[str], None] | None = None, streamed: bool = False, retime: bool = False):
    """``engine_cls.from_pretrained(target_dir, spec="auto")``: the engine of the method :func:`auto_choice`
    picks among plain decoding and :func:`available_drafters`, with ``engine.auto_choice`` saying what was chosen
    and why. ``retime``: time every candidate on this device now, whatever is cached or shipped (`jspec tune`).
    Each candidate's weights are loaded once; its timing runs use a forced-acceptance view of the same engine."""
    from jspec.tokenizer import load_tokenizer

    names = available_drafters(target_dir, drafter)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise ValueError(f"spec='auto' calibrates on text prompts, but {target_dir} has no tokenizer")
    kwargs = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                  tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size, mesh=mesh)
    built: dict = {}

    def make_engine(candidate: Candidate, force_accept: int | None):
        if candidate.label not in built:
            built[candidate.label] = engine_cls.from_pretrained(target_dir, drafter=candidate.drafter,
                                                                spec=candidate.spec, **kwargs)
        engine = built[candidate.label]
        return engine if force_accept is None or candidate.drafter is None else engine.forcing_acceptance(
            force_accept)

    layout = mesh_layout(tensor_parallel_size, data_parallel_size, mesh, jax.process_count())
    choice = auto_choice(target_dir, names, make_engine, lambda text: tokenizer.encode(text).ids,
                         cache_dir=None if cache_dir is None else os.fspath(cache_dir), batch_size=max_batch_size,
                         max_seq_len=max_seq_len, dtype=dtype, profile=load_profile(target_dir),
                         prior=() if retime else load_step_cost_prior(target_dir), streamed=streamed,
                         retime=retime, log=log or (lambda s: None), layout=layout)
    engine = make_engine(choice.best.candidate, None)
    engine.auto_choice = choice
    return engine
