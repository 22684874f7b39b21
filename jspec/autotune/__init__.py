"""``spec="auto"``'s measuring, outside the core (:mod:`jspec.auto` keeps the choice from costs and acceptance):
timing runs and calibration (:mod:`.timing`), the disk cache, the cross-process agreement and what a model ships
(:mod:`.store`), and the choice for a model on this device (:mod:`.run`)."""

from jspec.autotune.run import auto_choice, from_pretrained_auto
from jspec.autotune.store import (PROFILE_FILE, STEP_COST_FILE, cache_key, load_profile, load_step_cost_prior,
                                  mesh_layout, prior_entry, prior_entry_of, reject_prior, same_on_every_process)
from jspec.autotune.timing import (CALIBRATION_NEW_TOKENS, calibrate_profile, calibration_prompts,
                                   measure_acceptance, measure_step_seconds, time_candidates, timed_acceptance,
                                   timing_key, timing_prompt, timing_run_lengths)

__all__ = ["CALIBRATION_NEW_TOKENS", "PROFILE_FILE", "STEP_COST_FILE", "auto_choice", "cache_key",
           "calibrate_profile", "calibration_prompts", "from_pretrained_auto", "load_profile", "load_step_cost_prior",
           "measure_acceptance", "measure_step_seconds", "mesh_layout", "prior_entry", "prior_entry_of",
           "reject_prior", "same_on_every_process", "time_candidates", "timed_acceptance", "timing_key",
           "timing_prompt", "timing_run_lengths"]
