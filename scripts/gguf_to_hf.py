"""Convert a GGUF model file into a Hugging Face directory: safetensors weights (dequantised),
config.json and the tokenizer stored in the file (docs/real-models.md).

``sdp train model=hf model.path=FILE.gguf`` reads GGUF files itself; this script is for what
needs a directory, e.g. a vLLM server started by hand or ``sdp train model.path=DIR`` without the
``gguf`` package at training time. Needs the ``gguf`` package (``pip install 'sdp-cli[gguf]'``).

    .venv/bin/python scripts/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf smollm2-135m
    .venv/bin/python scripts/gguf_to_hf.py model.gguf out_dir --dtype bfloat16

transformers dequantises to float32; ``--dtype`` casts on the way out (bfloat16 halves the
files, at the cost of rounding the float32 weights that a run would otherwise start from).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from sdp_cli.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


def convert(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write the model of ``gguf_file`` to ``out_dir`` (which must not exist or be empty) in
    ``dtype``; returns ``out_dir``. Written as ``sdp export`` writes (``export_policy``): into a
    temporary sibling renamed into place, so a stop part-way (Ctrl-C, a full disk) leaves
    ``out_dir`` as it was."""
    import torch

    from sdp_cli.models.export import check_export_target, export_policy
    from sdp_cli.models.gguf import check_gguf_file
    from sdp_cli.models.loader import load_hf_policy

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    check_gguf_file(gguf_file, label=str(gguf_file))
    check_export_target(out_dir)
    policy = load_hf_policy(gguf_file, gguf_cache=False)  # the output is the copy: none in the cache
    return export_policy(policy, out_dir, dtype=getattr(torch, dtype))


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf_file", help="the .gguf file")
    parser.add_argument("out_dir", help="the Hugging Face directory to write (new or empty)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype of the output (default float32)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    signal.signal(signal.SIGTERM, _stop)  # a stop by `kill` cleans up as Ctrl-C does
    started = time.perf_counter()
    try:
        from sdp_cli.models.gguf import dequantised_note

        out = convert(args.gguf_file, args.out_dir, dtype=args.dtype)
        print(dequantised_note(args.gguf_file, args.dtype))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out = Path(args.out_dir).expanduser()
        # the directory is renamed into place whole: holding files, it is complete
        done = out.is_dir() and any(out.iterdir())
        said = f"{out} was written whole before the stop" if done else f"nothing was written to {out}"
        print(f"error: interrupted; {said}", file=sys.stderr)
        return 130
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
