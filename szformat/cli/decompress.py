"""``szconvert decompress``: .szt (file, sharded index or converted folder) back to safetensors, bit for bit."""

from __future__ import annotations

import argparse

from ._common import SZT_PATH_HELP, add_command, add_quiet, print_lines, show_progress

NAME = "decompress"

EXAMPLES = """\
examples:
  szconvert decompress model.szt                    writes model.safetensors beside it
  szconvert decompress model.szt out.safetensors
  szconvert decompress ./model-szt ./model          a folder: .safetensors shards and their index again

Tensors and __metadata__ come back bit for bit (checksums are checked on the way); a file written by the
safetensors package comes back byte for byte.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="convert .szt back to safetensors", examples=EXAMPLES,
        description="Convert a .szt file, a *.szt.index.json sharded checkpoint or a converted folder back to "
                    "safetensors.")
    parser.add_argument("input", help=SZT_PATH_HELP)
    parser.add_argument("output", nargs="?", help="the .safetensors file, or the output folder for anything but a "
                                                  "single file (default for a single file: beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from ..convert import decompress

    report = decompress(args.input, args.output, overwrite=args.overwrite, progress=show_progress(args))
    if not args.quiet:
        print_lines([f"Wrote {report.output}"] + report.restored_summary())
    return 0
