"""Declares the optional C extension ``ucm_db._native``; everything else is in pyproject.toml.

The extension is optional: if it cannot be compiled (no C compiler, no
Python headers) the package still installs and ``ucm_db.codec.native`` falls back
to pure Python and numpy. ``tests/test_native.py`` fails in such an
environment, with the fix in its message.
"""

import sys

from setuptools import Extension, setup

# -O3 but no -march=native: the build must run on any host of its platform.
COMPILE_ARGS = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(
            "ucm_db._native", sources=["ucm_db/_native.c", "ucm_db/_native_loads.c", "ucm_db/_native_plan.c"],
            depends=["ucm_db/_native_kernels.h", "ucm_db/_native_loads.h"], extra_compile_args=COMPILE_ARGS, optional=True,
        ),
    ],
)
