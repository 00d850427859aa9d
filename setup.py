"""The one compiled part: dtrain/bridge/_dgrd_native.c, a DGRD packet's section walk and sparse checks (see
dtrain/bridge/dgrd.py).

Everything else about the package is in pyproject.toml. The extension is optional: where it does not build (no C
compiler), the install goes on and dtrain.bridge.dgrd does the same in Python and numpy.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("dtrain.bridge._dgrd_native", ["dtrain/bridge/_dgrd_native.c"], extra_compile_args=["-O3"],
                             optional=True)])
