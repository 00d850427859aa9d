"""The one compiled part: bridge/_dgrd_native.c, a DGRD packet's section walk and Mode 2 check (see bridge/dgrd.py).

Everything else about the package is in pyproject.toml. The extension is optional: where it does not build (no C
compiler), the install goes on and bridge.dgrd does the same in Python and numpy.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("bridge._dgrd_native", ["bridge/_dgrd_native.c"], extra_compile_args=["-O3"],
                             optional=True)])
