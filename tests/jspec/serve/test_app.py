"""The HTTP server (jspec.serve.app) in-process, on the bundled code model: OpenAI's client against it, requests
equal to offline generate alone (greedy: plain decoding's, which speculation keeps; sampled among others: the
same engine's), nothing compiled under load, OpenAI-shaped
errors for bad input, 503 when full, a client that leaves frees its slot, and fuzzed bodies never break it."""

import json
import random
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jspec
from jspec.serve.app import best_choices, create_app
from jspec.serve.protocol import ModelInfo, choice_seed, parse_chat
from jspec.serve.slots import SlotEngine
from jspec.serve.stop_strings import StopMatcher
from jspec.tools import bundled
from jspec.tools.serve_cmd import CALIBRATION_PROMPT, DrainingServer
from tests.jspec.serve.scripted_adapters import Cycling, Scripted
from tests import process_programs
from tests.program_structure import memory_as_users_compile

MAX_SEQ_LEN = 128
MAX_LOGPROBS = 5
POOL_TOKENS = 4096  # the test servers' KV pools, at least (Server)
NAME = "jspec-code"
CODE = '''import os


def read_lines(path):
    """Returns the lines of a file without their newlines."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


class Server:
    """The app over a warm slot engine, served by uvicorn in a background thread on a free local port."""

    def __init__(self, max_batch_size: int, max_seq_len: int = MAX_SEQ_LEN, engine: jspec.SpecEngine | None = None,
                 tool_call_parser: str | None = None, **slot_kwargs):
        """engine: what it serves (default: the bundled model with its default drafter); tool_call_parser: as
        ``create_app``'s."""
        if engine is None:
            drafter, spec = bundled.default_method("cpu")
            engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec,
                                                      max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        self.engine = engine
        # A KV pool of what the tests need, not the CPU default's 65,536 slots: the test session's legacy XLA
        # emitters copy the pool in a speculative step (tests/conftest.py; users' programs update it in place), and
        # at the default size that copy made each served chunk cost about 20 plain ones.
        slot_kwargs.setdefault("max_total_tokens", max(POOL_TOKENS, 2 * max_batch_size * max_seq_len))
        self.slots = SlotEngine(self.engine, max_seq_len=max_seq_len, **slot_kwargs)
        # What a greedy request returns: plain decoding's tokens, which speculation keeps (offline, test_spec_engine
        # and every drafter's tests); its programs compile in a third of a speculative one's time.
        self.plain = self.engine.plain()
        self.slots.warm_up(self.engine.tokenizer.encode(CALIBRATION_PROMPT).ids)
        self.served_compiles: list[str] = []  # programs the scheduler thread compiled after warm-up: none, ever
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        self.slots.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.slots, NAME, tool_call_parser=tool_call_parser), loop="asyncio",
                                lifespan="off", log_level="warning")
        self.server = DrainingServer(config, self.slots, shutdown_timeout=5.0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if "backend_compile" in event and threading.current_thread().name == "jspec-slots":
            self.served_compiles.append(event)

    def stop(self, release: bool = False) -> None:
        """Stops serving; release: then frees this process's programs of what is no longer used
        (``tests.process_programs.release``), for a test that started a server of its own: the module's
        fixtures and the servers before it would otherwise hold the mappings the next one needs."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.server.drain()
        self.http.close()
        jax.monitoring.unregister_event_duration_listener(self._listen)
        if release:
            del self.slots, self.engine, self.plain, self.server, self.thread
            process_programs.release()

    def metric(self, name: str) -> float:
        """A sample of /metrics: ``name`` as written there, labels included."""
        text = self.http.get("/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def wait_idle(self, timeout: float = 5.0) -> float:
        """Seconds until no request runs or waits; fails after ``timeout``."""
        start = time.monotonic()
        while self.metric("jspec:num_requests_running") or self.metric("jspec:num_requests_waiting"):
            assert time.monotonic() - start < timeout, "requests still running"
            time.sleep(0.05)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def server():
    """4 slots, load adaptation and prefix caching on (the defaults); one occupancy bucket (fewer programs to
    compile than the default four) and prefills of at most 32 prompt slots: two prompt widths, a longer prompt
    prefilled in pieces between chunks (9 programs to compile against 19 at 128 slots)."""
    served = Server(max_batch_size=4, row_buckets=(4,), max_num_batched_tokens=32, max_logprobs=MAX_LOGPROBS,
                    logits_processors=True)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer


def prompt_ids(tokenizer, length: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode(CODE).ids
    return ids[offset:offset + length]


def at_once(call, count: int, timeout: float) -> None:
    """Runs call(0) .. call(count - 1) in threads at once and waits for them (each at most ``timeout`` s)."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


# --- the official client ---------------------------------------------------------------------------------------

def test_completion_stream_equals_whole_with_usage(server):
    whole = server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=24)
    chunks = list(server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=24,
                                                   stream=True, stream_options={"include_usage": True}))
    choice = whole.choices[0]
    expect = server.plain.generate(["def fibonacci(n):"], max_new_tokens=24)
    assert choice.text == expect.texts[0] and choice.finish_reason == "length"
    prompt_tokens = len(server.engine.tokenizer.encode("def fibonacci(n):").ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)
    assert whole.object == "text_completion" and whole.model == NAME
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_whole(server, tokenizer):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a function that adds two numbers."}]
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=20)
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, stream=True))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 20
    # the bundled model has no chat template: the plain fallback (jspec.serve.protocol)
    prompt = tokenizer.encode("system: You write Python.\nuser: Write a function that adds two numbers.\n"
                              "assistant:").ids
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.choices[0].message.content == server.plain.generate([prompt], max_new_tokens=20).texts[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_equal_offline_plain_decoding(server):
    """Greedy: each token's log-probability and the top 5 at its position, through the official client, equal
    offline plain decoding's (the served step verifies the hybrid's drafts: the verify pass's values), whole and
    streamed."""
    prompt = "def fibonacci(n):"
    whole = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, logprobs=MAX_LOGPROBS)
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, stream=True,
                                                   logprobs=MAX_LOGPROBS))
    plain = server.engine.plain().generate([prompt], max_new_tokens=24, logprobs=MAX_LOGPROBS)
    want, ids = plain.logprobs[0], plain.token_ids[0]
    got = whole.choices[0].logprobs
    assert whole.choices[0].text == plain.texts[0]
    np.testing.assert_allclose(got.token_logprobs, want.token, atol=1e-5, rtol=1e-5)
    def name(token_id):
        return server.engine.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    assert got.tokens == [name(i) for i in ids]
    tokenizer = server.engine.tokenizer  # each offset: where the token's text starts in the completion's
    assert got.text_offset == [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    for top, top_ids, top_values in zip(got.top_logprobs, want.top_ids, want.top):
        expected = {}
        for i, value in zip(top_ids, top_values):  # greedy: the chosen token is among them
            expected.setdefault(name(i), value)
        assert list(top) == list(expected)
        np.testing.assert_allclose(list(top.values()), list(expected.values()), atol=1e-5, rtol=1e-5)
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, got.token_logprobs, atol=1e-5, rtol=1e-5)  # another request: other rows


def test_echo_returns_the_prompt_and_its_logprobs(server, tokenizer):
    """echo + logprobs (lm-eval's loglikelihood requests): the prompt's text before the completion, the first prompt
    token with null values, the others' log-probabilities equal offline ``prompt_logprobs`` (themselves equal to
    transformers', tests/jspec/test_logprobs.py), then the completion's; streamed, the prompt comes first."""
    prompt, new = "def add(a, b):\n    return", 24  # 24: the program test_completion_logprobs_equal_... compiled
    whole = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=new, echo=True, logprobs=2)
    offline = server.engine.plain().generate([prompt], max_new_tokens=new, logprobs=2, prompt_logprobs=2)
    ids = tokenizer.encode(prompt).ids
    choice = whole.choices[0]
    assert choice.text == prompt + offline.texts[0]
    got = choice.logprobs
    assert len(got.tokens) == len(ids) + new and got.token_logprobs[0] is None and got.top_logprobs[0] is None
    np.testing.assert_allclose(got.token_logprobs[1:len(ids)], offline.prompt_logprobs[0].token, atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(got.token_logprobs[len(ids):], offline.logprobs[0].token, atol=1e-5, rtol=1e-5)
    every = ids + offline.token_ids[0]  # offsets into the echoed text, whose BOS shows no characters
    assert got.tokens[0] == "<s>" and got.text_offset[:2] == [0, 0]
    assert got.text_offset == [len(tokenizer.decode(every[:i], skip_special_tokens=True)) for i in range(len(every))]
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=new, echo=True, logprobs=2,
                                                   stream=True))
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], got.token_logprobs[1:], atol=1e-5, rtol=1e-5)
    echoed = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].logprobs is None


def test_penalties_and_logit_bias_equal_offline_plain_decoding(server):
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty and min_tokens, through the official client:
    the served (speculative) greedy output equals offline plain decoding with the same processors."""
    prompt = "def fibonacci(n):"
    processors = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, min_tokens=20,
                      logit_bias={10: 2.0, 20: -5.0})
    served = server.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=32, presence_penalty=0.5, frequency_penalty=0.3,
        logit_bias={"10": 2.0, "20": -5.0}, extra_body={"repetition_penalty": 1.3, "min_tokens": 20,
                                                         "return_token_ids": True})
    offline = server.engine.plain().generate([prompt], max_new_tokens=32, **processors)
    assert served.choices[0].token_ids == offline.token_ids[0]
    # without them: greedy speculative = plain, on the program test_completion_stream_equals_whole_with_usage compiled
    assert offline.token_ids[0] != server.plain.generate([prompt], max_new_tokens=32).token_ids[0]


def test_chat_logprobs_and_top_logprobs(server, tokenizer):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=24,
                                                  logprobs=True, top_logprobs=3)
    prompt = tokenizer.encode("user: Write a function that adds two numbers.\nassistant:").ids
    # the program test_completion_logprobs_equal_offline_plain_decoding compiled: its top 5, of which the first 3
    plain = server.engine.plain().generate([prompt], max_new_tokens=24, logprobs=MAX_LOGPROBS)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([i], skip_special_tokens=False)
                                          for i in plain.token_ids[0]]
    np.testing.assert_allclose([c.logprob for c in content], plain.logprobs[0].token, atol=1e-5, rtol=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    np.testing.assert_allclose([[t.logprob for t in c.top_logprobs] for c in content],
                               np.asarray(plain.logprobs[0].top)[:, :3], atol=1e-5, rtol=1e-5)
    bare = server.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=4,
                                                 logprobs=True)
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)
    assert server.client.chat.completions.create(model=NAME, messages=messages,
                                                 max_completion_tokens=2).choices[0].logprobs is None


def test_chat_default_max_tokens_is_the_rest_of_the_context(server, tokenizer):
    prompt = [{"role": "user", "content": CODE}]
    out = server.http.post("/v1/chat/completions", json={"messages": prompt, "temperature": 1.0, "seed": 3}).json()
    prompt_len = out["usage"]["prompt_tokens"]
    assert out["choices"][0]["finish_reason"] == "stop" or out["usage"]["completion_tokens"] == MAX_SEQ_LEN - prompt_len


def test_stop_strings_cut_the_text_and_end_the_request(server):
    full = server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=48).choices[0].text
    stop = full[12:15]
    expect = full[:full.index(stop)]
    for stops in (stop, ["zzzz-never", stop]):
        whole = server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=48, stop=stops)
        assert whole.choices[0].text == expect and whole.choices[0].finish_reason == "stop"
        chunks = list(server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=48,
                                                       stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expect
        assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_idle()


def test_stop_token_ids_and_return_token_ids(server, tokenizer):
    ids = prompt_ids(tokenizer, 12)
    expect = server.plain.generate([ids], max_new_tokens=30).token_ids[0]
    stop_id = expect[5]
    out = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 30, "stop_token_ids": [stop_id],
                                                    "return_token_ids": True}).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == expect[:expect.index(stop_id) + 1] and choice["finish_reason"] == "stop"
    streamed = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 30, "stream": True,
                                                         "stop_token_ids": [stop_id], "return_token_ids": True})
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert sum((c["token_ids"] for c in chunks), []) == choice["token_ids"]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "stop"


def test_a_shared_prefix_is_found_in_the_cache_and_changes_nothing(server, tokenizer):
    """The default server (the bundled model's default drafter here, prefix caching on): a second prompt sharing
    the first's 48 tokens (three pages) finds them in the KV cache (all but the last for a drafter reading target
    states, EAGLE-3's rule) and both return what generate returns alone."""
    shared = prompt_ids(tokenizer, 48)
    assert len(shared) == 48
    prompts = [shared + prompt_ids(tokenizer, 5, offset=60), shared + prompt_ids(tokenizer, 9, offset=50)]
    hits = server.metric("jspec:prefix_cache_hits_total")
    for ids in prompts:
        out = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 16,
                                                        "return_token_ids": True}).json()
        assert out["choices"][0]["token_ids"] == server.plain.generate([ids], max_new_tokens=16).token_ids[0]
    reused = 32 if server.engine.setup.drafter.tap_layers else 48
    assert server.metric("jspec:prefix_cache_hits_total") - hits >= reused


def test_the_scheduler_compiles_nothing_while_serving(server, tokenizer):
    """Requests in both occupancy buckets, greedy and sampled (both step programs of the adapter's choice): the
    scheduler thread compiles nothing (the offline references this module computes compile in the test's thread)."""
    def ask(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            http.post("/v1/completions", json={"prompt": prompt_ids(tokenizer, 5 + 3 * i, offset=i),
                                               "max_tokens": 12 + 5 * i, "temperature": 0.8 * (i % 2), "seed": i})

    for crowd in (1, 6):
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(crowd)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert server.served_compiles == []


def test_every_step_program_in_turn_keeps_greedy_output(server, tokenizer):
    """The default server (prompt lookup's chain of 9 drafts) has three step programs at its busiest buckets: the
    whole chain, the chain cut after --short-draft-len drafts (2 by default) and plain steps. Run in turn, chunk by
    chunk, they give every request what generate gives alone."""
    slots = server.slots
    assert slots.short_draft_len == 2 and slots.short_row_buckets == (4,)
    if jax.default_backend() == "cpu":  # no step program copies the KV pool (test_slots says why on a CPU only)
        for key in slots.runner.programs.keys():  # those compiled at warm-up: every step program at the longest context
            if key[0] == "step" and key[3] == slots.seq_buckets[-1]:
                memory = memory_as_users_compile(slots.runner.lower(key))
                assert memory.temp_size_in_bytes < memory.alias_size_in_bytes / 2, key
    label = 'jspec:chunks_total{program="%s"}'
    before = {program: server.metric(label % program) for program in ("speculative", "speculative_short", "plain")}
    adapter, slots.adapter = slots.adapter, Cycling(slots.adapter)
    try:
        for offset in (0, 30, 60):
            ids = prompt_ids(tokenizer, 10, offset=offset)
            out = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 32,
                                                            "return_token_ids": True}).json()
            assert out["choices"][0]["token_ids"] == server.plain.generate([ids], max_new_tokens=32).token_ids[0]
    finally:
        slots.adapter = adapter
    assert all(server.metric(label % program) > count for program, count in before.items())


def test_structured_steps_dispatch_the_next_first_half_ahead_and_equal_offline(server, tokenizer):
    """Six JSON requests on four rows, the step programs scripted (three plain steps, then the short chain twice):
    each structured step dispatches the next one's first half (a plain step's target pass, the proposal) before it
    is read back, and the next step uses it while every row it ran still runs (rows since finished idle) and the
    program's first half and bucket are its own; a request admitted since, or another program, drops it. Each
    reply equals offline generate under the same schema."""
    from jspec.serve.adapt import PLAIN, SHORT

    slots = server.slots
    constraint = {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}},
                           "required": ["name"], "additionalProperties": False}, "disable_any_whitespace": True}
    prompts = [prompt_ids(tokenizer, 12, offset=offset) for offset in (0, 7, 15, 23, 31, 40)]
    budgets = [12, 30, 18, 30, 9, 24]
    seq_len = next(n for n in slots.seq_buckets if n >= 12 + max(budgets))
    # compiled here, not on the scheduler's thread (no test of this module's server sees it compile while serving)
    slots.runner.programs.compile_now(slots.runner.masked_keys(PLAIN, 4, seq_len, True) +
                                      slots.runner.masked_keys(SHORT, 4, seq_len, True))
    label = 'jspec:structured_ahead_total{outcome="%s"}'
    before = {outcome: server.metric(label % outcome) for outcome in ("used", "dropped")}
    compiled_while_serving = len(server.served_compiles)
    answers = [None] * len(prompts)

    def ask(i):
        answers[i] = server.http.post("/v1/completions", json={
            "prompt": prompts[i], "max_tokens": budgets[i], "return_token_ids": True,
            "structured_outputs": constraint}).json()["choices"][0]["token_ids"]

    adapter, slots.adapter = slots.adapter, Scripted(slots.adapter, (PLAIN, PLAIN, PLAIN, SHORT, SHORT))
    try:
        at_once(ask, len(prompts), 60)
    finally:
        slots.adapter = adapter
    for prompt, budget, answer in zip(prompts, budgets, answers):
        assert answer == server.plain.generate([prompt], max_new_tokens=budget,
                                               structured_outputs=constraint).token_ids[0]
    assert all(server.metric(label % outcome) > count for outcome, count in before.items())
    assert len(server.served_compiles) == compiled_while_serving


def test_models_health_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.http.get("/health").status_code == 200
    metrics = server.http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "jspec:num_requests_running" in metrics.text


# --- equal to generate alone; nothing compiled ----------------------------------------------------------------

# slow: 32 concurrent greedy requests each equal offline generate, the scheduler compiles nothing; default tier:
# test_completion_stream_equals_whole_with_usage (a served request equals offline), test_slots
@pytest.mark.slow
def test_32_concurrent_greedy_requests_equal_generate_alone_and_the_scheduler_compiles_nothing(server, tokenizer):
    rng = random.Random(0)
    cases = [(prompt_ids(tokenizer, rng.choice([1, 3, 7, 12, 16, 20, 27, 31]), offset=rng.randrange(40)),
              rng.choice([1, 5, 16, 33, 47])) for _ in range(32)]
    expected = [server.plain.generate([ids], max_new_tokens=n).token_ids[0] for ids, n in cases]
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7))  # the listener hears a compile: a fresh program
        assert compiles, "no backend_compile event heard: the event's name changed?"
        compiles.clear()
        results = [None] * len(cases)

        def ask(i: int) -> None:
            ids, n = cases[i]
            with httpx.Client(base_url=server.url, timeout=120) as http:
                results[i] = http.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": n,
                                                               "return_token_ids": True}).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for (ids, n), result, expect in zip(cases, results, expected):
        choice = result["choices"][0]
        assert choice["token_ids"] == expect, (len(ids), n)
        assert choice["finish_reason"] == ("length" if len(expect) == n and expect[-1] not in
                                           server.engine.eos_token_ids else "stop")
        assert result["usage"]["completion_tokens"] == len(expect)
    assert server.served_compiles == []  # buckets missing at warm-up compile on their own thread


@pytest.fixture(scope="module")
def crowd_server(server):
    """16 slots, load adaptation off: a sampled request's tokens then depend only on its seed (slots.py). A shorter
    context than the others: fewer programs to compile."""
    served = Server(max_batch_size=16, max_seq_len=128, adapt=False, row_buckets=(4, 16))
    yield served
    served.stop()


# slow: a seeded sampled request's tokens do not depend on its neighbours; default tier: test_per_request_seeds,
# test_slots
@pytest.mark.slow
def test_sampled_request_alone_equals_it_among_15_others(crowd_server):
    tokenizer = crowd_server.engine.tokenizer
    body = {"prompt": prompt_ids(tokenizer, 9), "max_tokens": 40, "temperature": 0.8, "seed": 7,
            "return_token_ids": True}
    alone = crowd_server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    results = {}

    def ask(i: int, request: dict) -> None:
        with httpx.Client(base_url=crowd_server.url, timeout=120) as http:
            results[i] = http.post("/v1/completions", json=request).json()["choices"][0]["token_ids"]

    others = [{"prompt": prompt_ids(tokenizer, 3 + i, offset=i), "max_tokens": 20 + 3 * i, "temperature": 0.8,
               "top_p": 0.95, "seed": 100 + i, "return_token_ids": True} for i in range(15)]
    requests = others[:6] + [body] + others[6:]
    threads = [threading.Thread(target=ask, args=(i, r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 16 and results[6] == alone
    assert len({tuple(t) for t in results.values()}) > 1  # they did sample different things


# slow: n sampled choices each equal a request with its derived seed (on the 16-slot server without load adaptation);
# default tier: test_best_of_keeps_the_most_likely_choices (n and best_of through the client)
@pytest.mark.slow
def test_n_choices_with_a_seed_each_equal_a_single_request_with_its_seed(crowd_server):
    """n=4 sampled with seed 7: four different completions, choice i equal to a request alone with seed
    choice_seed(7, i) (choice 0: seed 7 itself) and to offline generate with that seed; streamed, the same four."""
    prompt = "def fibonacci(n):"
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=16, temperature=1.0)
    whole = crowd_server.client.completions.create(n=4, seed=7, **kwargs)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    seeds = [choice_seed(7, i) for i in range(4)]
    assert seeds[0] == 7
    assert texts == [crowd_server.client.completions.create(seed=s, **kwargs).choices[0].text for s in seeds]
    offline = crowd_server.engine.generate([prompt], max_new_tokens=16, temperature=1.0, seed=[seeds[2]])
    assert texts[2] == offline.texts[0]
    streamed = ["", "", "", ""]
    for chunk in crowd_server.client.completions.create(n=4, seed=7, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    assert whole.usage.completion_tokens == 4 * 16


def test_best_of_keeps_the_most_likely_choices(server):
    """best_of=4, n=2 (sampled): the two answered are the best two of the four by cumulative log-probability, best
    first (the ranking itself: test_best_choices_rank_by_cumulative_logprob); usage counts all four; the prompt is
    prefilled once, the other three choices reading its pages from the prefix cache."""
    prompt = CODE.split("class")[0]  # four pages of 16 tokens and a bit: the choices share the whole pages
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=3)
    hits = server.metric("jspec:prefix_cache_hits_total")
    answer = server.client.completions.create(n=2, best_of=4, logprobs=0, **kwargs)
    assert server.metric("jspec:prefix_cache_hits_total") - hits >= 3 * 48  # one prefill, three cache hits
    assert [c.index for c in answer.choices] == [0, 1] and answer.usage.completion_tokens == 4 * 8
    scores = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert scores[0] >= scores[1]
    assert server.client.completions.create(n=2, best_of=4, **kwargs).choices[0].logprobs is None
    greedy = server.client.completions.create(model=NAME, prompt="import os\n", max_tokens=8, n=3)
    assert len({c.text for c in greedy.choices}) == 1


def test_best_choices_rank_by_cumulative_logprob():
    def generation(*values):
        return SimpleNamespace(logprobs=[SimpleNamespace(token=np.asarray(v, np.float32)) for v in values])

    generations = [generation([-1.0, -2.0]), generation([-0.5], [-0.1]), generation([-5.0]), generation([])]
    assert best_choices(generations, 2) == [3, 1]  # 0.0 (nothing generated), then -0.6
    assert best_choices(generations[:2], 2) == [0, 1]  # n = best_of: all, in order


# --- bad input --------------------------------------------------------------------------------------------------

BAD = [  # (path, body, the param named)
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"\xff\xfe", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_SEQ_LEN}, None),  # beyond the context
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 2.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-3]}, None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_requests_get_400_in_openais_shape(server, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_the_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


@pytest.mark.parametrize("top_k", [-1, 0, 5, 10 ** 6])
def test_top_k_off_values_are_accepted(server, top_k):
    response = server.http.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2, "top_k": top_k,
                                                         "temperature": 1.0})
    assert response.status_code == 200, response.text


def test_before_warm_up_health_and_requests_answer_503(server):
    cold = SlotEngine(server.engine, max_seq_len=MAX_SEQ_LEN)
    with TestClient(create_app(cold, NAME)) as client:
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["message"]


def test_unknown_route_is_404_in_openais_shape(server):
    response = server.http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


# --- clients that leave -----------------------------------------------------------------------------------------

LONG = {"prompt": "import os\n", "max_tokens": MAX_SEQ_LEN - 8, "temperature": 1.0, "seed": 11}


def test_a_closed_stream_frees_its_slot(server):
    aborted = server.metric('jspec:request_success_total{finished_reason="abort"}')
    with server.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        next(response.iter_lines())
    assert server.wait_idle(timeout=5.0) < 5.0
    assert server.metric('jspec:request_success_total{finished_reason="abort"}') == aborted + 1


def test_a_dropped_connection_frees_its_slot(server):
    aborted = server.metric('jspec:request_success_total{finished_reason="abort"}')
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 5
        while not server.metric("jspec:num_requests_running"):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
    assert server.wait_idle(timeout=5.0) < 5.0
    assert server.metric('jspec:request_success_total{finished_reason="abort"}') == aborted + 1


# --- fuzzing ----------------------------------------------------------------------------------------------------


def _containers(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats() | st.text(max_size=8),
                    _containers, max_leaves=12)
FIELDS = {
    "model": st.just(NAME) | JSON, "prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(-5, 3000),
                                                                                          max_size=8) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | JSON,
                                                "content": st.text(max_size=20) | JSON}), max_size=3) | JSON,
    "max_tokens": st.integers(-2, 6) | JSON, "max_completion_tokens": st.integers(-2, 6) | st.none(),
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-0.5, 1.5) | JSON, "top_k": st.integers(-3, 50) | JSON,
    "seed": st.integers(-10, 2 ** 33) | JSON, "stop": st.text(max_size=3) | st.lists(st.text(max_size=3)) | JSON,
    "stop_token_ids": st.lists(st.integers(-2, 4000), max_size=10) | JSON, "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "n": st.integers(0, 3) | JSON, "logprobs": JSON, "echo": JSON, "best_of": JSON, "return_token_ids": JSON,
}
VALID = {"prompt": "def f(x):", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3}
OBJECTS = st.fixed_dictionaries({}, optional=FIELDS)
ONE_FIELD = st.sampled_from(sorted(FIELDS)).flatmap(lambda name: FIELDS[name].map(lambda v: {**VALID, name: v}))
# a valid body with one field drawn (twice as likely), any object of those fields, any JSON value, any bytes
BODIES = (ONE_FIELD | ONE_FIELD | OBJECTS | JSON).map(lambda body: json.dumps(body).encode()) | st.binary(max_size=40)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_fuzzed_bodies_get_200_or_400_and_the_server_keeps_serving(server, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code in (200, 400), (response.status_code, response.text, body)
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert server.http.get("/health").status_code == 200


def test_after_the_fuzz_it_still_generates(server):
    out = server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=8)
    assert out.usage.completion_tokens == 8
    server.wait_idle()


# --- full and shutting down: last, on a server of its own -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(server):
    """1 slot, 1 place in the queue."""
    served = Server(max_batch_size=1, max_seq_len=64, max_queue=1, adapt=False)
    yield served
    served.stop()


# slow: a full queue answers 503 with Retry-After; default tier: the other 503 tests (warm-up, shutdown)
@pytest.mark.slow
def test_a_full_queue_answers_503_with_retry_after(tiny_server):
    statuses = []

    def ask(seed: int) -> None:
        with httpx.Client(base_url=tiny_server.url, timeout=120) as http:
            response = http.post("/v1/completions", json={**LONG, "max_tokens": 48, "seed": seed})
            statuses.append((response.status_code, response.headers.get("retry-after"), response.json()))

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    busy = [s for s in statuses if s[0] == 503]
    assert busy and all(s[1] == "1" and s[2]["error"]["message"] for s in busy), statuses
    assert sum(s[0] == 200 for s in statuses) >= 2 and {s[0] for s in statuses} == {200, 503}


# slow: a draining server answers 503; default tier: test_before_warm_up_health_and_requests_answer_503
@pytest.mark.slow
def test_shutting_down_answers_503(tiny_server):
    tiny_server.slots.stop_accepting()
    response = tiny_server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"


# --- stop strings (no server) -----------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n ", max_size=30), stops=st.lists(st.text(alphabet="ab\n ", max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
@example(text=" aa", stops=["a", " aa"], cuts=[2])  # "a" completes first, whether or not the text is cut at 2
@example(text=" aa", stops=["a", " aa"], cuts=[])
def test_stop_matcher_sends_the_text_before_the_first_stop_string(text, stops, cuts):
    matcher = StopMatcher(stops)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    sent, stopped = "", False
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        piece, stopped = matcher.feed(text[start:end], final=i == len(bounds) - 2)
        sent += piece
        if stopped:
            break
    # the stop string that completes first (earliest end, then earliest start), however the text was cut
    found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops if s) if i >= 0]
    assert (sent, stopped) == ((text[:min(found)[1]], True) if found else (text, False))


def test_chat_with_a_template_renders_it_and_stops_at_its_end_of_turn():
    from jspec.chat import ChatTemplate
    from jspec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(jspec.bundled_model())
    template = ChatTemplate("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                            "{% if add_generation_prompt %}<s>assistant\n{% endif %}", {"eos_token": "</s>"})
    model = ModelInfo(name=NAME, tokenizer=tokenizer, chat_template=template, max_seq_len=64, vocab_size=10 ** 6)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "it."}]}]
    params = parse_chat({"messages": messages, "stop_token_ids": [7]}, model)
    expect = template.encode(tokenizer, [[{"role": "user", "content": "Sort it."}]])[0]
    assert params.prompt_ids == expect and params.max_tokens == 64 - len(expect)
    assert params.stop_token_ids == (7, tokenizer.token_to_id("</s>"))


@pytest.fixture(scope="module")
def structured_server():
    """2 slots whose structured-output programs compile at warm-up (--warm-up-structured-outputs); prompts over
    32 tokens prefilled in pieces."""
    served = Server(max_batch_size=2, row_buckets=(2,), max_num_batched_tokens=32, warm_up_structured_outputs=True)
    yield served
    served.stop()


# slow: response_format / structured_outputs through the official client equal offline generate, mixed with an
# unconstrained request, chunked prefill under a grammar; default tier: the offline mixed case, test_tree_masks and
# test_protocol (request parsing)
@pytest.mark.slow
def test_structured_outputs_through_the_client_equal_offline(structured_server, tokenizer):
    """response_format json_schema (chat), vLLM's structured_outputs JSON (compact) and regex (completions, a
    prompt long enough to be prefilled in pieces) and an unconstrained request at once: each equal to offline
    generate with the same constraint, the JSON valid against its schema, also with the masked step programs taken
    in turn; bad grammars and two ways at once are 400s; with the structured programs warmed up, the scheduler
    compiles nothing."""
    server = structured_server
    schema = {"type": "object", "properties": {"lang": {"enum": ["python", "c"]}, "lines": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["lang", "lines"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe the file as JSON."}]
    chat_prompt = tokenizer.encode("user: Describe the file as JSON.\nassistant:").ids
    regex = r"[a-z_]{1,12}\([0-9]{1,2}\)"
    long_prompt = CODE.split("class")[0] + "lines = "
    answers = {}

    def ask(name, call):
        answers[name] = call()

    calls = {
        "json": lambda: server.client.chat.completions.create(
            model=NAME, messages=messages, max_completion_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "file", "schema": schema}}),
        "compact": lambda: server.client.completions.create(
            model=NAME, prompt="# JSON\nrecord = ", max_tokens=40,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}}),
        "regex": lambda: server.client.completions.create(model=NAME, prompt=long_prompt, max_tokens=24,
                                                          extra_body={"structured_outputs": {"regex": regex}}),
        "free": lambda: server.client.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=24),
    }
    threads = [threading.Thread(target=ask, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    engine = server.plain
    # JSON's default whitespace is free (vLLM's): this small model indents until max_tokens, the same as offline
    text = answers["json"].choices[0].message.content
    assert text.startswith("{") and text == engine.generate([chat_prompt], max_new_tokens=40,
                                                            structured_outputs={"json": schema}).texts[0]
    compact = answers["compact"].choices[0]
    assert compact.finish_reason == "stop" and json.loads(compact.text)["lang"] in ("python", "c")
    assert compact.text == engine.generate(["# JSON\nrecord = "], max_new_tokens=40, structured_outputs={
        "json": schema, "disable_any_whitespace": True}).texts[0]
    assert re.fullmatch(regex, answers["regex"].choices[0].text)
    assert answers["regex"].choices[0].text == engine.generate([long_prompt], max_new_tokens=24,
                                                               structured_outputs={"regex": regex}).texts[0]
    assert answers["free"].choices[0].text == engine.generate(["def fibonacci(n):"], max_new_tokens=24).texts[0]
    # Structured steps take the load adapter's program in its masked form: plain steps, the short chain and the
    # whole one in turn give the constrained target's tokens all the same.
    label = 'jspec:chunks_total{program="%s"}'
    programs = ("structured", "structured_short", "structured_plain")
    before = {program: server.metric(label % program) for program in programs}
    slots = server.slots
    adapter, slots.adapter = slots.adapter, Cycling(slots.adapter)
    try:
        again = calls["compact"]().choices[0]
        regex_again = calls["regex"]().choices[0]
    finally:
        slots.adapter = adapter
    assert again.text == compact.text and regex_again.text == answers["regex"].choices[0].text
    assert all(server.metric(label % program) > count for program, count in before.items())
    for body, message in (({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
                          ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
                           "one way")):
        response = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert server.served_compiles == []


# slow: a plain server (no drafter) constrains its steps, its first structured step compiling its program;
# default tier: test_program_cache's bucket choice (a synchronous compile with none compiled)
@pytest.mark.slow
def test_a_plain_servers_structured_step_equals_offline_without_warm_up():
    """No drafter, no --warm-up-structured-outputs: the first JSON request compiles its masked plain step where it
    runs, and the reply equals offline generate under the same schema; the steps count as "structured"."""
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    server = Server(max_batch_size=2, engine=engine, row_buckets=(2,))
    try:
        schema = {"type": "object", "properties": {"lang": {"enum": ["python", "c"]}, "lines": {
            "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["lang", "lines"],
            "additionalProperties": False}
        constraint = {"json": schema, "disable_any_whitespace": True}
        out = server.client.completions.create(model=NAME, prompt="# JSON\nrecord = ", max_tokens=40,
                                               extra_body={"structured_outputs": constraint})
        want = engine.generate(["# JSON\nrecord = "], max_new_tokens=40, structured_outputs=constraint).texts[0]
        assert out.choices[0].text == want and json.loads(want)["lang"] in ("python", "c")
        assert server.metric('jspec:chunks_total{program="structured"}') > 0
    finally:
        server.stop(release=True)


# slow: a drafter reading the target's states (EAGLE-3) takes them from a structured plain step's first half to its
# draw; default tier: test_structured_steps_dispatch_the_next_first_half_ahead_and_equal_offline (prompt lookup)
@pytest.mark.slow
def test_structured_plain_steps_hand_eagle3_the_targets_states_and_equal_offline():
    """EAGLE-3 commits each token with the target's tap states, which a structured plain step's first half
    (``paged.forward_rows``) computes and hands its draw (``paged.sample_rows``): both compile and run with them,
    five JSON requests on four rows, plain steps only, each equal to offline generate under the schema, first halves
    used a step ahead. (Wrong states would cost acceptance, not tokens: speculation keeps the target's.)"""
    from jspec.serve.adapt import PLAIN

    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3",
                                              spec=bundled.default_spec("eagle3"), max_batch_size=4,
                                              max_seq_len=MAX_SEQ_LEN)
    server = Server(max_batch_size=4, engine=engine, row_buckets=(4,))
    server.slots.adapter = Scripted(server.slots.adapter, (PLAIN,))
    constraint = {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}},
                           "required": ["name"], "additionalProperties": False}, "disable_any_whitespace": True}
    prompts = ["# JSON\nrecord = ", "config = ", "def f(x):\n    return ", "data = ", "x = "]
    answers = [None] * len(prompts)

    def ask(i):
        answers[i] = server.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=30, temperature=0,
                                                      extra_body={"structured_outputs": constraint}).choices[0].text

    try:
        at_once(ask, len(prompts), 120)
        used = server.metric('jspec:structured_ahead_total{outcome="used"}')
    finally:
        server.stop()
    offline = [server.plain.generate([prompt], max_new_tokens=30, structured_outputs=constraint).texts[0]
               for prompt in prompts]
    assert answers == offline and used > 0
    del server
    process_programs.release()


# slow: a hermes tool call streamed through the official client as deltas; default tier: test_tool_parsers (the
# deltas of every format, piece by piece)
@pytest.mark.slow
def test_a_streamed_tool_call_arrives_as_deltas_through_the_client():
    """A hermes tool call (the reply held to one by a regex, the server started with --tool-call-parser hermes),
    streamed: the content before it streams as content, the call's header (id, name) comes first, its arguments in
    several pieces as the model writes them, assembled by the client into what the whole reply's call parses to;
    finish_reason tool_calls."""
    from jspec.chat import ChatTemplate

    drafter, spec = bundled.default_method("cpu")
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec, max_batch_size=2,
                                              max_seq_len=256)
    engine.chat_template = ChatTemplate("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                                        "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:", {})
    server = Server(max_batch_size=2, max_seq_len=256, engine=engine, row_buckets=(2,), tool_call_parser="hermes",
                    warm_up_structured_outputs=True)
    try:
        _stream_a_tool_call(server)
    finally:
        server.stop(release=True)


def _stream_a_tool_call(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "count_lines", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}}}
    call = (r'Sure\. <tool_call>\{"name": "count_lines", "arguments": \{"path": "[a-z_]{1,10}\.py", '
            r'"limit": [1-9][0-9]?\}\}</tool_call>')
    body = dict(model=NAME, messages=[{"role": "user", "content": "Count the lines."}], max_tokens=80, tools=[tool],
                temperature=0, extra_body={"structured_outputs": {"regex": call}})
    whole = server.client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    expected = json.loads(whole.message.tool_calls[0].function.arguments)
    header, pieces, reasons, content = None, [], [], ""
    for chunk in server.client.chat.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                assert header is None and delta.index == 0
                header = delta
            else:
                pieces.append(delta.function.arguments)
    assert content == "Sure. " and whole.message.content == "Sure."
    assert header.function.name == "count_lines" and header.type == "function" and header.function.arguments == ""
    assert len(pieces) > 2 and json.loads("".join(pieces)) == expected
    assert reasons[-1] == "tool_calls"


def test_vllm_metric_names_report_what_was_served(server, tokenizer):
    """Every metric vLLM has is exported under vLLM's name with jspec's value, and what they count matches what
    the requests got: finished requests, their prompt and completion tokens, end-to-end latencies, and the
    spec-decode counters' verify steps, drafts and acceptances (per position adding up)."""
    from jspec.serve.metrics import VLLM_NAMES

    def scrape() -> dict[str, float]:
        samples = {}
        for line in server.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    server.wait_idle()
    before = scrape()
    cases = [(prompt_ids(tokenizer, length, offset=7 * length), tokens) for length, tokens in ((5, 24), (11, 9),
                                                                                             (3, 30))]
    completions = [server.client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=0,
                                                    extra_body={"return_token_ids": True}) for ids, n in cases]
    server.wait_idle()
    after = scrape()
    for jspec_name, vllm_name in VLLM_NAMES.items():  # the same samples, labels and values under both names
        ours = {k.replace(jspec_name, vllm_name, 1): v for k, v in after.items() if k.startswith(jspec_name)}
        theirs = {k: v for k, v in after.items() if k.startswith(vllm_name)}
        assert ours and ours == theirs, vllm_name

    def gained(prefix: str) -> float:
        return sum(v for k, v in after.items() if k.startswith(prefix)) - \
            sum(v for k, v in before.items() if k.startswith(prefix))

    served_tokens = sum(len(c.choices[0].token_ids) for c in completions)
    assert gained("vllm:request_success_total") == len(cases)
    assert gained("vllm:e2e_request_latency_seconds_count") == len(cases)
    assert gained("vllm:prompt_tokens_total") == sum(len(ids) for ids, _ in cases)
    assert gained("vllm:generation_tokens_total") == served_tokens
    steps, drafted = gained("vllm:spec_decode_num_drafts_total"), gained("vllm:spec_decode_num_draft_tokens_total")
    accepted = gained("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == gained("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert steps <= drafted <= steps * (server.engine.setup.spec.tree_size - 1)
    # each verify step commits its accepted drafts and one token of its own; a request's first token is its prefill's
    assert steps + accepted <= served_tokens - len(cases)
    assert gained("vllm:num_requests_running") == 0 == after["vllm:num_requests_running"]


def test_what_routers_read(server, tokenizer):
    """SGLang's worker endpoints, as sglang-router and other fleet tools read them: model and server info, load, a
    one-token health generation, and a prefix-cache flush that makes the next identical prompt miss."""
    server.wait_idle()
    for path in ("/model_info", "/get_model_info"):
        info = server.http.get(path).json()
        assert info["served_model_name"] == NAME and info["is_generation"] is True
        assert info["model_type"] == server.engine.config.model_type
    for path in ("/server_info", "/get_server_info"):
        info = server.http.get(path).json()
        slots = server.slots
        assert (info["max_running_requests"], info["max_total_tokens"], info["context_length"], info["page_size"]) \
            == (slots.max_num_seqs, slots.max_total_tokens, slots.max_seq_len, slots.block_size)
        assert info["speculative_num_draft_tokens"] == server.engine.setup.spec.tree_size
        assert info["internal_states"][0]["num_running_reqs"] == 0
    assert server.http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                     "num_tokens": 0}]
    assert server.http.get("/health_generate").status_code == 200
    ids = prompt_ids(tokenizer, 40, offset=3)
    hits = "jspec:prefix_cache_hits_total"

    def ask() -> float:
        before = server.metric(hits)
        server.client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0)
        server.wait_idle()
        return server.metric(hits) - before

    ask()
    assert ask() > 0  # the second time from the cache
    assert server.http.post("/flush_cache").status_code == 200
    assert ask() == 0  # forgotten


def test_a_request_caps_its_own_speculation_and_reports_its_acceptance(server, tokenizer):
    """``num_speculative_tokens`` per request (0: no draft accepted, one token a verify step) keeps greedy output;
    each response reports its verify steps and accepted drafts (SGLang's spec_verify_ct / spec_accept_length)."""
    ids = prompt_ids(tokenizer, 9, offset=11)
    want = server.plain.generate([ids], max_new_tokens=20).token_ids[0]
    for cap in (None, 0):
        extra = {"return_token_ids": True} | ({} if cap is None else {"num_speculative_tokens": cap})
        out = server.client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0,
                                               extra_body=extra)
        assert out.choices[0].token_ids == want
        usage = out.usage.model_dump()
        assert usage["spec_accept_length"] == pytest.approx(20 / usage["spec_verify_ct"])
        if cap == 0:  # the prefill's token, then one a step
            assert usage["spec_accepted_tokens"] == 0 and usage["spec_verify_ct"] == 19
    bad = server.http.post("/v1/completions", json={"model": NAME, "prompt": ids, "num_speculative_tokens": -1})
    assert bad.status_code == 400 and "num_speculative_tokens" in bad.text


# slow: 8 chat sessions of 6 turns through the prefix cache with speculation on; default tier:
# test_what_routers_read (a repeated prompt hits the cache, a flushed one misses)
@pytest.mark.slow
def test_multi_turn_chats_reuse_their_history_from_the_prefix_cache():
    """Each turn's prompt is the whole conversation so far: with EAGLE-3 on (SGLang users see EAGLE cut radix reuse
    to 40-53%, sgl-project/sglang#32459), at least 90% of what later turns share with the turn before (its prompt)
    comes from the prefix cache (page granularity and EAGLE's recomputed last page are the rest)."""
    server = Server(max_batch_size=4, max_seq_len=512, row_buckets=(4,))
    histories = [[{"role": "system", "content": f"Session {s}. Project code:\n{CODE}"}] for s in range(8)]
    previous = [0] * len(histories)  # each session's last prompt, in tokens
    shared = 0
    before = server.metric("jspec:prefix_cache_hits_total")
    for turn in range(6):
        for session, history in enumerate(histories):
            history.append({"role": "user", "content": f"Turn {turn}: step_{turn}."})
            out = server.client.chat.completions.create(model=NAME, messages=history, max_tokens=6, temperature=0)
            shared += previous[session]
            previous[session] = out.usage.prompt_tokens
            history.append({"role": "assistant", "content": out.choices[0].message.content})
        server.wait_idle()
    hits = server.metric("jspec:prefix_cache_hits_total") - before
    server.stop(release=True)
    assert hits >= 0.9 * shared, (hits, shared)
