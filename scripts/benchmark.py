"""Every generation method side by side on the same prompts, in one run: ``jspec bench``'s script form.

    python scripts/benchmark.py [--batch-sizes 1,4,16] [--num-prompts 16] [--out bench-results]
    python scripts/benchmark.py --synthetic llama3-8b,llama3-1b --out $OUT     # GPU roofline mode

See jspec/tools/bench.py (and jspec/tools/roofline/) for what is measured and how.
"""

import sys

from jspec.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
