"""Run by tests/jspec/serve/test_sharded_serve.py in a subprocess with 4 virtual CPU devices: the bundled model and
its EAGLE-3 head served by a slot engine on a tp=4 mesh (KV heads repeated, head split), with load adaptation
(both step programs), next to the single-device offline engine. Prints one JSON line."""

from __future__ import annotations

import json
import threading

import jspec
from jspec.serve.requests import Request
from jspec.serve.slots import SlotEngine

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "def add(a, b):", "x = 1",
           "# sort a list\ndef sort(xs):"]
BUDGETS = [40, 17, 33, 25, 12, 30]


def main() -> None:
    single = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3", max_batch_size=4,
                                              max_seq_len=128)
    sharded = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter="eagle3", max_batch_size=4,
                                               max_seq_len=128, tensor_parallel_size=4)
    slots = SlotEngine(sharded, row_buckets=(4,), steps_per_chunk=3)
    slots.warm_up(sharded.tokenizer.encode(PROMPTS[0]).ids)
    slots.start()
    served = [[] for _ in PROMPTS]
    finished = [threading.Event() for _ in PROMPTS]
    try:
        for i, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS)):
            def sink(tokens, reason, i=i):
                served[i].extend(tokens)
                if reason is not None:
                    finished[i].set()
            slots.submit(Request(sharded.tokenizer.encode(prompt).ids, budget, sink))
        all_finished = all(event.wait(300) for event in finished)
    finally:
        slots.shutdown(10)
    alone = [single.generate([prompt], max_new_tokens=budget).token_ids[0]
             for prompt, budget in zip(PROMPTS, BUDGETS)]
    print(json.dumps({"finished": all_finished, "served": served, "alone": alone}))


if __name__ == "__main__":
    main()
