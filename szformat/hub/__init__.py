"""Hugging Face Hub support: push converted checkpoints, and load them back by ``hf://`` reference.

- `resolve`: what the loaders call to turn a local path or a Hub reference into local files.
- `push_to_hub`: upload a .szt file or a converted folder, with a generated model card, in one commit;
  `check_push_access` checks token and repo first, before a long conversion.
- `download_model_repo`: fetch a converted model or pipeline repo for ``szformat.transformers``/``diffusers``.
- `download_safetensors_repo`: fetch a safetensors model from the Hub for ``szconvert hf://user/repo ./out``.
"""

from .client import one_line_errors
from .push import check_push_access, push_to_hub
from .refs import HubRef, is_hub_ref, parse_hub_ref
from .resolve import download_model_repo, download_safetensors_repo, hub_ref_from_arguments, resolve

__all__ = ["HubRef", "check_push_access", "download_model_repo", "download_safetensors_repo",
           "hub_ref_from_arguments", "is_hub_ref", "one_line_errors", "parse_hub_ref", "push_to_hub", "resolve"]
