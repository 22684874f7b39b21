"""Train the bundled code model, a small Llama on the Python standard library; same as ``jspec train-target``.

    python scripts/train_target.py --out /tmp/code-model/target_hf --work-dir /tmp/code-model/work

The arguments and the run live in jspec/train/commands.py (``train_target_main``); ``--help`` lists them.
"""

import sys

from jspec.train.commands import train_target_main

if __name__ == "__main__":
    sys.exit(train_target_main())
