"""Structured generation: prefill, then steps driven by the host, which keeps each row's grammar (an llguidance
matcher) and hands every step the token masks of its nodes.

A speculative step is two programs (``jspec.structured_outputs.programs``): the drafter proposes, the host masks
each tree node from its path's grammar state, the target verifies under those masks and commits; the host then
advances each grammar by the committed tokens. Plain decoding is one program per step (``generate_continue`` of
one step) under the root's mask. Drafts the grammar forbids are rejected at verify (the target gives them
probability 0), so the output is the constrained target's, token for token under greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.generate import GenerateResult, generate_continue, generate_start
from jspec.generate_setup import GenerateSetup
from jspec.sharding import ROWS, put, to_host
from jspec.structured_outputs.programs import propose_tree, verify_tree
from jspec.structured_outputs.tree_masks import advance, constrain_proposal, root_bitmask


def generate_structured(args: tuple, matchers: list, *, setup: GenerateSetup,
                        mesh: jax.sharding.Mesh | None = None) -> GenerateResult:
    """``jspec.generate.generate``'s result for its arguments ``args`` (``SpecEngine._arguments``) with row b
    constrained by matchers[b] (an ``llguidance.LLMatcher`` at its grammar's start, or None: unconstrained).
    The matchers end in the state of each row's output."""
    params_t, params_d = args[0], args[1]
    vocab = setup.target.vocab_size

    def device(bitmask: np.ndarray) -> jax.Array:
        return jnp.asarray(bitmask) if mesh is None else put(bitmask, jax.sharding.NamedSharding(mesh, ROWS))

    state, inputs = generate_start(*args, token_bitmask=device(root_bitmask(matchers, vocab)), setup=setup)
    seen = to_host(args[3])  # prompt_lens: the first new token sits there
    one_step = jnp.asarray(1, jnp.int32)
    all_greedy = bool((to_host(inputs.sampling.temperature) <= 0.0).all())  # verify then ignores draft_probs
    while True:
        seq_len = to_host(state.seq_len)
        advance(matchers, to_host(state.tokens), seen, seq_len)
        seen = seq_len
        done = to_host(state.done)
        if bool(done.all()):
            break
        running = [None if finished else matcher for matcher, finished in zip(matchers, done)]
        if setup.drafter is None:
            inputs = inputs.with_token_bitmask(device(root_bitmask(running, vocab)))
            state = generate_continue(params_t, params_d, state, inputs, one_step, setup=setup)
            continue
        state, tree = propose_tree(params_t, params_d, state, inputs.with_token_bitmask(None), setup=setup)
        tree, bitmask = constrain_proposal(running, tree, vocab, greedy=all_greedy)
        state = verify_tree(params_t, params_d, state, tree, inputs.with_token_bitmask(device(bitmask)),
                            setup=setup)
    return GenerateResult(state.tokens, state.num_generated, state.num_steps, state.accepted_hist, None,
                          state.features.logprobs)
