"""The server's Prometheus metrics (prometheus_client), in a registry of their own per server.

Every metric is ``jspec:<name>``; those vLLM has are also exported under vLLM's own name and meaning
(:data:`VLLM_NAMES`: ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:spec_decode_*`` ...), so
what reads a vLLM server (its Grafana dashboard, llm-d's endpoint picker, KEDA rules) reads jspec unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# jspec's metric -> vLLM's name for the same quantity (vLLM v1's metrics: counters of tokens, requests and steps,
# gauges of the scheduler's queues and the KV pool's use, latency histograms in seconds)
VLLM_NAMES = {
    "jspec:num_requests_running": "vllm:num_requests_running",
    "jspec:num_requests_waiting": "vllm:num_requests_waiting",
    "jspec:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "jspec:prefix_cache_queries": "vllm:prefix_cache_queries",
    "jspec:prefix_cache_hits": "vllm:prefix_cache_hits",
    "jspec:num_preemptions": "vllm:num_preemptions",
    "jspec:prompt_tokens": "vllm:prompt_tokens",
    "jspec:generation_tokens": "vllm:generation_tokens",
    "jspec:request_success": "vllm:request_success",
    "jspec:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "jspec:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "jspec:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "jspec:spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "jspec:spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "jspec:spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "jspec:spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


class _Renamed:
    """A collector re-exporting ``source``'s metrics named in ``names`` under their new names (samples and all)."""

    def __init__(self, source: CollectorRegistry, names: dict[str, str]):
        self.source, self.names = source, names

    def collect(self):
        for family in self.source.collect():
            new = self.names.get(family.name)
            if new is None:
                continue
            renamed = Metric(new, family.documentation, family.type, family.unit)
            for sample in family.samples:
                renamed.add_sample(new + sample.name[len(family.name):], sample.labels, sample.value,
                                   sample.timestamp, sample.exemplar)
            yield renamed


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServeMetrics:
    """Counters the slot engine updates; ``render()`` is the /metrics body."""

    def __init__(self, tokens_per_step: int):
        self.registry = CollectorRegistry()
        self.vllm_registry = CollectorRegistry()  # VLLM_NAMES, read off the first when scraped
        self.vllm_registry.register(_Renamed(self.registry, VLLM_NAMES))
        r = self.registry
        self.running = Gauge("jspec:num_requests_running", "Requests running (holding a row and pages)", registry=r)
        self.waiting = Gauge("jspec:num_requests_waiting", "Requests waiting for a row and pages", registry=r)
        self.prompt_tokens = Counter("jspec:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("jspec:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("jspec:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.acceptance_length = Histogram(
            "jspec:acceptance_length", "Tokens committed per verify step of a running request",
            buckets=tuple(float(n) for n in range(1, tokens_per_step + 1)), registry=r)
        self.time_to_first_token = Histogram("jspec:time_to_first_token_seconds",
                                             "From arrival to the first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "jspec:inter_token_latency_seconds", "A chunk's seconds over the tokens a request gained in it",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("jspec:e2e_request_latency_seconds", "From arrival to the last token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM's spec-decode counters: verify steps, the draft tokens they verified, those accepted, and those
        # accepted at each draft position (a step accepting a drafts counts positions 0 .. a - 1)
        self.spec_drafts = Counter("jspec:spec_decode_num_drafts", "Speculative verify steps", registry=r)
        self.spec_draft_tokens = Counter("jspec:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("jspec:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("jspec:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.step_seconds = Histogram("jspec:step_seconds", "Seconds per step of a chunk, by step program",
                                      ["program"], buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_cache_usage = Gauge("jspec:kv_cache_usage_perc",
                                    "Fraction of the KV pool's pages in use (1 = full)", registry=r)
        self.preemptions = Counter("jspec:num_preemptions", "Requests preempted (the KV pool was full) and "
                                   "recomputed later", registry=r)
        self.prefix_queries = Counter("jspec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("jspec:prefix_cache_hits", "Prompt tokens whose K/V the prefix cache held",
                                   registry=r)
        self.busy_seconds = Counter("jspec:busy_seconds", "Scheduler seconds in program calls and their "
                                    "readouts, by phase (prefill, step); the rest of its time is host work",
                                    ["phase"], registry=r)
        self.chunks = Counter("jspec:chunks", "Chunks run, by step program", ["program"], registry=r)
        self.structured_ahead = Counter("jspec:structured_ahead", "First halves of structured steps (a plain "
                                        "step's target pass, a speculative one's proposal) dispatched a step "
                                        "ahead, by outcome: used by the next step, or dropped (it ran another "
                                        "program, bucket or rows)", ["outcome"], registry=r)
        self.programs_compiled = Gauge("jspec:programs_compiled", "Compiled programs the server holds (at start-up "
                                       "and on first use)", registry=r)
        self.programs_compiling = Gauge("jspec:programs_compiling", "Programs queued or compiling on first use, "
                                        "off the scheduler's thread (their requests run on a larger compiled "
                                        "bucket meanwhile)", registry=r)

    def watch_programs(self, programs) -> None:
        """Reads the two program gauges off ``programs`` (a ``jspec.serve.program_cache.ProgramCache``) when
        scraped."""
        self.programs_compiled.set_function(lambda: len(programs))
        self.programs_compiling.set_function(programs.pending)

    def observe_tokens(self, count: int, *, waited: float | None, chunk_seconds: float) -> None:
        """A request gained ``count`` tokens: its first ones (``waited``: seconds since it arrived), or later ones
        in a chunk of ``chunk_seconds`` (0: not a chunk's, but an admission's)."""
        if waited is not None:
            self.time_to_first_token.observe(waited)
        elif chunk_seconds > 0:
            for _ in range(count):
                self.inter_token_latency.observe(chunk_seconds / count)
        self.generation_tokens.inc(count)

    def observe_acceptance(self, new_hist, draft_tokens: int = 0) -> None:
        """A request's verify steps in one speculative chunk: ``new_hist[n - 1]`` of them committed n tokens (n - 1
        drafts accepted), each verifying ``draft_tokens`` drafts (its tree's nodes but the root; 0: a plain server's
        steps, which the spec-decode counters leave out)."""
        steps = accepted = 0
        for n, count in enumerate(new_hist, start=1):
            count = int(count)
            for _ in range(count):
                self.acceptance_length.observe(n)
            steps, accepted = steps + count, accepted + count * (n - 1)
            for position in range(n - 1):
                if count:
                    self.spec_accepted_per_pos.labels(str(position)).inc(count)
        if not draft_tokens:
            return
        self.spec_drafts.inc(steps)
        self.spec_draft_tokens.inc(steps * draft_tokens)
        self.spec_accepted_tokens.inc(accepted)

    def observe_chunk(self, program: str, seconds: float, steps: int) -> None:
        """A chunk of ``steps`` steps of ``program`` ("speculative" or "plain") took ``seconds``."""
        self.chunks.labels(program).inc()
        if steps:
            self.step_seconds.labels(program).observe(seconds / steps)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)
