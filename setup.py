"""The one compiled part: bridge/_dgrd_native.c, the DGRD Mode 2 check in one pass (see bridge/mode2_check.py).

Everything else about the package is in pyproject.toml. The extension is optional: where it does not build (no C
compiler), the install goes on and bridge.mode2_check checks with numpy.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("bridge._dgrd_native", ["bridge/_dgrd_native.c"], extra_compile_args=["-O3"],
                             optional=True)])
