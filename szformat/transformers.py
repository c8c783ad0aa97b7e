"""Load a converted transformers model in one call: ``szformat.transformers.from_pretrained(folder_or_repo)``.

Shaped like ``transformers``' own ``from_pretrained``: the config is read from the folder, the model is built
without allocating its weights (parameters on ``meta``, buffers computed by its ``__init__``), the .szt weights are
decoded straight onto ``device`` (the GPU load path for CUDA) and become the model's parameters without a second
copy, tied weights are tied again, a checkpoint saved with or without the base-model prefix fits either class, names
transformers converts on load are converted alike (legacy and older names renamed, per-expert MoE tensors fused on
``device``: see ``transformers_conversions``), and weights the checkpoint lacks are initialized and reported the way
transformers reports them. Imported only when used; needs ``pip install 'szformat[transformers]'``.
"""

from .integrations.transformers import from_pretrained

__all__ = ["from_pretrained"]
