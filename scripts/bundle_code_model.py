"""Convert the trained trio (HF directories from scripts/train_target.py and scripts/train_drafter.py) into
the package's bundled code model, jspec/assets/code-model/{target,eagle3,draft}, in bf16.

    python scripts/bundle_code_model.py --target T_HF --eagle3 E_HF --draft D_HF
"""

import argparse

from jspec.tools.bundled import BUNDLE_DIR, build_bundle

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--eagle3", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dst", default=BUNDLE_DIR)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    for part, path in build_bundle(args.target, args.eagle3, args.draft, args.dst, args.dtype).items():
        print(f"{part}: {path}")
