"""``szconvert``: assembles the subcommands and turns known errors into one line and exit status 1.

A first positional argument that is not a subcommand is a path to convert, so ``szconvert model.safetensors
model.szt`` is ``szconvert convert model.safetensors model.szt``. Options go anywhere, as people type them: before
the command, between positionals or after them (``szconvert -q m.safetensors m.szt``, ``szconvert convert
m.safetensors -q m.szt``). Errors szformat expects (malformed input, missing files, a full disk, refused Hub
requests) print ``szconvert: error: ...`` on stderr; a traceback is shown only with ``SZFORMAT_DEBUG=1``, or for
errors nobody expected (bugs). A reader that closes the pipe early (``szconvert info m.szt | head``) ends the
command quietly. Ctrl-C, SIGTERM and SIGHUP remove the temporary output and print one line (exit status 128 + the
signal's number).

The command modules import torch and huggingface_hub inside the functions that run a command, so ``--help`` and
``--version`` answer at once, and Ctrl-C while torch loads prints one line like any other interruption.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Sequence

from .. import __version__
from ..codec import cpu_kernel
from ..errors import OutputExistsError, SzformatError
from . import convert, decompress, info, repack, verify
from ._signals import exit_status, termination_as_interrupt

COMMANDS = {module.NAME: module for module in (convert, decompress, info, repack, verify)}
DEFAULT_COMMAND = convert.NAME
WRITING_COMMANDS = frozenset({convert.NAME, decompress.NAME, repack.NAME})
"""Commands that write an output: an interruption of one says that none was left half-written."""
DEBUG_VARIABLE = "SZFORMAT_DEBUG"
CLOSED_PIPE_STATUS = 128 + 13
"""What a shell reports for a command that a closed pipe stopped (SIGPIPE), as for ``cat``, ``ls`` and friends."""

EXAMPLES = """\
examples:
  szconvert model.safetensors                    convert one file to model.szt beside it
  szconvert ./model-dir ./model-dir-szt          convert a model folder (shards, index, config, tokenizer)
  szconvert hf://user/model ./out                convert a safetensors repo from the Hub
  szconvert model.safetensors --cast bf16        an F32/F16 checkpoint: cast to BF16 first (lossy), then compress
  szconvert decompress model.szt out.safetensors back to safetensors, bit for bit
  szconvert info model.szt                       sizes, ratio and encoding of every tensor
  szconvert repack model.szt small.szt           the smaller at-rest form (or back, with --at-rest none)
  szconvert verify ./model-dir-szt               check every checksum and decode every tensor

Only BF16 tensors compress (to about 75 % of their bytes); tensors of other dtypes are stored as they are.
Run 'szconvert COMMAND --help' for the options of a command; options may come before or after paths.
"""


class _Version(argparse.Action):
    """``--version``: szformat's version and the codecs this install runs, looked up only when asked (the GPU
    line reads Triton's installed version: neither Triton nor torch is imported)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and the codecs this install runs, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    """``szconvert (szformat) 0.1.0``, then ``CPU codec: native (avx2)`` and ``GPU codec: Triton 3.6.0`` (or why
    there is none: Triton missing or older than the kernels need)."""
    from .._versions import installed_version
    from ..codec import gpu

    problem = gpu.triton_missing()
    if problem is None:  # the version is unknown where another distribution provides Triton
        gpu_line = f"GPU codec: Triton {installed_version('triton') or ''}".rstrip()
    else:
        gpu_line = f"GPU codec: none ({problem})"
    return f"szconvert (szformat) {__version__}\nCPU codec: {cpu_kernel.KERNEL}\n{gpu_line}"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (``--help``, ``--version``, the list of commands) and each command's own parser."""
    parser = argparse.ArgumentParser(
        prog="szconvert", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Convert safetensors checkpoints to szformat (.szt: lossless, smaller BF16) and back, "
                    "inspect and verify them.")
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        module.register(subparsers)
    return parser, dict(subparsers.choices)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``szconvert`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status.

    Usage errors found by the argument parser exit through ``SystemExit(2)``, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            return _run(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # a closed pipe surfaces here at the latest, while it can still be handled
    except BrokenPipeError:
        _discard_stdout()
        return CLOSED_PIPE_STATUS


def _run(argv: list[str]) -> int:
    parser, commands = build_parser()
    command, rest = split_command(argv, commands)
    mistyped = _mistyped_command(command, rest, commands)
    if mistyped is not None:
        print(f"szconvert: error: {mistyped}", file=sys.stderr)
        return 2
    if command is None:
        parser.parse_args(rest)  # --help, --version, or a usage error
        parser.print_help(sys.stderr)
        return 2
    args = commands[command].parse_intermixed_args(rest)
    args.command = command
    mark = len(_published_since(0))
    try:
        with termination_as_interrupt():
            return args.run(args)
    except BrokenPipeError:
        raise
    except (SzformatError, OSError) as e:
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        print(f"szconvert: error: {describe_error(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        status, what = exit_status(e)
        done = _published_since(mark)
        if done:  # the work is done: say so and succeed, or a script would run it again into "exists"
            print(f"szconvert: {what} after the output was complete: {done[-1]} (kept)", file=sys.stderr)
            return 0
        left = "; no partial output was left" if command in WRITING_COMMANDS else ""
        print(f"szconvert: {what}{left}", file=sys.stderr)
        return status


def split_command(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> tuple[str | None, list[str]]:
    """The command ``argv`` names and the arguments left for it, wherever the options stand.

    The first positional argument (skipping options and the values of options that take one) is the command if it
    names one, and is taken out; otherwise it is a path and the command is ``convert``. ``None`` when there is no
    positional argument at all: the top-level parser answers (``--help``, ``--version``, usage).
    """
    i = _first_positional(argv, commands)
    if i is None:
        return None, argv
    if argv[i] == "--":  # everything after it is a path
        return (DEFAULT_COMMAND, argv) if i + 1 < len(argv) else (None, argv)
    if argv[i] in commands:
        return argv[i], argv[:i] + argv[i + 1:]
    return DEFAULT_COMMAND, argv


def _first_positional(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> int | None:
    """Where the first argument that is neither an option nor an option's value stands (``--`` counts)."""
    takes_value = {option for parser in commands.values() for action in parser._actions if action.nargs != 0
                   for option in action.option_strings}
    skip_next = False
    for i, token in enumerate(argv):
        if skip_next:
            skip_next = False
        elif token.startswith("-") and token not in ("-", "--"):
            skip_next = token in takes_value
        else:
            return i
    return None


def _mistyped_command(command: str | None, argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> str | None:
    """What to say when the path a conversion was given is no file but looks like a command misspelt
    (``szconvert verfiy m.szt``), rather than reporting a missing file."""
    if command != DEFAULT_COMMAND:
        return None
    i = _first_positional(argv, commands)
    first = None if i is None else argv[i]
    if first is None or first == "--" or os.path.lexists(first):
        return None
    close = difflib.get_close_matches(first, list(commands), n=1, cutoff=0.6)
    return f"{first!r} is neither a command nor a file; did you mean 'szconvert {close[0]}'?" if close else None


def _published_since(mark: int) -> list:
    """The outputs this process put in place after the first ``mark`` (none if it wrote none: the module that
    records them is not even imported then)."""
    atomic = sys.modules.get("szformat.format.atomic")
    return [] if atomic is None else atomic.PUBLISHED[mark:]


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what is still buffered does not fail on
    the closed pipe again and print "Exception ignored ... BrokenPipeError" (the recipe of Python's docs on
    SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file descriptor
        pass


def describe_error(error: Exception) -> str:
    """One line for a known error: szformat's own messages name file and tensor; OS errors their path."""
    if isinstance(error, OutputExistsError):  # the API's own words name its argument; here, the option
        return str(OutputExistsError(error.filename, option="--overwrite"))
    if isinstance(error, SzformatError):
        return str(error)
    if isinstance(error, OSError) and error.filename:
        return f"{error.strerror or error}: {error.filename!r}"
    return " ".join(str(error).split()) or type(error).__name__  # other libraries' messages may span lines
