"""szformat inside the libraries users load models with: transformers and diffusers (``from_pretrained``), and the
model-folder logic they share (finding a converted folder's weights, building the model on ``meta``, filling it).

Each integration imports its library only when used; the public import paths are :mod:`szformat.transformers` and
:mod:`szformat.diffusers`.
"""
