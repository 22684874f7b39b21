"""The device's half of a structured step: a speculative step split at the drafter's proposal into two programs,
so the host can compute the tree's token masks between them (``jspec.structured_outputs.loop``)."""

from __future__ import annotations

import functools

from jspec.compile_options import setup_jit
from jspec.drafters.base import DraftTree
from jspec.generate import shard_state
from jspec.generate_setup import GenerateSetup
from jspec.sharding import traced_on
from jspec.state import DecodeState
from jspec.step import StepInputs, propose, verify_proposal
from models.llama import unstack_layers


@functools.partial(setup_jit, static_argnames=("setup",), donate_argnames=("state",))
def propose_tree(params_t, params_d, state: DecodeState, inputs: StepInputs, *,
                 setup: GenerateSetup) -> tuple[DecodeState, DraftTree]:
    """The drafter proposes this step's tree -> (the state with the drafter's new state, the tree)."""
    params_t = unstack_layers(params_t, setup.target)
    with traced_on(setup.mesh):
        draft_state, tree = propose(params_t, params_d, state, inputs, setup=setup)
    return state._replace(draft=draft_state), tree


@functools.partial(setup_jit, static_argnames=("setup",), donate_argnames=("state",))
def verify_tree(params_t, params_d, state: DecodeState, tree: DraftTree, inputs: StepInputs, *,
                setup: GenerateSetup) -> DecodeState:
    """Verifies :func:`propose_tree`'s tree under ``inputs.token_bitmask`` (one mask per node), accepts, commits."""
    params_t = unstack_layers(params_t, setup.target)
    with traced_on(setup.mesh):
        state = verify_proposal(params_t, params_d, state, state.draft, tree, inputs, setup=setup)
        return shard_state(state)
