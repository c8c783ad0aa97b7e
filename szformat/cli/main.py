"""``szconvert``: assembles the subcommands and turns known errors into one line and exit status 1.

A first argument that is not a subcommand is a path to convert, so ``szconvert model.safetensors model.szt`` is
``szconvert convert model.safetensors model.szt``. Errors szformat expects (malformed input, missing files, a full
disk, refused Hub requests) print ``szconvert: error: ...`` on stderr; a traceback is shown only with
``SZFORMAT_DEBUG=1``, or for errors nobody expected (bugs).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import __version__
from ..errors import SzformatError
from . import convert, decompress, info, verify

COMMANDS = {module.NAME: module for module in (convert, decompress, info, verify)}
DEFAULT_COMMAND = convert.NAME
DEBUG_VARIABLE = "SZFORMAT_DEBUG"

EXAMPLES = """\
examples:
  szconvert model.safetensors                    convert one file to model.szt beside it
  szconvert ./model-dir ./model-dir-szt          convert a model folder (shards, index, config, tokenizer)
  szconvert hf://user/model ./out                convert a safetensors repo from the Hub
  szconvert decompress model.szt out.safetensors back to safetensors, bit for bit
  szconvert info model.szt                       sizes, ratio and encoding of every tensor
  szconvert verify ./model-dir-szt               check every checksum and decode every tensor

Run 'szconvert COMMAND --help' for the options of a command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="szconvert", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Convert safetensors checkpoints to szformat (.szt: lossless, smaller BF16) and back, "
                    "inspect and verify them.")
    parser.add_argument("--version", action="version", version=f"szconvert (szformat) {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``szconvert`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status.

    Usage errors found by the argument parser exit through ``SystemExit(2)``, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        argv.insert(0, DEFAULT_COMMAND)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except (SzformatError, OSError) as e:
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        print(f"szconvert: error: {describe_error(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        print("szconvert: interrupted; no partial output was left", file=sys.stderr)
        return 130


def describe_error(error: Exception) -> str:
    """One line for a known error: szformat's own messages name file and tensor; OS errors their path."""
    if isinstance(error, SzformatError):
        return str(error)
    if isinstance(error, FileExistsError) and error.filename:
        return f"{error.filename!r} exists; pass --overwrite to replace it"
    if isinstance(error, OSError) and error.filename:
        return f"{error.strerror or error}: {error.filename!r}"
    return str(error) or type(error).__name__
