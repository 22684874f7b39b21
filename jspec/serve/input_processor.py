"""The input processor (vLLM v1's): a request checked against the server's configuration before it is queued
(the server answers a bad one with HTTP 400 naming the value), and its grammar compiled into a fresh matcher."""

from __future__ import annotations

from jspec.config import check_processor_token_ids, check_seed, check_token_ids
from jspec.generate_setup import GenerateSetup
from jspec.serve.requests import Request
from jspec.serve.serve_config import ServeConfig
from jspec.structured_outputs import StructuredOutputsParams
from jspec.structured_outputs.grammar import GrammarCompiler


class InputProcessor:
    """Checks requests for a server of ``config`` whose programs run ``setup``; ``tokenizer``: the model's (for
    grammars), ``vocab_size``: its vocabulary."""

    def __init__(self, config: ServeConfig, setup: GenerateSetup, tokenizer, vocab_size: int):
        self.config, self.setup = config, setup
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars: GrammarCompiler | None = None  # built at the first structured-outputs request

    def check(self, request: Request) -> None:
        """Raises ValueError naming the bad value (the server answers 400) before the request is queued."""
        config, ids, vocab = self.config, request.prompt_ids, self.vocab_size
        if not ids:
            raise ValueError("the prompt is empty: expected at least one token")
        check_token_ids(ids, vocab, "the prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens!r}: expected an integer >= 1")
        if len(ids) + request.max_tokens > config.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_tokens={request.max_tokens} that exceeds "
                             f"the context of {config.max_seq_len} tokens (--max-seq-len)")
        params = request.sampling_params()
        if params.processes_logits and not self.setup.logits_processors:
            raise ValueError("this server was started without logits processors (jspec serve --logits-processors): "
                             "penalties, logit_bias, banned ids and min_tokens are off")
        check_processor_token_ids(params, vocab)
        if len(set(config.eos_token_ids) | set(params.stop_token_ids)) > config.num_stop_ids:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids: at most "
                             f"{config.num_stop_ids - len(config.eos_token_ids)} besides EOS")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        if request.seed is not None:
            check_seed(request.seed)
        if request.structured_outputs is not None:
            self.matcher(request.structured_outputs)  # a bad grammar is a 400, before queueing
        wanted = request.logprobs
        if request.prompt_logprobs and wanted is None:
            raise ValueError("prompt_logprobs needs logprobs=K (how many top log-probabilities per token)")
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0):
            raise ValueError(f"logprobs={wanted!r}: expected an integer >= 0")
        if wanted is not None and (self.setup.logprobs is None or wanted > self.setup.logprobs):
            most = "none (start it with --max-logprobs K)" if self.setup.logprobs is None else self.setup.logprobs
            raise ValueError(f"logprobs={wanted}: this server returns at most {most} top log-probabilities per "
                             f"token (--max-logprobs)")

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for a request's structured outputs (compiled grammars are cached; ValueError for a bad
        one)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.config.eos_token_ids)
        return self._grammars.matcher(params)
