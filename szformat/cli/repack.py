"""``szconvert repack``: a .szt checkpoint between its in-memory form and its smaller at-rest form."""

from __future__ import annotations

import argparse

from ._common import SZT_PATH_HELP, add_at_rest, add_command, add_quiet, at_rest_level, print_lines, show_progress

NAME = "repack"

EXAMPLES = """\
examples:
  szconvert repack model.szt model-small.szt --at-rest zstd     the at-rest form (format 1.1): smaller files
  szconvert repack model-small.szt model.szt --at-rest none     back to the in-memory form: fastest loads
  szconvert repack ./model-szt ./model-szt-small                a folder (default: --at-rest zstd)

Payloads are not re-encoded: only the zstd stage is added or undone, and every checksum is checked on the way.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="move .szt between its in-memory and at-rest forms", examples=EXAMPLES,
        description="Rewrite a .szt file, a *.szt.index.json sharded checkpoint or a converted folder in its "
                    "at-rest form (zstd frames, format 1.1) or its in-memory form (format 1.0).")
    parser.add_argument("input", help=SZT_PATH_HELP)
    parser.add_argument("output", help="the .szt file, or the output folder for anything but a single file")
    add_at_rest(parser, default="zstd")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from ..convert import repack

    report = repack(args.input, args.output, at_rest=at_rest_level(args.at_rest), overwrite=args.overwrite,
                    progress=show_progress(args))
    if not args.quiet:
        print_lines([f"Wrote {report.output}"] + report.summary())
    return 0
