"""One step of the generation loop.

``spec_step`` is the fused speculative step: draft a tree, verify it in one target pass, accept, commit tokens
and K/V. ``plain_step`` is autoregressive decoding (drafter=None): the baseline every speedup is measured
against, through the same commit path.

When capturing hidden states (``GenerateSetup.capture_layers``), each step also writes the target's states of the
tokens it commits that the target ran on: the root and the accepted drafts, at positions cache_len ..
cache_len + num_committed - 1 (the last committed token is the next root; its states come with the next step).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.accept import accept_tree
from jspec.commit import commit_tokens
from jspec.config import SpecConfig
from jspec.drafters.base import CommitContext, DraftTree
from jspec.kv_cache import commit_path
from jspec.features import FeatureInputs, shaped_logits, with_captured, with_logprobs
from jspec.logits_processors import path_counts
from jspec.logprobs import recorded_logits
from jspec.sampling import SamplingArrays, fold_rows, keys_at, sample_tokens
from jspec.sharding import TAPS, constrain
from jspec.generate_setup import GenerateSetup
from jspec.state import DecodeState


class StepInputs(NamedTuple):
    """Per-call values the loop body reads (arrays, so they never recompile)."""

    max_new_tokens: jax.Array  # i32[B]
    stop_ids: jax.Array        # i32[B, K], -1 padded
    sampling: SamplingArrays
    keys: jax.Array            # key[B] each row's base key; a step's key is keys_at(keys, seq_len): the row's own
                               # position, never its slot or the loop's step count
    features: FeatureInputs = FeatureInputs()  # the optional features' inputs (jspec.features), each None when off

    def with_token_bitmask(self, token_bitmask: jax.Array | None) -> "StepInputs":
        """These inputs with a grammar's masks (``FeatureInputs.token_bitmask``), or None for none."""
        return self._replace(features=self.features._replace(token_bitmask=token_bitmask))


def last_tokens(state: DecodeState) -> jax.Array:
    """i32[B] the last committed token of each sequence (the root of the next step)."""
    return jnp.take_along_axis(state.tokens, (state.seq_len - 1)[:, None], axis=1)[:, 0]


def plain_step(params_t, params_d, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup) -> DecodeState:
    """Runs the target on each sequence's last token, samples the next one, commits it."""
    del params_d
    keys = keys_at(inputs.keys, state.seq_len)
    out, next_token, recorded = decode_one(params_t, state, last_tokens(state), inputs, keys, setup=setup)
    # A done sequence's cache_len is frozen, so its rewrite of slot cache_len harms nothing.
    cache_len = state.cache_len
    state = state._replace(cache=out.cache)
    state, committed = commit_tokens(state, next_token[:, None], jnp.ones_like(cache_len), inputs.max_new_tokens,
                                     inputs.stop_ids)
    state = capture_committed(state, out.taps, cache_len, committed, setup=setup)
    features = with_logprobs(state.features, lambda: recorded, next_token[:, None], cache_len + 1, committed)
    return state._replace(step=state.step + 1, features=features)


def capture_committed(state: DecodeState, taps: jax.Array | None, cache_len: jax.Array, committed: jax.Array, *,
                      setup: GenerateSetup, path: jax.Array | None = None) -> DecodeState:
    """Writes the capture layers' states of a step's first ``committed[b]`` path nodes into
    ``state.features.hidden_states``, node n at position cache_len[b] + n; identity when not capturing. A done row
    commits 0.

    taps: the target's [len(setup.tap_layers), B, N, H]; path: i32[B, D + 1] the accepted path's node ids (root
    first, -1 padded), or None when the N nodes are the path."""
    def states():
        captured = setup.captured_taps(taps)
        if path is None:
            return captured
        return jnp.take_along_axis(captured, jnp.maximum(path, 0)[None, :, :, None], axis=2)

    return state._replace(features=with_captured(state.features, states, cache_len, committed))


def decode_one(params_t, state: DecodeState, token: jax.Array, inputs: StepInputs, keys: jax.Array, *,
               setup: GenerateSetup):
    """The target on one token per sequence (token i32[B], written at slot cache_len) -> (its DecoderOutput,
    the next token i32[B] sampled from the target's distribution, the logits f32[B, 1, V] its log-probability is
    recorded from: ``jspec.logprobs.recorded_logits``)."""
    out = target_on_token(params_t, state, token, setup=setup)
    return (out, *sample_one(state, out.logits, inputs, keys, setup=setup))


def target_on_token(params_t, state: DecodeState, token: jax.Array, *, setup: GenerateSetup):
    """The target on token i32[B] at each sequence's slot cache_len (its K/V written there) -> its DecoderOutput."""
    cache_len = state.cache_len
    return setup.target_model().apply({"params": params_t}, token[:, None], cache_len[:, None], state.cache,
                                      cache_len, tap_layers=setup.tap_layers)


def sample_one(state: DecodeState, raw_logits: jax.Array, inputs: StepInputs, keys: jax.Array, *,
               setup: GenerateSetup) -> tuple[jax.Array, jax.Array]:
    """The next token i32[B] drawn from the target's logits f32[B, 1, V] at each sequence's last token, shaped by
    the request's features (grammar mask, logits processors) -> (it, the logits its log-probability is recorded
    from)."""
    def history():
        return state.features.output_counts[:, None], state.num_generated[:, None]

    logits = shaped_logits(raw_logits, inputs.features, history, inputs.stop_ids)
    recorded = recorded_logits(raw_logits, logits, inputs.sampling, setup.logprobs_mode)
    return sample_tokens(logits[:, 0], inputs.sampling, keys), recorded


def path_tokens(tree_tokens: jax.Array, verified) -> tuple[jax.Array, jax.Array]:
    """-> (new_tokens i32[B, D + 1]: accepted drafts then the bonus, num_new i32[B] = accept_length + 1)."""
    path = jnp.take_along_axis(tree_tokens, jnp.maximum(verified.accept_index, 0), axis=1)  # root first
    drafts = jnp.concatenate([path[:, 1:], jnp.zeros_like(path[:, :1])], axis=1)
    index = jnp.arange(path.shape[1])[None]
    new_tokens = jnp.where(index == verified.accept_length[:, None], verified.bonus[:, None], drafts)
    return new_tokens, verified.accept_length + 1


def spec_step(params_t, params_d, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup,
              short_nodes: int | None = None) -> DecodeState:
    """propose -> verify the tree with the target -> accept -> commit tokens and both models' K/V.

    When the drafter reports ``tree.drafted`` and no running sequence drafted anything, the T-token verify pass is
    skipped (``lax.cond``: only the taken branch runs) and the target decodes the root alone, as plain decoding
    would; this step then commits one token per sequence. When the drafter has ``short_chain_nodes`` and no running
    row drafted its whole chain (``tree.full``), only those first nodes are verified.

    short_nodes (a chain's, see :func:`short_draft_nodes`): every row verifies only the chain's first
    ``short_nodes`` nodes (root included), a narrower target pass: the server's program for high occupancy
    (TensorRT-LLM's ``draft_len_schedule``). The accepted tokens are the target's either way; a row only accepts
    fewer per step. A static choice, not a branch: a conditional of two verify passes that both write the paged
    KV pool makes XLA copy the pool.
    """
    draft_state, tree = propose(params_t, params_d, state, inputs, setup=setup)
    return verify_proposal(params_t, params_d, state, draft_state, tree, inputs, setup=setup,
                           short_nodes=short_nodes)


def propose(params_t, params_d, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup):
    """The drafter's proposal for this step -> (its new state, the DraftTree); :func:`spec_step`'s first half."""
    step_keys = keys_at(inputs.keys, state.seq_len)
    return setup.drafter.propose(params_t, params_d, state.draft, last_tokens(state), state.cache_len,
                                 sampling=inputs.sampling, key=fold_rows(step_keys, 1))


def verify_proposal(params_t, params_d, state: DecodeState, draft_state, tree: DraftTree, inputs: StepInputs, *,
                    setup: GenerateSetup, short_nodes: int | None = None) -> DecodeState:
    """:func:`spec_step`'s second half: verify ``tree`` (from :func:`propose` on the same state), accept,
    commit. Structured outputs run the halves as two programs, the tree's token masks computed on the host between
    them (``jspec.structured_outputs``)."""
    drafter = setup.drafter
    step_keys = keys_at(inputs.keys, state.seq_len)
    max_depth = setup.spec.max_depth
    if short_nodes is not None and setup.force_accept is None:
        tree, max_depth = truncated_chain(tree, short_nodes), short_nodes - 1
    verify = functools.partial(_verify_tree, params_t, params_d, inputs=inputs, setup=setup, keys=step_keys,
                               max_depth=max_depth)
    short = drafter.short_chain_nodes
    if tree.full is not None and short is not None and short <= max_depth and setup.force_accept is None:
        def verify_short(state, draft_state, tree):
            return _verify_tree(params_t, params_d, state, draft_state, truncated_chain(tree, short), inputs=inputs,
                                setup=setup, keys=step_keys, max_depth=short - 1)

        return jax.lax.cond(jnp.all(tree.full | state.done), verify, verify_short, state, draft_state, tree)
    if tree.drafted is None or setup.force_accept is not None:
        return verify(state, draft_state, tree)
    root_only = functools.partial(_decode_root, params_t, params_d, inputs=inputs, setup=setup, keys=step_keys)
    speculate = jnp.any(tree.drafted & ~state.done)
    return jax.lax.cond(speculate, verify, root_only, state, draft_state, tree)


def short_draft_nodes(spec: SpecConfig | None, draft_len: int) -> int | None:
    """The nodes (root included) a step verifies at a shorter draft length ``draft_len`` (>= 1) of the drafter's
    tree ``spec``, or None where none is shorter: only a chain can be cut (its first nodes are a chain of their
    own)."""
    if not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"draft_len={draft_len!r}: expected an integer >= 1")
    if spec is None or spec.tree != "chain" or draft_len >= spec.max_depth:
        return None
    return draft_len + 1


def truncated_chain(tree: DraftTree, nodes: int) -> DraftTree:
    """A chain's first ``nodes`` nodes (root included) as a chain of its own: the last one has no child (``full``
    is kept: whether each row drafted more than a shorter chain still tells)."""
    def cut(x):
        return None if x is None else x[:, :nodes]

    next_token = tree.next_token[:, :nodes].at[:, nodes - 1].set(-1)
    return tree._replace(tokens=cut(tree.tokens), mask=tree.mask[:, :nodes, :nodes], positions=cut(tree.positions),
                         next_token=next_token, next_sibling=cut(tree.next_sibling),
                         draft_probs=cut(tree.draft_probs))


def capped_tree(tree: DraftTree, max_drafts: jax.Array, cache_len: jax.Array) -> DraftTree:
    """Each row's tree cut below depth max_drafts i32[B] (its nodes there keep no children): the walk accepts at
    most that many drafts and draws its token where it stops, as a drafter of that length would, greedy and sampled
    alike (``SamplingParams.num_speculative_tokens``). The nodes below still run through the target, unread."""
    depth = tree.positions - cache_len[:, None]
    return tree._replace(next_token=jnp.where(depth >= max_drafts[:, None], -1, tree.next_token))


def _verify_tree(params_t, params_d, state: DecodeState, draft_state, tree, *, inputs: StepInputs,
                 setup: GenerateSetup, keys: jax.Array, max_depth: int | None = None) -> DecodeState:
    """The target over all T tree nodes, acceptance, then commit of tokens, the drafter's state and the K/V.
    max_depth: the tree's deepest node (default the spec's)."""
    cache_len = state.cache_len
    out = setup.target_model().apply({"params": params_t}, tree.tokens, tree.positions, state.cache, cache_len,
                                     local_mask=tree.mask, tap_layers=setup.tap_layers)
    def history():  # each node's own: the committed output, then its path
        def counts():
            return state.features.output_counts[:, None] + path_counts(tree.tokens, tree.mask, out.logits.shape[-1])

        return counts, state.num_generated[:, None] + tree.positions - cache_len[:, None]

    logits = shaped_logits(out.logits, inputs.features, history, inputs.stop_ids)
    if inputs.sampling.max_drafts is not None:
        tree = capped_tree(tree, inputs.sampling.max_drafts, cache_len)
    verified = accept_tree(tree, logits, inputs.sampling, keys,
                           max_depth=setup.spec.max_depth if max_depth is None else max_depth,
                           force_accept=setup.force_accept, kernels=setup.spec.kernels)
    new_tokens, num_new = path_tokens(tree.tokens, verified)
    state, committed = commit_tokens(state, new_tokens, num_new, inputs.max_new_tokens, inputs.stop_ids)
    def path_logits():  # new token i was drawn from the distribution at path node i (the root first)
        source = recorded_logits(out.logits, logits, inputs.sampling, setup.logprobs_mode)
        return jnp.take_along_axis(source, jnp.maximum(verified.accept_index, 0)[..., None], axis=1)

    state = state._replace(features=with_logprobs(state.features, path_logits, new_tokens, cache_len + 1, committed))
    draft_state = setup.drafter.commit(params_t, params_d, draft_state,
                                       CommitContext(new_tokens, committed, verified.accept_index,
                                                     constrain(setup.drafter_taps(out.taps), TAPS),
                                                     cache_len))
    cache = commit_path(out.cache, verified.accept_index, cache_len)
    state = capture_committed(state, out.taps, cache_len, committed, setup=setup, path=verified.accept_index)
    return state._replace(cache=cache, draft=draft_state, step=state.step + 1)


def _decode_root(params_t, params_d, state: DecodeState, draft_state, tree, *, inputs: StepInputs,
                 setup: GenerateSetup, keys: jax.Array) -> DecodeState:
    """No drafts to verify: the target runs on the root (node 0) only and samples the next token from its own
    distribution; the drafter commits it as a step that accepted nothing. Buffers keep the verify path's shapes."""
    return _root_and_commit(params_t, params_d, state, draft_state, tree.tokens[:, 0], tree.tokens.shape[1],
                            inputs=inputs, setup=setup, keys=keys)


class RootForward(NamedTuple):
    """What :func:`root_forward` hands :func:`root_commit`: the target's logits f32[B, 1, V] at each sequence's
    last token (before any feature shapes them) and the states of its tap layers ([L, B, 1, H], or None)."""

    logits: jax.Array
    taps: jax.Array | None


def root_step(params_t, params_d, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup) -> DecodeState:
    """Plain decoding that keeps the drafter's state current: the target decodes each sequence's last token and
    the drafter commits it (one narrow drafter forward; no proposal, no T-token verify pass).

    The server switches to this step under load (``jspec.serve.adapt``) and back: a drafter's ``commit`` rewrites
    its window from the committed tokens (the "extend"), so it never needs a preceding ``propose``. The token
    drawn is the target's own (as in plain decoding), so greedy output is unchanged.
    """
    state, forward = root_forward(params_t, state, setup=setup)
    return root_commit(params_t, params_d, state, forward, inputs, setup=setup)


def root_forward(params_t, state: DecodeState, *, setup: GenerateSetup) -> tuple[DecodeState, RootForward]:
    """:func:`root_step`'s first half: the target on each sequence's last token, its K/V written (the state's
    cache) -> (the state, the :class:`RootForward` :func:`root_commit` draws from). Nothing is drawn or committed:
    a server computes the rows' grammar masks on the host while this runs."""
    out = target_on_token(params_t, state, last_tokens(state), setup=setup)
    return state._replace(cache=out.cache), RootForward(out.logits, out.taps)


def root_commit(params_t, params_d, state: DecodeState, forward: RootForward, inputs: StepInputs, *,
                setup: GenerateSetup) -> DecodeState:
    """:func:`root_step`'s second half on the state :func:`root_forward` left: the next token drawn from
    ``forward``'s logits (under ``inputs``' features: a grammar's masks), committed, and the drafter's commit of it."""
    token, recorded = sample_one(state, forward.logits, inputs, keys_at(inputs.keys, state.seq_len), setup=setup)
    return _commit_root(params_t, params_d, state, state.draft, token, recorded, forward.taps, 1, inputs=inputs,
                        setup=setup)


def _root_and_commit(params_t, params_d, state: DecodeState, draft_state, root: jax.Array, num_nodes: int, *,
                     inputs: StepInputs, setup: GenerateSetup, keys: jax.Array) -> DecodeState:
    """The target on root i32[B] alone, one token committed per sequence, and the drafter's commit of it (taps
    padded to ``num_nodes`` rows: the drafter reads node 0's only)."""
    out, token, recorded = decode_one(params_t, state, root, inputs, keys, setup=setup)
    return _commit_root(params_t, params_d, state._replace(cache=out.cache), draft_state, token, recorded, out.taps,
                        num_nodes, inputs=inputs, setup=setup)


def _commit_root(params_t, params_d, state: DecodeState, draft_state, token: jax.Array, recorded: jax.Array,
                 taps: jax.Array | None, num_nodes: int, *, inputs: StepInputs, setup: GenerateSetup) -> DecodeState:
    """Commits token i32[B] (drawn from ``recorded``'s distribution at the root, the target's tap states ``taps``)
    as a step that accepted no draft, and the drafter's commit of it, if any (taps padded to ``num_nodes``
    rows)."""
    cache_len = state.cache_len
    batch = token.shape[0]
    width = setup.tokens_per_step
    new_tokens = jnp.zeros((batch, width), jnp.int32).at[:, 0].set(token)
    state, committed = commit_tokens(state, new_tokens, jnp.ones_like(cache_len), inputs.max_new_tokens,
                                     inputs.stop_ids)
    accept_index = jnp.full((batch, width), -1, jnp.int32).at[:, 0].set(0)
    state = capture_committed(state, taps, cache_len, committed, setup=setup)
    state = state._replace(features=with_logprobs(state.features, lambda: recorded, token[:, None], cache_len + 1,
                                                  committed))
    if setup.drafter is None:  # plain decoding (a plain server's masked step)
        return state._replace(step=state.step + 1)
    taps = constrain(setup.drafter_taps(taps), TAPS)
    if taps is not None and num_nodes > 1:
        taps = jnp.pad(taps, ((0, 0), (0, 0), (0, num_nodes - 1), (0, 0)))
    draft_state = setup.drafter.commit(params_t, params_d, draft_state,
                                       CommitContext(new_tokens, committed, accept_index, taps, cache_len))
    return state._replace(draft=draft_state, step=state.step + 1)
