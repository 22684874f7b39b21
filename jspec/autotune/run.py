"""Choosing for a model on this device: :func:`auto_choice` gathers acceptance and step costs (cached, shipped or
measured now) and lets :func:`jspec.auto.choose` pick; :func:`from_pretrained_auto` is
``SpecEngine.from_pretrained(spec="auto")``.

Step costs come from this device's own timings, cached in ``cache_dir`` (:mod:`jspec.autotune.store`); else the
model's shipped prior when it was measured at these shapes, so that a first run chooses at once; else every
candidate is timed now (a minute or more on a CPU: one compile each). A prior whose choice then loses to plain
decoding on this device is rejected (:func:`jspec.autotune.store.reject_prior`) and the next run times every
candidate; ``jspec tune`` times them whenever asked. Acceptance comes from the model's calibration profile, or is
measured on the calibration prompts at first use and cached with the step costs."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import jax

from jspec.auto import MIN_GAIN, AutoChoice, Candidate, available_drafters, candidates, choose
from jspec.autotune.store import (cache_key, load_profile, load_step_cost_prior, mesh_layout, prior_entry,
                                  read_json, same_on_every_process, write_json)
from jspec.autotune.timing import (calibration_prompts, measure_acceptance, time_candidates, timed_acceptance,
                                   timing_key, timing_prompt)


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
        cached = read_json(path) or {}
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
            write_json(path, {"step_seconds": timings, **({} if profile is not None else {"accepted": accepted})})
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
