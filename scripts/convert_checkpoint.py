"""Convert a Hugging Face checkpoint directory into one that jspec loads.

    python scripts/convert_checkpoint.py --src HF_DIR --dst OUT_DIR [--dtype auto|float32|bfloat16]

Same as ``jspec convert``. Nothing is left at --dst if the conversion fails or is interrupted.
"""

import argparse
import sys

from jspec.tools.cli import HelpFormatter, add_convert_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_convert_args(parser)
    parser.parse_args()  # --help and argument errors read as this script's
    sys.exit(main(["convert"] + sys.argv[1:]))
