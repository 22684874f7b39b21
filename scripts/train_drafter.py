"""Train a drafter (an EAGLE-3 head or a small draft model) for a trained target; same as ``jspec train-drafter``.

    python scripts/train_drafter.py --kind eagle3 --target TARGET_HF --out HEAD_HF --work-dir WORK
    python scripts/train_drafter.py --kind draft_model --target TARGET_HF --out DRAFT_HF --work-dir WORK

The arguments and the run live in jspec/train/commands.py (``train_drafter_main``); ``--help`` lists them.
"""

import sys

from jspec.train.commands import train_drafter_main

if __name__ == "__main__":
    sys.exit(train_drafter_main())
