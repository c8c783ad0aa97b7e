"""``szconvert verify``: check headers and checksums and decode every tensor; exit 1 naming what is bad."""

from __future__ import annotations

import argparse
import sys

from ._common import SZT_PATH_HELP, add_command, add_quiet, print_lines, show_progress

NAME = "verify"

EXAMPLES = """\
examples:
  szconvert verify model.szt
  szconvert verify ./model-szt                      every .szt file and index in the folder
  szconvert verify model.szt.index.json             the index and the shards it names
  szconvert verify a.szt b.szt                      several, each with its own summary

Exit status: 0 when everything checks, 1 when anything is wrong (each bad file and tensor is listed).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="check every checksum and decode every tensor", examples=EXAMPLES,
        description="Verify a .szt file, a *.szt.index.json sharded checkpoint or a converted folder: headers, "
                    "stored checksums, and every tensor decoded against the checksum of its raw bytes.")
    parser.add_argument("paths", nargs="+", metavar="path", help=SZT_PATH_HELP)
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from ..convert import verify

    status = 0
    for path in args.paths:
        report = verify(path, progress=show_progress(args))
        summary = report.summary()
        if len(args.paths) > 1:
            summary[0] = f"{path}: {summary[0]}"
        if not report.ok:  # what is wrong goes to stderr, even with --quiet
            print_lines(summary, file=sys.stderr)
            status = 1
        elif not args.quiet:
            print_lines(summary)
    return status
