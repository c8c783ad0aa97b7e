"""``szconvert info``: what a .szt file (or a converted folder or index) holds, file by file and tensor by tensor."""

from __future__ import annotations

import argparse
import json

from ._common import SZT_PATH_HELP, add_command, print_lines

NAME = "info"

EXAMPLES = """\
examples:
  szconvert info model.szt
  szconvert info ./model-szt                        every .szt file of a converted folder, and the total
  szconvert info model.szt --json                   the same as JSON, for scripts
  szconvert info a.szt b.szt                        several, one after another (--json: a list)

Exit status: 1 when an index names a shard that is missing, or a tensor its shard does not hold.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="show the header, sizes and tensors of .szt files", examples=EXAMPLES,
        description="Show the format version, alignment, metadata, sizes and compression ratio of a .szt file, "
                    "a *.szt.index.json sharded checkpoint or a converted folder, and a table of its tensors. The "
                    "ratio compares the file on disk with the .safetensors file it decompresses to; the payload "
                    "ratio counts tensor bytes alone.")
    parser.add_argument("paths", nargs="+", metavar="path", help=SZT_PATH_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from ..convert.info import describe, describe_lines

    descriptions = [describe(path) for path in args.paths]
    if args.json:
        print(json.dumps(descriptions[0] if len(descriptions) == 1 else descriptions, indent=2, ensure_ascii=False))
    else:
        print_lines([line for i, d in enumerate(descriptions) for line in ([""] if i else []) + describe_lines(d)])
    return 0
