"""Acceptance against draft cost over the draft-vocabulary size of one trained EAGLE-3 head, on HumanEval.

    python scripts/draft_vocab_table.py --eagle3 HEAD_HF --tokens WORK_DIR/generated.npy --sizes 512,1024,2048,4096

The arguments and the run live in jspec/tools/draft_vocab_table.py (``main``); ``--help`` lists them.
"""

import sys

from jspec.tools.draft_vocab_table import main

if __name__ == "__main__":
    sys.exit(main())
