"""The drafter protocol: what the fused step asks of any drafter. A new drafter is one file implementing it.

Inside the jitted loop a drafter is a frozen (hashable, static) object plus an explicit state pytree:

- ``prefill(params_t, params_d, ctx: PrefillContext) -> state``: after the target's prefill.
- ``propose(params_t, params_d, state, root, cache_len, *, sampling=None, key=None) -> (state, DraftTree)``:
  draft a tree whose node 0 is ``root`` (the last committed token, position ``cache_len``). ``sampling`` (the
  request's per-sequence SamplingArrays) and ``key`` (fresh PRNG keys per step, one per row: key[B]; a row must
  draw with its own key only, so its tokens never depend on its neighbours) let a drafter draw its drafts
  from its own distribution; it then reports, per node, the distribution the node's children were drawn from
  (``DraftTree.draft_probs``) and verification runs recursive rejection sampling. A drafter whose drafts are a
  function of the prefix (top-k trees, n-gram lookup) ignores both and leaves ``draft_probs`` None. A drafter
  that sometimes has nothing to propose (n-gram lookup without a match) says so in ``DraftTree.drafted``; the
  step then skips the T-token verify pass when no running sequence drafted (as vLLM skips speculation for a
  request without a proposal).
- ``commit(params_t, params_d, state, ctx: CommitContext) -> state``: after verification, take in the committed
  tokens (update the drafter's own KV cache and whatever it predicts next).

``tap_layers`` names the target layers whose residual-stream inputs the drafter needs (EAGLE-3), or ().
``max_seq_len`` is the token slots per sequence its buffers are sized for; the engine sizes them per request
bucket with :meth:`Drafter.with_max_seq_len`. ``short_chain_nodes`` is None, or N for a chain drafter whose rows
may draft only the chain's first N nodes (root included; ``DraftTree.full`` False there): a step in which no
running row drafted the whole chain verifies those N nodes only (the ``"ngram+eagle3"`` hybrid, whose model chain
is shorter than lookup's). A drafter is a frozen dataclass (hashable: it is part of the static ``GenerateSetup``);
``common.DrafterBase`` supplies ``tap_layers`` = (), ``short_chain_nodes`` = None, ``with_max_seq_len`` and the
tree helpers. ``check_drafter`` says what an object lacks of the protocol.

What a drafter can do is declared, never probed for:
- ``caches_prefix``: whether the server may start it from a cached prefix (prefix caching, chunked prefill) with
  ``prefill_cached(params_t, params_d, state, ctx, cached_lens) -> state`` (``DrafterBase``: a drafter reading no
  target states reruns its prefill over the whole prompt; one reading them overrides both, as EAGLE-3 does);
- ``param_specs(params_d, tensor_parallel_size) -> PartitionSpecs``: how the engine places ``params_d`` on a device
  mesh (``jspec.sharding``; ``DrafterBase``: replicated on every device). Either way the output is the same; only
  bytes and collectives differ;
- ``state_layout(state) -> declarations``: what each leaf of its state holds, as ``jspec.state_layout`` declares
  (``PerPosition`` buffers with their pool, slots and axes, ``PerRow`` values): the server pages the first and keeps
  the second per request (``DrafterBase``: every leaf per row).

A new drafter is one file here implementing the protocol with a ``load(source: DrafterSource) -> (drafter,
params)``, plus one entry in ``registry.py``; one written outside the package is registered at run time
(``registry.register`` or an entry point; docs/drafters.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from jspec.config import SpecConfig
from models.config import ModelConfig


class DraftTree(NamedTuple):
    """One step's draft: tokens i32[B, T] (node 0 the root) and the verification buffers of its shape."""

    tokens: jax.Array        # i32[B, T] target token ids
    mask: jax.Array          # bool[B, T, T] node j is i or an ancestor of i
    positions: jax.Array     # i32[B, T] cache_len + depth
    next_token: jax.Array    # i32[B, T] first child, -1 if none
    next_sibling: jax.Array  # i32[B, T] next sibling, -1 if none
    draft_probs: jax.Array | None = None  # f32[B, T, V]: node i's children are i.i.d. draws from row i; None:
                                          # deterministic drafts (pallas_kernels.tree_verify)
    drafted: jax.Array | None = None      # bool[B]: False where the drafter has nothing to propose (its nodes
                                          # past the root are placeholders); None: always drafted. A step in
                                          # which no running sequence drafted runs the target on the root alone.
    full: jax.Array | None = None         # bool[B]: False where the row drafted only the drafter's
                                          # ``short_chain_nodes`` first nodes of a chain; None: every row uses all
                                          # T. A step in which no running row is full verifies only those nodes.


class PrefillContext(NamedTuple):
    prompt_ids: jax.Array    # i32[B, P] right-padded prompts
    prompt_lens: jax.Array   # i32[B]
    first_token: jax.Array   # i32[B] the target's token after each prompt
    taps: jax.Array | None   # [len(tap_layers), B, P, H] target residual-stream inputs, or None


class CommitContext(NamedTuple):
    new_tokens: jax.Array    # i32[B, D + 1] accepted drafts then the bonus token (num_committed of them real)
    num_committed: jax.Array  # i32[B] tokens committed this step (after stop / max_new_tokens cuts)
    accept_index: jax.Array  # i32[B, D + 1] local node ids of the accepted path, root first, -1 padded
    taps: jax.Array | None   # [len(tap_layers), B, T, H] target residual-stream inputs at the tree nodes
    cache_len: jax.Array     # i32[B] the step's root position (committed K/V before the step)


class DrafterSource(NamedTuple):
    """Everything a drafter's ``load`` may need: where its weights are (None for weightless drafters), the
    target it drafts for, the tree it drafts, its buffers' size and the compute dtype."""

    path: str | None
    target: ModelConfig
    target_dir: str | None
    spec: SpecConfig
    max_seq_len: int
    dtype: str


@runtime_checkable
class Drafter(Protocol):
    """What the engine and the fused step rely on, and nothing else."""

    spec: SpecConfig   # the draft tree's shape
    max_seq_len: int   # token slots per sequence its buffers are sized for

    @property
    def tap_layers(self) -> tuple[int, ...]: ...

    @property
    def short_chain_nodes(self) -> int | None: ...

    @property
    def caches_prefix(self) -> bool: ...

    def with_max_seq_len(self, max_seq_len: int) -> "Drafter": ...

    def prefill_cached(self, params_t: Any, params_d: Any, state: Any, ctx: PrefillContext,
                       cached_lens: jax.Array) -> Any: ...

    def param_specs(self, params_d: Any, tensor_parallel_size: int) -> Any: ...

    def state_layout(self, state: Any) -> Any: ...

    def prefill(self, params_t: Any, params_d: Any, ctx: PrefillContext) -> Any: ...

    def propose(self, params_t: Any, params_d: Any, state: Any, root: jax.Array, cache_len: jax.Array, *,
                sampling: Any = None, key: jax.Array | None = None) -> tuple[Any, DraftTree]: ...

    def commit(self, params_t: Any, params_d: Any, state: Any, ctx: CommitContext) -> Any: ...


PROTOCOL_ATTRIBUTES = ("spec", "max_seq_len", "tap_layers", "short_chain_nodes", "caches_prefix")
PROTOCOL_METHODS = ("with_max_seq_len", "prefill", "propose", "commit", "prefill_cached", "param_specs",
                    "state_layout")


def check_drafter(drafter: Any, what: str = "drafter") -> None:
    """TypeError naming what ``drafter`` lacks of the ``Drafter`` protocol, or nothing. It must also be hashable: it
    is a static argument of the jitted program (a frozen dataclass is)."""
    missing = [attr for attr in PROTOCOL_ATTRIBUTES if not hasattr(drafter, attr)]
    missing += [f"{method}()" for method in PROTOCOL_METHODS if not callable(getattr(drafter, method, None))]
    if missing:
        raise TypeError(f"{what} is a {type(drafter).__name__}, which does not implement the jspec.drafters.Drafter "
                        f"protocol: missing {', '.join(missing)} (subclass jspec.drafters.DrafterBase for "
                        f"tap_layers, short_chain_nodes, caches_prefix, with_max_seq_len, prefill_cached, "
                        f"param_specs and state_layout)")
    if not isinstance(drafter.spec, SpecConfig):
        raise TypeError(f"{what}: spec={drafter.spec!r}: expected a jspec.SpecConfig")
    try:
        hash(drafter)
    except TypeError as error:
        raise TypeError(f"{what} is a {type(drafter).__name__}, which is not hashable ({error}): make it a frozen "
                        f"dataclass (it is a static argument of the jitted program)") from None
