"""The one thing pyproject.toml cannot declare: the optional C extension of the CPU codec.

``optional=True``: where no C compiler is at hand the build goes on without it, and szformat decodes with its
PyTorch reference (``szconvert --version`` says which one a user got).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("szformat.codec._native", ["szformat/codec/_native.c"], optional=True,
                             extra_compile_args=["-O3"])])
