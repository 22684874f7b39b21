"""Log-probabilities of prompt tokens (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): one
causal forward of the target over each prompt, teacher-forced, in its own program.

Position p's values are those of prompt token p under the target's distribution after tokens[:p] (the raw
log-softmax, as ``jspec.logprobs``); position 0 has none (zeros). The final norm and the lm_head run over
``POSITION_CHUNK`` positions at a time (``lax.map``), so the [P, V] logits of a long prompt over a large
vocabulary never exist at once: only [B, POSITION_CHUNK, V].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.compile_options import setup_jit
from jspec.generate_setup import GenerateSetup
from jspec.logprobs import Logprobs, of_tokens
from jspec.sharding import traced_on
from models.attention import KVCache
from models.llama import RMSNorm, unstack_layers

POSITION_CHUNK = 128


@functools.partial(setup_jit, static_argnames=("setup", "num_top"))
def score_prompts(params_t, prompt_ids: jax.Array, prompt_lens: jax.Array, *, setup: GenerateSetup,
                  num_top: int) -> Logprobs:
    """prompt_ids i32[B, P] right-padded, prompt_lens i32[B] -> Logprobs [B, P(, num_top)]: at position p >= 1
    (p < prompt_lens[b]) prompt token p's log-probability and the num_top most likely tokens there; zeros
    elsewhere. params_t: the target's params, stacked or per layer."""
    cfg = setup.target
    batch, width = prompt_ids.shape
    with traced_on(setup.mesh):
        params_t = unstack_layers(params_t, cfg)
        cache = KVCache.for_model(cfg, batch, width, setup.jnp_dtype, per_layer=True)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        out = setup.target_model().apply({"params": params_t}, prompt_ids, positions, cache,
                                         jnp.zeros((batch,), jnp.int32), logits_index=jnp.zeros((batch, 1), jnp.int32),
                                         tap_layers=(cfg.num_layers,))
        hidden = out.taps[0]  # [B, P, H] the last layer's output, before the final norm
        chunks = -(-width // POSITION_CHUNK)
        pad = chunks * POSITION_CHUNK - width
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        following = jnp.pad(prompt_ids[:, 1:], ((0, 0), (0, pad + 1)))  # position p predicts token p + 1

        def chunk(i):
            start = i * POSITION_CHUNK
            x = jax.lax.dynamic_slice_in_dim(hidden, start, POSITION_CHUNK, axis=1)
            x = RMSNorm(cfg.rms_norm_eps, setup.jnp_dtype, cfg.norm_weight_offset).apply({"params": params_t["norm"]}, x)
            logits = x @ params_t["lm_head"]["kernel"]
            return of_tokens(logits, jax.lax.dynamic_slice_in_dim(following, start, POSITION_CHUNK, axis=1),
                             num_top)

        values = jax.lax.map(chunk, jnp.arange(chunks))  # [chunks, B, POSITION_CHUNK(, K)]
        values = Logprobs(*(jnp.moveaxis(x, 0, 1).reshape((batch, chunks * POSITION_CHUNK) + x.shape[3:])
                            for x in values))
        index = jnp.arange(width)[None, :]
        valid = (index >= 1) & (index < prompt_lens[:, None])

        def shifted(x):  # the value predicting token p sits at p - 1: move it to p
            x = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :width - 1]], axis=1)
            return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))

        return Logprobs(*(shifted(x) for x in values))
