"""Load a converted diffusers pipeline in one call: ``szformat.diffusers.from_pretrained(folder_or_repo)``.

Every component folder of the pipeline that holds .szt weights (``transformer/``, ``unet/``, ``vae/``,
``text_encoder*/``...) is built on ``meta`` from its config and filled from its .szt files (diffusers models here,
transformers models through :mod:`szformat.transformers`); the other components (schedulers, tokenizers, feature
extractors) are loaded by diffusers itself, which then assembles the pipeline class ``model_index.json`` names.
Every component is checked before any is used; a bad one leaves nothing behind on the GPU (the loads started
meanwhile, on a CUDA device, are waited for and dropped). Imported only when used; needs
``pip install 'szformat[diffusers]'``.
"""

from .integrations.diffusers import from_pretrained, DENOISER_PREFIXES

__all__ = ["from_pretrained", "DENOISER_PREFIXES"]
