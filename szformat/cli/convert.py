"""``szconvert convert``: safetensors (file, sharded index, model folder or Hub repo) to .szt."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..errors import CLIError
from ._common import add_at_rest, add_command, add_quiet, at_rest_level, print_lines, show_progress

if TYPE_CHECKING:
    from ..convert import ConversionReport

NAME = "convert"
HUB_REF_PREFIX = "hf://"
"""What marks a Hub source; tested here so that local conversions do not import huggingface_hub (0.3 s)."""
CAST_CHOICES = ("bf16",)
"""The values of --cast (szformat.convert.cast.CAST_TARGETS, repeated here so that --help does not import torch)."""

EXAMPLES = """\
examples:
  szconvert model.safetensors                       writes model.szt beside it
  szconvert model.safetensors out/model.szt
  szconvert model.safetensors.index.json ./out      a sharded checkpoint: .szt shards and model.szt.index.json
  szconvert ./FLUX.1-dev ./FLUX.1-dev-szt           a model folder, sub-folders (transformer/, vae/...) included
  szconvert model.safetensors --device cuda         encode on the GPU (the same bytes, faster)
  szconvert hf://user/model ./model-szt --push-to-hub user/model-szt
  szconvert model-fp32.safetensors --cast bf16      cast F32/F16 tensors to BF16, then compress (lossy)
  szconvert model.safetensors --at-rest zstd        the smaller at-rest form (format 1.1/1.2), inflated on load

The command 'convert' may be left out: 'szconvert IN OUT' is 'szconvert convert IN OUT'.
Every tensor is decoded again and compared bit for bit before it is written; outputs appear whole or not at all.

What compresses: in the in-memory form, BF16 tensors only, to about 75 % of their bytes; every other tensor (F32,
F16, FP8, integers) is stored as it is, so an F32 or F16 checkpoint gives a file no smaller than its source. The
at-rest form (--at-rest zstd) stores every dtype losslessly as byte planes through zstd: about 0.82-0.83 of raw for
real F32 weights, 0.84-0.85 for F16, 0.72-0.81 for FP8, inflated on load. Or, for such a checkpoint, --cast bf16
casts its F16/F32/F64 tensors to BF16 first (an F32 tensor halves, then compresses): lossy, the output holds the
cast values (rounded to nearest even, as torch's .to(torch.bfloat16)), its metadata records the cast, and verify
checks the cast values.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="convert safetensors to .szt (the default command)", examples=EXAMPLES,
        description="Convert a .safetensors file, a sharded checkpoint (*.safetensors.index.json), a model folder "
                    "or an hf://user/repo safetensors repo to szformat.")
    parser.add_argument("input", help="a .safetensors file, a *.safetensors.index.json, a model folder or "
                                      "hf://user/repo[@revision][/path]")
    parser.add_argument("output", nargs="?", help="the .szt file, or the output folder for anything but a single "
                                                  "file (default for a single file: beside it, with .szt)")
    parser.add_argument("--device", default="cpu", help="where to encode: cpu (default) or cuda")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--cast", choices=CAST_CHOICES,
                        help="cast F16/F32/F64 tensors to this dtype before compressing (LOSSY: the output is not "
                             "bit-exact to the source; only BF16 compresses)")
    add_at_rest(parser, default=None, help_default="none, or zstd with --push-to-hub (what people download)")
    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument("--push-to-hub", metavar="REPO_ID",
                     help="upload the result to this model repo (token and repo are checked before converting)")
    hub.add_argument("--private", action="store_true", help="create the repo private (with --push-to-hub)")
    hub.add_argument("--revision", help="branch to push to (with --push-to-hub), created if missing")
    hub.add_argument("--commit-message", help="message of the upload commit (with --push-to-hub)")
    hub.add_argument("--token", help="Hub token for download and upload (default: HF_TOKEN or the saved login)")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    push_only = [flag for flag, value in (("--private", args.private), ("--revision", args.revision),
                                          ("--commit-message", args.commit_message)) if value]
    if push_only and not args.push_to_hub:
        raise CLIError(f"{', '.join(push_only)} only apply to an upload: add --push-to-hub USER/REPO")
    from_hub = args.input.startswith(HUB_REF_PREFIX)
    if from_hub and args.output is None:
        raise CLIError(f"give an output path: szconvert {args.input} ./out")
    if not (args.push_to_hub or from_hub):
        _convert(args, args.input)
        return 0
    hub = _hub_module()
    with hub.one_line_errors():
        ref = hub.parse_hub_ref(args.input) if from_hub else None
        if args.push_to_hub:  # token, network and repo are checked before a conversion that may take minutes
            hub.check_push_access(args.push_to_hub, private=args.private or None, token=args.token)
        report = _convert(args, hub.download_safetensors_repo(ref, token=args.token) if ref else args.input)
        if args.push_to_hub:
            commit = hub.push_to_hub(report.output, args.push_to_hub, private=args.private or None,
                                     revision=args.revision, commit_message=args.commit_message, token=args.token,
                                     base_model=ref.repo_id if ref else None)
            if not args.quiet:
                print(f"Pushed to {commit.commit_url}")
    return 0


def _convert(args: argparse.Namespace, source: str | os.PathLike) -> ConversionReport:
    from ..convert import convert

    report = convert(source, args.output, device=args.device, overwrite=args.overwrite, cast=args.cast,
                     at_rest=at_rest_level(_form(args)), progress=show_progress(args))
    if not args.quiet:
        print_lines([f"Wrote {report.output}"] + report.summary() + report.dtype_notes())
    return report


def _form(args: argparse.Namespace) -> str:
    """The ``--at-rest`` value, or the default: the at-rest form for a push (what people download), the in-memory
    form otherwise (what loads fastest)."""
    if args.at_rest is not None:
        return args.at_rest
    return "zstd" if args.push_to_hub else "none"


def _hub_module():
    """The Hub module, checked before any work, so a missing one does not waste a conversion."""
    try:
        from .. import hub
    except ImportError as e:
        raise CLIError(f"Hub support is not available in this installation ({e}); convert locally and upload "
                       "with 'hf upload'") from None
    return hub
