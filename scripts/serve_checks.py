"""The paged server's capacity, preemption and prefix caching, through the official openai client against
`jspec serve` processes (bundled model), each against offline greedy decoding of the same prompts.

    python scripts/serve_checks.py capacity     # --max-seq-len 2048 --max-total-tokens 8192, 48 requests at once
    python scripts/serve_checks.py preemption   # a pool too small for the load
    python scripts/serve_checks.py prefix       # 16 requests sharing a 500-token prefix, cache on and off
    python scripts/serve_checks.py chunked      # a 900-token prompt arriving while 8 requests stream
    python scripts/serve_checks.py multiturn    # 8 chat sessions x 6 turns with EAGLE-3, cache on and off

The prefix and chunked checks serve plain decoding (--drafter none), the multi-turn one EAGLE-3 (--drafter
eagle3); ``--drafter default`` runs them on the default server (the bundled model's default drafter), any other
name with that drafter.

Prints one line per figure and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `jspec serve` process on a free port, stopped by SIGTERM at the end of the block."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "serve", "--port", str(self.port),
                                         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> "Server":
        for line in self.process.stdout:
            print(f"  [serve] {line.rstrip()}")
            if "ready" in line:
                break
        else:
            raise RuntimeError("jspec serve exited before it was ready")
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{self.base}/v1", api_key="unused", timeout=1200)
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.base}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Streams a greedy completion -> (its token ids, seconds to the first token)."""
        start = time.perf_counter()
        first, ids = None, []
        stream = self.client.completions.create(model="jspec-code", prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.0, stream=True,
                                                extra_body={"return_token_ids": True})
        for chunk in stream:
            if first is None:
                first = time.perf_counter() - start
            ids += getattr(chunk.choices[0], "token_ids", None) or [] if chunk.choices else []
        return ids, first

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Streams a greedy completion -> (its token ids, the perf_counter time each piece with tokens came)."""
        times, ids = [], []
        stream = self.client.completions.create(model="jspec-code", prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.0, stream=True,
                                                extra_body={"return_token_ids": True})
        for chunk in stream:
            new = (getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else []
            if new:
                times.append(time.perf_counter())
                ids += new
        return ids, times

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, float, int]:
        """Streams a greedy chat reply -> (its text, seconds to the first token, its prompt's tokens)."""
        start = time.perf_counter()
        first, text, prompt_tokens = None, "", 0
        stream = self.client.chat.completions.create(model="jspec-code", messages=messages, max_tokens=max_tokens,
                                                     temperature=0.0, stream=True,
                                                     stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text += chunk.choices[0].delta.content
        return text, first, prompt_tokens

    def complete_all(self, prompts: list[list[int]], max_tokens: int, watch: bool = False):
        """Every prompt at once -> (token ids each, TTFT each, the most requests seen running)."""
        most, stop = [0], threading.Event()

        def poll():
            while not stop.is_set():
                most[0] = max(most[0], int(self.metric("jspec:num_requests_running")))
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        if watch:
            poller.start()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
        stop.set()
        return [r[0] for r in results], [r[1] for r in results], most[0]


def offline(prompts: list[list[int]], max_tokens: int, max_seq_len: int) -> list[list[int]]:
    import jspec

    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=len(prompts),
                                              max_seq_len=max_seq_len)
    return engine.generate(prompts, max_new_tokens=max_tokens).token_ids


def humaneval_ids(count: int, length: int, offset: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: HumanEval prompts' tokens (the bundled tokenizer), cut."""
    import jspec
    from jspec.tokenizer import load_tokenizer
    from jspec.train.corpus import human_eval_prompts

    tokenizer = load_tokenizer(jspec.bundled_model())
    texts = [p["prompt"] for p in human_eval_prompts()]
    ids = [tokenizer.encode(t).ids for t in texts]
    ids = [i for i in ids if len(i) >= length]
    return [i[-length:] for i in ids[offset:offset + count]]


def check(name: str, ok: bool, failures: list[str]) -> None:
    print(f"  {'PASS' if ok else 'FAIL'}: {name}")
    if not ok:
        failures.append(name)


def capacity(failures: list[str], pool_tokens: int = 8192, name: str = "capacity") -> None:
    prompts, budget = humaneval_ids(48, 60), 64
    flags = ["--drafter", "none", "--max-seq-len", "2048", "--max-total-tokens", str(pool_tokens)]
    with Server(flags) as server:
        server.complete_all(prompts[:4], 4)  # warm
        before = server.metric("jspec:num_preemptions_total")
        outputs, _, most = server.complete_all(prompts, budget, watch=True)
        preempted = server.metric("jspec:num_preemptions_total") - before
    expected = offline(prompts, budget, 2048)
    equal = sum(a == b for a, b in zip(outputs, expected))
    print(f"  {name}: pool {pool_tokens} tokens, 48 requests of 60 + {budget} tokens: at most {most} running, "
          f"{preempted:.0f} preemptions, {equal}/48 equal to offline greedy")
    check(f"{name}: every output equals offline", equal == 48, failures)
    if name == "capacity":
        check("capacity: at least 32 running at once", most >= 32, failures)
    else:
        check("preemption: preemptions counted", preempted > 0, failures)


def caching_flags(drafter: str, caching: bool) -> list[str]:
    """The prefix and multi-turn checks' server: ``drafter`` ("default": the server's own), prefix caching on or
    off."""
    return (["--max-seq-len", "1024"] + ([] if drafter == "default" else ["--drafter", drafter])
            + ([] if caching else ["--no-enable-prefix-caching"]))


def prefix(failures: list[str], drafter: str = "none") -> None:
    shared = humaneval_ids(1, 500)[0]
    tails = humaneval_ids(16, 12, offset=20)
    prompts = [shared + tail for tail in tails]
    budget = 16
    figures = {}
    for caching in (True, False):
        with Server(caching_flags(drafter, caching)) as server:
            server.complete_all([humaneval_ids(1, 40, offset=40)[0]], 2)  # warm, shares nothing
            first, _ = server.complete(prompts[0], budget)
            queries, hits = (server.metric("jspec:prefix_cache_queries_total"),
                             server.metric("jspec:prefix_cache_hits_total"))
            outputs, ttfts, _ = server.complete_all(prompts[1:], budget)
            hit_tokens = server.metric("jspec:prefix_cache_hits_total") - hits
            figures[caching] = dict(outputs=[first] + outputs, ttft=float(np.median(ttfts)), hits=hit_tokens,
                                    queries=server.metric("jspec:prefix_cache_queries_total") - queries)
    on, off = figures[True], figures[False]
    shared_tokens = 15 * len(shared)
    print(f"  prefix: 15 requests after the first: {on['hits']:.0f} of {shared_tokens} shared prompt tokens hit "
          f"({on['hits'] / shared_tokens:.0%}); TTFT p50 {on['ttft'] * 1e3:.0f} ms cached vs {off['ttft'] * 1e3:.0f} "
          f"ms uncached ({off['ttft'] / on['ttft']:.1f}x)")
    expected = offline(prompts, budget, 1024)
    check("prefix: hits >= 90% of the shared tokens", on["hits"] >= 0.9 * shared_tokens, failures)
    check("prefix: TTFT p50 at least 3x lower", off["ttft"] >= 3 * on["ttft"], failures)
    check("prefix: outputs equal offline, cached and not",
          on["outputs"] == expected and off["outputs"] == expected, failures)


def chunked(failures: list[str], drafter: str = "none") -> None:
    """8 requests stream (60-token prompts, 96 new tokens each); once all have their first token a 900-token prompt
    arrives. With the prompt prefilled whole (--max-num-batched-tokens 2048) the streams stall for its whole
    prefill; in pieces of 128 tokens, for one piece at a time. Reports the streams' longest gap after the long
    prompt arrived, and its TTFT."""
    shorts = humaneval_ids(8, 60)
    long_prompt = sum(humaneval_ids(12, 100, offset=30), [])[:900]
    budget, long_budget = 96, 16
    figures = {}
    for batched in (2048, 128):
        flags = (["--max-seq-len", "1024", "--max-num-batched-tokens", str(batched), "--no-enable-prefix-caching"]
                 + ([] if drafter == "default" else ["--drafter", drafter]))
        with Server(flags) as server:
            server.complete_all([humaneval_ids(1, 40, offset=40)[0]], 2)  # warm
            with concurrent.futures.ThreadPoolExecutor(len(shorts) + 1) as pool:
                streams = [pool.submit(server.stream, p, budget) for p in shorts]
                while server.metric("jspec:num_requests_running") < len(shorts):
                    time.sleep(0.01)
                time.sleep(0.3)  # every short stream under way
                arrived = time.perf_counter()
                long_ids, long_times = pool.submit(server.stream, long_prompt, long_budget).result()
                results = [f.result() for f in streams]
        gaps = [later - earlier for _, times in results for earlier, later in zip(times, times[1:])
                if later > arrived]
        figures[batched] = dict(gap=max(gaps, default=0.0), ttft=long_times[0] - arrived,
                                outputs=[ids for ids, _ in results] + [long_ids])
        print(f"  chunked: --max-num-batched-tokens {batched}: the streams' longest gap after the 900-token prompt "
              f"arrived {figures[batched]['gap'] * 1e3:.0f} ms; its TTFT {figures[batched]['ttft'] * 1e3:.0f} ms")
    whole, pieces = figures[2048], figures[128]
    expected = offline(shorts, budget, 1024) + offline([long_prompt], long_budget, 1024)
    check("chunked: the longest stall at least 2x shorter in pieces", whole["gap"] >= 2 * pieces["gap"], failures)
    check("chunked: outputs equal offline, whole and in pieces",
          whole["outputs"] == expected and pieces["outputs"] == expected, failures)


def multiturn(failures: list[str], drafter: str = "eagle3", sessions: int = 8, turns: int = 6) -> None:
    """``sessions`` chats of ``turns`` turns, each turn's prompt the whole conversation so far (a system prompt of
    two HumanEval problems, then every user turn and reply), the sessions' turns sent at once, turn after turn;
    with the prefix cache and without. Reports the share of what later turns share with the turn before (its
    prompt) that hit the cache, and the later turns' TTFT p50 each way, after two other sessions (unmeasured) whose
    turns set off the compiles of the cached prefills those widths run on."""
    from jspec.train.corpus import human_eval_prompts

    problems = [p["prompt"] for p in human_eval_prompts()]
    budget = 16
    figures = {}
    for caching in (True, False):
        with Server(caching_flags(drafter, caching)) as server:
            # two sessions of other problems first, unmeasured: the cached prefills of the turns' widths compile on
            # first use (off the scheduler's thread), and until they are compiled a turn is prefilled whole
            warm = [[{"role": "system", "content": "Project:\n" + problems[-1 - s]}] for s in range(2)]
            for turn in range(turns):
                for history in warm:
                    history.append({"role": "user", "content": f"Turn {turn}: write the next helper."})
                    history.append({"role": "assistant", "content": server.chat(history, budget)[0]})
            while server.metric("jspec:programs_compiling"):
                time.sleep(1.0)
            histories = [[{"role": "system", "content": "Project:\n" + problems[2 * s] + problems[2 * s + 1]}]
                         for s in range(sessions)]
            previous, shared, later_ttfts, replies = [0] * sessions, 0, [], []
            hits = server.metric("jspec:prefix_cache_hits_total")
            for turn in range(turns):
                for history in histories:
                    history.append({"role": "user", "content": f"Turn {turn}: write the next helper."})
                with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
                    answers = list(pool.map(lambda h: server.chat(h, budget), histories))
                for session, (text, ttft, prompt_tokens) in enumerate(answers):
                    if turn:
                        shared += previous[session]
                        later_ttfts.append(ttft)
                    previous[session] = prompt_tokens
                    histories[session].append({"role": "assistant", "content": text})
                    replies.append(text)
            figures[caching] = dict(hits=server.metric("jspec:prefix_cache_hits_total") - hits, shared=shared,
                                    ttft=float(np.median(later_ttfts)), replies=replies)
    on, off = figures[True], figures[False]
    print(f"  multiturn: {sessions} sessions x {turns} turns ({drafter}): turns after the first hit {on['hits']:.0f} "
          f"of the {on['shared']} prompt tokens they share with the turn before ({on['hits'] / on['shared']:.0%}); "
          f"their TTFT p50 {on['ttft'] * 1e3:.0f} ms cached vs {off['ttft'] * 1e3:.0f} ms uncached "
          f"({off['ttft'] / on['ttft']:.1f}x)")
    check("multiturn: hits >= 90% of the shared history", on["hits"] >= 0.9 * on["shared"], failures)
    check("multiturn: later turns' TTFT p50 at least 3x lower", off["ttft"] >= 3 * on["ttft"], failures)
    check("multiturn: the replies equal, cached and not", on["replies"] == off["replies"], failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checks", nargs="+", choices=("capacity", "preemption", "prefix", "chunked", "multiturn"))
    parser.add_argument("--drafter", default=None,
                        help="the prefix, chunked and multiturn checks' drafter: none (plain decoding), default (the "
                             "server's), or a name (default: none; eagle3 for multiturn)")
    args = parser.parse_args(argv)
    failures: list[str] = []
    for name in args.checks:
        print(name)
        if name == "capacity":
            capacity(failures)
        elif name == "preemption":
            capacity(failures, pool_tokens=2560, name="preemption")
        elif name == "chunked":
            chunked(failures, args.drafter or "none")
        elif name == "multiturn":
            multiturn(failures, args.drafter or "eagle3")
        else:
            prefix(failures, args.drafter or "none")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
