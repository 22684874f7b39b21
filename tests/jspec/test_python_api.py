"""The README's Python example runs as written on the bundled model, and what it promises holds: the default
compute dtype keeps speculative output equal to plain decoding's, and ``stream_text`` adds up to the texts."""

import os
import re

import jspec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_python_example() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]
def test_readme_python_example_runs(capsys):
    namespace = {}
    exec(compile(readme_python_example(), "README.md", "exec"), namespace)
    plain, spec = namespace["out"], namespace["spec_out"]
    assert plain.stats.acceptance_length == 1.0 and spec.stats.acceptance_length > 1.0
    assert spec.token_ids == plain.token_ids and spec.texts == plain.texts  # lossless under greedy
    printed = capsys.readouterr().out
    assert plain.texts[0] in printed  # the streamed text deltas, printed as they came
def test_default_dtype_is_float32_on_cpu_for_the_bf16_bundle():
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=1, max_seq_len=64)
    assert engine.setup.dtype == "float32"
    assert jspec.engine.default_dtype() == "float32"
    kept = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), max_batch_size=1, max_seq_len=64,
                                            dtype="bfloat16")
    assert kept.setup.dtype == "bfloat16"
