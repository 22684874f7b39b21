"""``jspec convert``: a Hugging Face checkpoint -> a jspec directory, all or nothing at --dst."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from jspec.tools.interrupt import on_interrupt

def add_convert_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``jspec convert`` (scripts/convert_checkpoint.py shows the same)."""
    parser.add_argument("--src", required=True,
                        help="Hugging Face directory: config.json + *.safetensors (a Llama-family target, with the "
                             "MTP modules it ships written into DST/mtp/, or an EAGLE-3 head in any published "
                             "layout, EAGLE's pytorch_model.bin included: docs/checkpoints.md)")
    parser.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="parameter dtype; auto: the checkpoint's own")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --dst")
    parser.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8", "int4"],
                        help="store a target's linear layers weight-only quantized (qwix; int4 in groups of 128): "
                             "loading reads them as stored")


def _remove_tree(path: str, settle_seconds: float = 0.3, limit_seconds: float = 3.0) -> None:
    """Removes ``path`` and keeps removing it until it has stayed gone for ``settle_seconds``: orbax's background
    writer may still be finishing a leaf (creating or renaming directories in it) when Ctrl-C arrives. Gives up
    after ``limit_seconds`` so that an interrupt still exits promptly."""
    deadline = time.monotonic() + limit_seconds
    gone_since = None
    while time.monotonic() < deadline:
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= settle_seconds:
            return
        time.sleep(0.02)


def run_convert(args: argparse.Namespace) -> int:
    """Converts into a staging directory beside --dst and renames it into place, so that neither a failure nor
    Ctrl-C (which ends the process at once: see :func:`exit_on_interrupt`) leaves anything at --dst or beside it."""
    from models.checkpoint import check_destination, convert_hf_checkpoint

    dst = os.path.abspath(args.dst)
    check_destination(dst, args.overwrite)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.converting-", dir=os.path.dirname(dst))
    try:
        with on_interrupt(lambda: _remove_tree(staging)):
            converted = convert_hf_checkpoint(args.src, os.path.join(staging, "out"), dtype=args.dtype,
                                              quantization=args.quantization)
            check_destination(dst, args.overwrite)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            os.rename(converted, dst)
    finally:
        _remove_tree(staging)
    print(f"wrote {dst}")
    return 0
