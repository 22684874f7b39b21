"""SpecEngine: the Python API. Load, tokenize, validate, pad, call ``jspec.generate``, unpad, report.

Everything a user can get wrong is checked here, before anything is compiled. Compiled programs are cached per
(batch bucket, prompt bucket, stop-list bucket), so a second call with same-bucket prompts compiles nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import compiled_programs
from jspec.batching import PaddedBatch, pad_batch, unpad_outputs, validate_prompts
from jspec.chat import ChatTemplate, as_conversations, load_chat_template
from jspec.config import SamplingParams, SpecConfig, check_processor_token_ids
from jspec.detokenize import TextStream
from jspec.drafters import Drafter, load as load_drafter
from jspec.generate import GenerateResult, generate, generate_continue, generate_start
from jspec.generate_setup import GenerateSetup, check_capture_layers
from jspec.logits_processors import host_arrays
from jspec.logprobs import SequenceLogprobs, check_logprobs_mode, check_num_logprobs, recorded_top
from jspec.prompt_logprobs import score_prompts
from jspec.sampling import SamplingArrays, seed_keys
from jspec.sharding import (ROWS, check_tensor_parallel, expand_kv_heads, kv_repeats, make_mesh, mesh_sizes, named,
                            param_specs, put, to_host)
from jspec.structured_outputs import StructuredOutputsParams
from jspec.structured_outputs.grammar import GrammarCompiler
from jspec.structured_outputs.loop import generate_structured
from jspec.tokenizer import generation_eos, load_tokenizer
from models.checkpoint import load_llama
from models.checkpoint.store import read_jspec_meta
from models.config import ModelConfig
from models.llama import unstack_layers
from models.quantization import QuantizationConfig, cpu_int4, quantize_params

logger = logging.getLogger("jspec")


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """acceptance_length: mean tokens committed per target verify step (>= 1; prefill's token excluded).
    accepted_per_position[i]: fraction of verify steps that accepted at least i + 1 draft tokens.
    tokens_per_second: new tokens of real prompts / run seconds (compilation excluded)."""

    acceptance_length: float
    tokens_per_second: float
    num_verify_steps: int
    accepted_per_position: list[float]
    num_generated_tokens: int
    run_seconds: float
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """hidden_states: None unless ``capture_hidden_states`` was given; else per prompt one float32 array
    [len(layers), prompt_len + len(token_ids), H], position-aligned with prompt + token_ids. logprobs: None unless
    ``logprobs`` was given; else per prompt the log-probability of each of its token_ids and the ``logprobs`` most
    likely tokens at each position (``jspec.logprobs.SequenceLogprobs``). prompt_logprobs: None unless
    ``prompt_logprobs`` was given; else per prompt the same for its tokens 1 .. P - 1 (the first has none)."""

    token_ids: list[list[int]]
    texts: list[str] | None
    stats: GenerateStats
    hidden_states: list[np.ndarray] | None = None
    logprobs: list[SequenceLogprobs] | None = None
    prompt_logprobs: list[SequenceLogprobs] | None = None


def default_dtype() -> str | None:
    """The compute dtype when the caller names none: float32 on a CPU (where bf16 is slow and its rounding can
    make a verify pass and a decode step pick different tokens at near-ties, so speculative output would leave
    plain decoding's), None (the checkpoint's own dtype) on a GPU or TPU."""
    return "float32" if jax.default_backend() == "cpu" else None


class SpecEngine:
    """Speculative (or, with drafter=None, plain) generation over one target model."""

    chat_template: ChatTemplate | None = None  # the checkpoint's (from_pretrained), for chat()

    def __init__(self, target_config: ModelConfig, target_params: Any, *, tokenizer=None,
                 drafter: Drafter | None = None, drafter_params: Any = None, max_batch_size: int = 8,
                 max_seq_len: int = 2048, dtype: str = "float32", eos_token_ids: Sequence[int] = (),
                 force_accept: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 quantization: QuantizationConfig | str | None = None, enable_expert_parallel: bool = False):
        """drafter: a static drafter (``jspec.drafters.Drafter``, e.g. from ``jspec.drafters.load``) or None (plain
        decoding); force_accept: verification accepts exactly min(N, depth) drafts per step, for timing without
        trained weights (benchmarks only: the output is then NOT the target's); mesh: a ("data", "model") mesh
        (``jspec.sharding.make_mesh``) to split the target over (tensor parallel) and the batch rows across (data
        parallel), None for one device. Greedy float32 output equals one device's. quantization: None, "int8",
        "fp8", "int4" or a ``models.quantization.QuantizationConfig``: the target's and the drafter's linear layers
        weight-only quantized with qwix (activations stay in ``dtype``); speculative output then equals plain
        decoding of the same quantized target. enable_expert_parallel (vLLM's flag): a mixture-of-experts target's
        experts split whole over the mesh's "data" devices (each a slice of them over "model"), instead of every
        device holding a slice of every expert; needs a mesh."""
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ValueError(f"drafter={drafter!r}: expected a jspec.drafters.Drafter (or None)")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: expected an integer >= 1")
        if (drafter is None) != (drafter_params is None):
            raise ValueError("drafter and drafter_params go together: pass both or neither")
        if enable_expert_parallel:
            if mesh is None or not target_config.num_experts:
                raise ValueError(f"enable_expert_parallel=True: expected a mesh and a mixture-of-experts target (got "
                                 f"mesh={mesh}, num_experts={target_config.num_experts})")
            if target_config.num_experts % mesh_sizes(mesh)[0]:
                raise ValueError(f"enable_expert_parallel=True: num_experts={target_config.num_experts} is not "
                                 f"divisible by data_parallel_size={mesh_sizes(mesh)[0]}")
            target_config = dataclasses.replace(target_config, expert_parallel=True)
        self.config = target_config
        self.mesh = mesh
        self.quantization = QuantizationConfig.coerce(quantization)
        self.data_parallel_size = 1
        if drafter_params is not None and self.quantization is not None:
            drafter_params = cpu_int4(jax.jit(quantize_params, static_argnums=1)(drafter_params, self.quantization))
        if mesh is None:
            self.params = cpu_int4(_prepare_target(target_params, target_config, self.quantization))  # once
        else:
            self.data_parallel_size, tensor_parallel_size = mesh_sizes(mesh)
            check_tensor_parallel(target_config, tensor_parallel_size)
            self.params, target_config = _shard_target(target_params, target_config, mesh, tensor_parallel_size,
                                                       self.quantization)
            self.params = cpu_int4(self.params)
            if drafter_params is not None:
                specs = drafter.param_specs(drafter_params, tensor_parallel_size)
                drafter_params = jax.tree.map(put, drafter_params, named(mesh, specs))
        self.drafter_params = drafter_params
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.setup = GenerateSetup(target=target_config, max_seq_len=max_seq_len, dtype=dtype, drafter=drafter,
                                   force_accept=force_accept if drafter is not None else None, mesh=mesh)
        if self.setup.force_accept is not None:
            logger.warning("force_accept=%d: verification accepts a fixed number of drafts; output is NOT the "
                           "target's (benchmarks only)", force_accept)
        self.eos_token_ids = tuple(sorted(set(target_config.eos_token_ids) | set(eos_token_ids)))
        self._compiled: dict[tuple, Any] = {}
        self._grammars: GrammarCompiler | None = None  # built at the first structured_outputs request
        self.auto_choice = None  # jspec.auto.AutoChoice when from_pretrained(spec="auto") chose this engine

    @classmethod
    def from_pretrained(cls, target_dir: str | os.PathLike, drafter: str | os.PathLike | None = None,
                        spec: SpecConfig | str | None = None, max_batch_size: int = 8, max_seq_len: int = 2048,
                        dtype: str | None = None, force_accept: int | None = None, tensor_parallel_size: int = 1,
                        data_parallel_size: int = 1, mesh: jax.sharding.Mesh | None = None,
                        auto_cache_dir: str | os.PathLike | None = None,
                        auto_log: Callable[[str], None] | None = None,
                        auto_streamed: bool = False,
                        quantization: QuantizationConfig | str | None = None,
                        enable_expert_parallel: bool = False) -> "SpecEngine":
        """Loads a converted checkpoint directory (``jspec convert``; ``jspec.bundled_model()`` for the bundled one).

        drafter: None (plain decoding), a name from ``jspec.drafters.DRAFTERS`` (``"ngram"``: prompt lookup, no
        weights; ``"eagle3"`` / ``"draft"``: the bundled code model's head / draft model, with the bundled target
        only; ``"mtp"`` / ``"mtp_vanilla"``: the MTP modules converted with ``target_dir``; a user drafter's name,
        registered with ``jspec.drafters.register`` or an entry point, docs/drafters.md), or a converted directory
        holding an EAGLE-3 head, a DFlash drafter or a Llama-family draft model with the target's vocabulary. spec:
        the draft tree (default ``SpecConfig()``; a DFlash drafter's: its whole block as a chain), or ``"auto"``:
        the drafter (when ``drafter`` is None: any available one, or plain decoding) and tree with the most expected tokens/s on this
        device (jspec/auto.py, jspec/autotune/; step costs timed once and cached in ``auto_cache_dir``, None caches nothing;
        ``auto_log`` receives progress lines; ``auto_streamed``: choose for ``stream`` one step per chunk, whose
        host sync per step favours drafters, instead of ``generate``; ``engine.auto_choice`` says what was chosen
        and why). dtype: compute dtype, "float32" or
        "bfloat16"; None means float32 on a CPU and the checkpoint's stored dtype on a GPU/TPU
        (:func:`default_dtype`). force_accept: benchmarks only (see ``__init__``). tensor_parallel_size,
        data_parallel_size: vLLM's names; the target is split over ``tensor_parallel_size`` devices and the batch
        rows over ``data_parallel_size`` groups of them (a ("data", "model") mesh over the first dp x tp devices of
        ``jax.devices()``, every process's once ``jax.distributed`` is initialized); or pass your own ``mesh`` with
        those axes (``jspec.sharding.make_mesh``). Each parameter is restored straight into its sharding.
        quantization: vLLM's name; "int8", "fp8" or "int4" (or a ``models.quantization.QuantizationConfig``): the
        target's and the drafter's linear layers weight-only quantized at load (see ``__init__``); None: the scheme
        of the quantized checkpoint ``target_dir`` was converted from (``models.checkpoint.hf_quantized``), if any;
        "none": the weights as stored. enable_expert_parallel: see ``__init__``.
        """
        target_dir = os.fspath(target_dir)
        keep_floats = quantization == "none"
        quantization = None if keep_floats else QuantizationConfig.coerce(quantization)  # checked before any work
        if isinstance(spec, str) and spec == "auto":
            from jspec.autotune import from_pretrained_auto

            if quantization is not None or enable_expert_parallel:
                raise ValueError("spec='auto' with quantization or enable_expert_parallel: not supported yet; name a "
                                 "drafter and a tree")
            return from_pretrained_auto(cls, target_dir, drafter, max_batch_size=max_batch_size,
                                        max_seq_len=max_seq_len, dtype=dtype,
                                        tensor_parallel_size=tensor_parallel_size,
                                        data_parallel_size=data_parallel_size, mesh=mesh,
                                        cache_dir=auto_cache_dir, log=auto_log, streamed=auto_streamed)
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec={spec!r}: expected a jspec.SpecConfig, 'auto' or None")
        if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
            raise ValueError(f"drafter={drafter!r}: expected None, a drafter name or a converted drafter directory")
        mesh, shardings = _placement(mesh, tensor_parallel_size, data_parallel_size)
        if quantization is None and not keep_floats:  # a converted quantized checkpoint names its scheme
            quantization = _stored_quantization(target_dir)
        config, params, dtype = load_llama(target_dir, dtype if dtype is not None else default_dtype(), shardings)
        static_drafter = drafter_params = None
        if drafter is not None:
            static_drafter, drafter_params = load_drafter(drafter, target=config, target_dir=target_dir,
                                                          spec=spec, max_seq_len=max_seq_len,
                                                          dtype=dtype)
        engine = cls(config, params, tokenizer=load_tokenizer(target_dir), drafter=static_drafter,
                     drafter_params=drafter_params, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                     dtype=dtype, eos_token_ids=generation_eos(target_dir), force_accept=force_accept, mesh=mesh,
                     quantization=quantization, enable_expert_parallel=enable_expert_parallel)
        engine.chat_template = load_chat_template(target_dir)
        return engine

    def forcing_acceptance(self, force_accept: int) -> "SpecEngine":
        """This engine with verification accepting exactly min(``force_accept``, depth) drafts per step, over the
        same weights: for timing a step at a known acceptance (jspec/autotune/timing.py). Its output is NOT the target's."""
        if self.setup.drafter is None:
            raise ValueError("forcing_acceptance: plain decoding has no drafts to accept")
        forced = copy.copy(self)
        forced.setup = dataclasses.replace(self.setup, force_accept=force_accept)
        forced._compiled = {}
        return forced

    def plain(self) -> "SpecEngine":
        """A plain-decoding engine (no drafter) over this engine's weights, as placed: the baseline a speedup is
        measured against."""
        plain = copy.copy(self)
        plain.setup = dataclasses.replace(self.setup, drafter=None, force_accept=None)
        plain.drafter_params = None
        plain._compiled = {}
        return plain

    # --- the call ----------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
                 stop_token_ids: Sequence[int] | None = None,
                 capture_hidden_states: Sequence[int] = (), logprobs: int | None = None,
                 prompt_logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                 banned_token_ids: Sequence[int] = (), min_tokens: int = 0, ignore_eos: bool = False,
                 structured_outputs: StructuredOutputsParams | dict | Sequence | None = None,
                 logprobs_mode: str = "raw_logprobs", num_speculative_tokens: int | None = None) -> GenerateOutput:
        """Generates for a batch of prompts (strings need a tokenizer; or lists of token ids). seed: one integer,
        or one per prompt (a prompt's tokens then do not depend on the prompts beside it; ``SamplingParams``).

        logprobs: None, or K >= 0 (vLLM's ``SamplingParams.logprobs``): each generated token's log-probability and
        the K most likely tokens at its position, in ``GenerateOutput.logprobs``; the target's log-softmax before
        temperature, top-k or top-p (vLLM's default), from the pass that committed the token (the verify pass under
        speculation: the same values as plain decoding's, up to float rounding). A compiled program per K.
        logprobs_mode: vLLM's "raw_logprobs" (that default) or "processed_logprobs": those of the distribution each
        token was drawn from, after the logits processors and a grammar's mask, then for sampled prompts
        temperature, top-k and top-p (``jspec.logprobs.recorded_logits``).
        prompt_logprobs: None, or K (vLLM's ``SamplingParams.prompt_logprobs``): the same for the prompt's tokens,
        from a teacher-forced pass over the prompts in a program of its own (``jspec.prompt_logprobs``).

        presence_penalty, frequency_penalty, repetition_penalty, logit_bias ({token id: bias}),
        banned_token_ids, min_tokens, ignore_eos: vLLM's logits processors (``SamplingParams``,
        ``jspec.logits_processors``); under speculation each draft-tree node is processed with its own path's
        history, so the output stays the processed target's (greedy: equal to plain decoding with the same
        processors). Any of them on compiles a program with them.

        structured_outputs: vLLM's ``StructuredOutputsParams`` (or a dict of its fields: ``{"json": schema}``,
        ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": lark_or_gbnf}``, ``{"json_object": True}``), one
        for every prompt or a list with one (or None) per prompt: each constrained prompt's output matches it
        (``jspec.structured_outputs``, llguidance). The host keeps each grammar and masks every draft-tree node
        from its path's state each step (two programs a step with a drafter, one without), so greedy output equals
        plain decoding's under the same grammar. Needs the tokenizer; not with capture_hidden_states.

        num_speculative_tokens: at most this many drafts accepted a step (``SamplingParams``: 0 commits one token a
        step as plain decoding; None, the drafter's own); the output is the same, only the speed changes.

        capture_hidden_states: target layers whose residual-stream states to return for every token of each
        sequence, prompt and generated (features for drafter training; TensorRT-LLM's SAVE_HIDDEN_STATES), in
        ``GenerateOutput.hidden_states``. Hugging Face ``hidden_states`` indices: 0 the embeddings' output, i the
        input of layer i, and ``num_layers`` the last layer's output before the final norm (HF's
        ``hidden_states[-1]`` is after it). The states are gathered inside the one generate program (a separate
        compiled program per layer list); the tokens are the same as without capture."""
        layers = check_capture_layers(capture_hidden_states, self.config.num_layers)
        num_top = check_num_logprobs(logprobs, self.config.vocab_size)
        mode = check_logprobs_mode(logprobs_mode)
        prompt_top = check_num_logprobs(prompt_logprobs, self.config.vocab_size, name="prompt_logprobs")
        batch, params = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                      repetition_penalty=repetition_penalty,
                                      logit_bias=dict(logit_bias or {}), banned_token_ids=tuple(banned_token_ids),
                                      min_tokens=min_tokens, ignore_eos=ignore_eos,
                                      num_speculative_tokens=num_speculative_tokens)
        recorded = None if num_top is None else recorded_top(num_top, self.config.vocab_size)
        if structured_outputs is None:
            result, run_seconds, compile_seconds = self._run(batch, params, layers, recorded, mode)
        else:
            if layers:
                raise ValueError("capture_hidden_states and structured_outputs: not supported together")
            matchers = self._matchers(structured_outputs, batch.batch_size)
            result, run_seconds, compile_seconds = self._run_structured(batch, params, matchers, recorded, mode)
        num_generated = to_host(result.num_generated)
        token_ids = unpad_outputs(to_host(result.tokens), batch.prompt_lens, num_generated, batch.batch_size)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
        stats = generate_stats(result, batch.batch_size, run_seconds, compile_seconds)
        hidden = None
        if layers:
            states = to_host(result.hidden_states)
            hidden = [states[:, b, :batch.prompt_lens[b] + num_generated[b]].astype(np.float32)
                      for b in range(batch.batch_size)]
        per_token = None
        if num_top is not None:
            values = [to_host(x) for x in result.logprobs]
            values[1:] = [x[..., :num_top] for x in values[1:]]  # top_ids, top: the first num_top recorded
            per_token = [SequenceLogprobs(*(x[b, batch.prompt_lens[b]:batch.prompt_lens[b] + num_generated[b]]
                                            for x in values)) for b in range(batch.batch_size)]
        scored = None if prompt_top is None else self._prompt_logprobs(batch, prompt_top)
        return GenerateOutput(token_ids, texts, stats, hidden, per_token, scored)

    def _matchers(self, structured_outputs, num_prompts: int) -> list:
        """One llguidance matcher (or None) per prompt for ``generate``'s structured_outputs; every grammar is
        compiled (and checked) before any device work."""
        if isinstance(structured_outputs, (StructuredOutputsParams, dict)):
            per_prompt = [structured_outputs] * num_prompts
        else:
            per_prompt = list(structured_outputs)
            if len(per_prompt) != num_prompts:
                raise ValueError(f"structured_outputs has {len(per_prompt)} entries for {num_prompts} prompts: give "
                                 f"one (or None) per prompt, or one for all")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return [None if p is None else self._grammars.matcher(StructuredOutputsParams.coerce(p))
                for p in per_prompt]

    def _run_structured(self, batch: PaddedBatch, params: SamplingParams, matchers: list, logprobs: int | None,
                        logprobs_mode: str = "raw_logprobs") -> tuple[GenerateResult, float, float]:
        """``_run`` under grammars (``jspec.structured_outputs.loop``): host-driven steps; the first call of a
        bucket's programs compiles them (counted as run time here)."""
        setup = dataclasses.replace(self.setup.with_max_seq_len(batch.seq_len), logprobs=logprobs,
                                    logprobs_mode=logprobs_mode, logits_processors=params.processes_logits)
        rows = batch.prompt_ids.shape[0]
        matchers = matchers + [None] * (rows - len(matchers))
        start = time.perf_counter()
        result = generate_structured(self._arguments(batch, params), matchers, setup=setup, mesh=self.mesh)
        return jax.block_until_ready(result), time.perf_counter() - start, 0.0

    def _prompt_logprobs(self, batch: PaddedBatch, num_top: int) -> list[SequenceLogprobs]:
        """Each prompt's tokens 1 .. P - 1 scored by the target (``jspec.prompt_logprobs``; a program per bucket)."""
        recorded = recorded_top(num_top, self.config.vocab_size)
        key = ("prompt_logprobs", batch.prompt_ids.shape, recorded)
        args = self._arguments(batch, SamplingParams())[:4]
        if key not in self._compiled:
            setup = self.setup.with_max_seq_len(batch.seq_len)
            self._compiled[key] = compiled_programs.compiled(score_prompts, (args[0], args[2], args[3]), setup=setup,
                                                             num_top=recorded)
        values = [to_host(x) for x in self._compiled[key](args[0], args[2], args[3])]
        values[1:] = [x[..., :num_top] for x in values[1:]]
        return [SequenceLogprobs(*(x[b, 1:batch.prompt_lens[b]] for x in values)) for b in range(batch.batch_size)]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             stop_token_ids: Sequence[int] | None = None, add_generation_prompt: bool = True,
             capture_hidden_states: Sequence[int] = (), logprobs: int | None = None,
             **processors) -> GenerateOutput:
        """Generates the reply to a conversation ([{"role": "user", "content": "..."}, ...]) or to each of a list
        of them: rendered with the checkpoint's chat_template and encoded as transformers'
        ``apply_chat_template(..., tokenize=True)`` does (``jspec.chat``), then :meth:`generate` (which
        ``capture_hidden_states``, ``logprobs`` and the logits processors go to). Stops at EOS and at tokenizer_config.json's eos_token,
        the model's end of turn (e.g. Qwen's ``<|im_end|>``)."""
        conversations = as_conversations(messages)
        if self.chat_template is None or self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's chat_template (tokenizer_config.json) and tokenizer.json, "
                             "and this engine has none; use generate")
        ids = self.chat_template.encode(self.tokenizer, conversations, add_generation_prompt)
        end_of_turn = self.chat_template.end_of_turn_ids(self.tokenizer)
        stop = tuple(stop_token_ids or ())
        stop += tuple(i for i in end_of_turn if i not in self.eos_token_ids + stop)
        return self.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=seed, stop_token_ids=stop, capture_hidden_states=capture_hidden_states,
                             logprobs=logprobs, **processors)

    def stream(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
               stop_token_ids: Sequence[int] | None = None, steps_per_chunk: int = 1,
               **processors) -> Iterator[list[list[int]]]:
        """Like :meth:`generate`, but yields, per chunk of ``steps_per_chunk`` steps, the tokens each prompt
        gained (a list per prompt, possibly empty). The concatenated chunks equal ``generate``'s token_ids.
        processors: :meth:`generate`'s logits processors."""
        if not isinstance(steps_per_chunk, int) or steps_per_chunk < 1:
            raise ValueError(f"steps_per_chunk={steps_per_chunk!r}: expected an integer >= 1")
        batch, params = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                      **processors)
        args = self._arguments(batch, params)
        setup = dataclasses.replace(self.setup.with_max_seq_len(batch.seq_len),
                                    logits_processors=params.processes_logits)
        state, inputs = generate_start(*args, setup=setup)
        emitted = np.zeros(batch.batch_size, np.int64)
        chunk = jnp.asarray(steps_per_chunk, jnp.int32)
        while True:
            num_generated = to_host(state.num_generated)[:batch.batch_size]
            if (num_generated > emitted).any():
                tokens = to_host(state.tokens)
                yield [tokens[b, batch.prompt_lens[b] + emitted[b]:batch.prompt_lens[b] + num_generated[b]].tolist()
                       for b in range(batch.batch_size)]
                emitted = num_generated.astype(np.int64)
            if bool(to_host(state.done).all()):
                return
            state = generate_continue(self.params, self.drafter_params, state, inputs, chunk, setup=setup)

    def stream_text(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
                    stop_token_ids: Sequence[int] | None = None, steps_per_chunk: int = 1) -> Iterator[list[str]]:
        """Like :meth:`stream`, but yields the text each prompt gained (a string per prompt, possibly empty);
        the concatenated pieces equal ``generate``'s texts. Needs the checkpoint's tokenizer.json."""
        if self.tokenizer is None:
            raise ValueError("stream_text needs a tokenizer, and this checkpoint has no tokenizer.json; use stream")
        chunks = self.stream(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, steps_per_chunk=steps_per_chunk)
        streams: list[TextStream] | None = None
        so_far: list[list[int]] = []
        for chunk in chunks:
            if streams is None:
                streams, so_far = [TextStream(self.tokenizer) for _ in chunk], [[] for _ in chunk]
            for ids, new in zip(so_far, chunk):
                ids += new
            yield [text.piece(ids) for text, ids in zip(streams, so_far)]
        if streams is not None:
            tails = [text.piece(ids, final=True) for text, ids in zip(streams, so_far)]
            if any(tails):
                yield tails

    def _prepare(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                 **processors) -> tuple[PaddedBatch, SamplingParams]:
        """Validates everything and pads the batch; nothing is compiled before this passes. processors: the
        logits processors' ``SamplingParams`` fields."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k,
                                top_p=float(top_p), seed=seed if isinstance(seed, int) else tuple(seed),
                                stop_token_ids=tuple(stop_token_ids or ()), **processors)
        check_processor_token_ids(params, self.config.vocab_size)
        ids = self.encode(prompts)
        validate_prompts(ids, vocab_size=self.config.vocab_size, max_batch_size=self.max_batch_size,
                         max_seq_len=self.setup.max_seq_len, max_new_tokens=params.max_new_tokens)
        if isinstance(params.seed, tuple) and len(params.seed) != len(ids):
            raise ValueError(f"seed has {len(params.seed)} values for {len(ids)} prompts: give one per prompt "
                             f"(or one integer)")
        eos = () if params.ignore_eos else self.eos_token_ids
        batch = pad_batch(ids, max_new_tokens=params.max_new_tokens, stop_ids=eos + params.stop_token_ids,
                          max_batch_size=self.max_batch_size, max_seq_len=self.setup.max_seq_len,
                          row_multiple=self.data_parallel_size)
        return batch, params

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts (texts, or lists of token ids) -> token ids; validates their kind."""
        if isinstance(prompts, (str, bytes)):
            raise ValueError("prompts must be a list of prompts, got a single string; wrap it in a list")
        prompts = list(prompts)
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this checkpoint has no tokenizer.json; "
                                 "pass token ids instead")
            return [self.tokenizer.encode(p).ids for p in prompts]
        if any(isinstance(p, str) for p in prompts):
            raise ValueError("prompts mixes strings and token-id lists; pass one kind")
        return [list(p) for p in prompts]

    def _arguments(self, batch: PaddedBatch, params: SamplingParams) -> tuple:
        rows = batch.prompt_ids.shape[0]
        sampling = SamplingArrays.full(rows, params)
        if params.processes_logits:
            prompts = [list(batch.prompt_ids[b, :batch.prompt_lens[b]]) for b in range(batch.batch_size)]
            sampling = (sampling, host_arrays([params] * batch.batch_size, prompts, rows, self.config.vocab_size))
        per_row = (batch.prompt_ids, batch.prompt_lens, batch.max_new_tokens, batch.stop_ids, sampling)
        rows_sharding = None
        if self.mesh is None:
            prompt_ids, prompt_lens, max_new, stop_ids, sampling = jax.tree.map(jnp.asarray, per_row)
        else:  # rows over "data" (every process passes the same full batch and keeps its own rows)
            rows_sharding = jax.sharding.NamedSharding(self.mesh, ROWS)
            prompt_ids, prompt_lens, max_new, stop_ids, sampling = jax.tree.map(
                lambda a: put(a, rows_sharding), per_row)
        key = seed_keys(params.seed, rows, rows_sharding)
        processors = None
        if params.processes_logits:
            sampling, processors = sampling
        return (self.params, self.drafter_params, prompt_ids, prompt_lens, key, max_new, stop_ids, sampling,
                processors)

    def _run(self, batch: PaddedBatch, params: SamplingParams, capture_layers: tuple[int, ...] = (),
             logprobs: int | None = None, logprobs_mode: str = "raw_logprobs") -> tuple[GenerateResult, float, float]:
        args = self._arguments(batch, params)
        bucket = (batch.prompt_ids.shape, batch.stop_ids.shape, batch.seq_len, capture_layers, logprobs,
                  logprobs_mode, params.processes_logits)
        compile_seconds = 0.0
        if bucket not in self._compiled:
            start = time.perf_counter()
            setup = dataclasses.replace(self.setup.with_max_seq_len(batch.seq_len), capture_layers=capture_layers,
                                        logprobs=logprobs, logprobs_mode=logprobs_mode,
                                        logits_processors=params.processes_logits)
            self._compiled[bucket] = compiled_programs.compiled(generate, args, setup=setup)
            compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        result = jax.block_until_ready(self._compiled[bucket](*args))
        return result, time.perf_counter() - start, compile_seconds

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far (one per bucket seen)."""
        return len(self._compiled)



def generate_stats(result: GenerateResult, batch_size: int, run_seconds: float,
                   compile_seconds: float) -> GenerateStats:
    """The :class:`GenerateStats` of a ``generate`` call's first ``batch_size`` rows."""
    num_generated = to_host(result.num_generated)[:batch_size]
    num_steps = to_host(result.num_steps)[:batch_size]
    hist = to_host(result.accepted_hist)[:batch_size].sum(axis=0)
    total_steps = int(num_steps.sum())
    from_steps = int(np.maximum(num_generated - 1, 0).sum())  # the prefill's token is not a step's
    acceptance = from_steps / total_steps if total_steps else 1.0
    per_position = [float(hist[i + 1:].sum() / total_steps) if total_steps else 0.0
                    for i in range(len(hist) - 1)]
    total_new = int(num_generated.sum())
    return GenerateStats(acceptance_length=acceptance,
                         tokens_per_second=total_new / run_seconds if run_seconds > 0 else 0.0,
                         num_verify_steps=total_steps, accepted_per_position=per_position,
                         num_generated_tokens=total_new, run_seconds=run_seconds,
                         compile_seconds=compile_seconds)


def _placement(mesh: jax.sharding.Mesh | None, tensor_parallel_size: int,
               data_parallel_size: int) -> tuple[jax.sharding.Mesh | None, Callable | None]:
    """(the mesh ``from_pretrained`` loads onto, the target's shardings over it as ``load_llama`` takes them)
    from a mesh or vLLM's sizes (one device: (None, None))."""
    if mesh is None and tensor_parallel_size * data_parallel_size != 1:
        mesh = make_mesh(tensor_parallel_size, data_parallel_size)
    elif mesh is not None and (tensor_parallel_size, data_parallel_size) != (1, 1):
        raise ValueError(f"mesh={mesh} and tensor_parallel_size={tensor_parallel_size}/data_parallel_size="
                         f"{data_parallel_size}: pass a mesh or the sizes, not both")
    if mesh is None:
        return None, None
    model_size = mesh_sizes(mesh)[1]

    def shardings(config, abstract):
        check_tensor_parallel(config, model_size)
        return named(mesh, param_specs(abstract, config, model_size))

    return mesh, shardings


def _stored_quantization(model_dir: str) -> QuantizationConfig | None:
    """The scheme jspec.json records (a checkpoint converted from a quantized one, or stored quantized by jspec
    convert --quantization), None for the others."""
    stored = read_jspec_meta(model_dir).get("quantization") if os.path.isdir(model_dir) else None
    return None if stored is None else QuantizationConfig(**{k: v for k, v in stored.items() if k != "stored"})


@functools.partial(jax.jit, static_argnames=("config", "quantization"))
def _prepare_target(params: Any, config: ModelConfig, quantization: QuantizationConfig | None) -> Any:
    """Stored target params -> the inference layout (``models.llama.unstack_layers``), quantized if asked: one
    program, run once."""
    return quantize_params(unstack_layers(params, config), quantization)


def _shard_target(params: Any, config: ModelConfig, mesh: jax.sharding.Mesh, tensor_parallel_size: int,
                  quantization: QuantizationConfig | None = None) -> tuple[Any, ModelConfig]:
    """Target params (stacked or per layer, on any devices) -> (per-layer params split over ``mesh`` by
    ``jspec.sharding.param_specs``, quantized if asked, the config they run under): one program, each device
    writing only its shards. KV heads fewer than the "model" devices are repeated (``jspec.sharding.expand_kv_heads``,
    before quantization: each repeated head keeps its scales)."""
    repeats = kv_repeats(config, tensor_parallel_size)

    def prepare(p):
        return quantize_params(expand_kv_heads(unstack_layers(p, config), config, repeats)[0], quantization)

    expanded_config = expand_kv_heads({}, config, repeats)[1]
    abstract = jax.eval_shape(prepare, params)
    shardings = named(mesh, param_specs(abstract, expanded_config, tensor_parallel_size))
    return jax.jit(prepare, out_shardings=shardings)(params), expanded_config
