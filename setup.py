"""The one thing pyproject.toml cannot declare: the optional C extensions (the CPU codec's kernels, the header
check that lets msgpack parse a header without Python hooks, and the check of a header's plain tensor entries).

``optional=True``: where no C compiler is at hand the build goes on without them, and szformat decodes with its
PyTorch reference (``szconvert --version`` says which one a user got) and checks headers in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("szformat.codec._native", ["szformat/codec/_native.c"], optional=True,
                             depends=["szformat/codec/_neon.h"], extra_compile_args=["-O3"]),
                   Extension("szformat.format._msgpack_check", ["szformat/format/_msgpack_check.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("szformat.format._entries", ["szformat/format/_entries.c"], optional=True,
                             extra_compile_args=["-O2"])])
