"""The compiled kernels (grace_dl/native/kernels.c); everything else is in pyproject.toml.

Optional: where no C compiler is found the build goes on without it and grace_dl uses the
kernels' NumPy twins (``grace_dl.native.available()`` says which). No fused multiply-adds
(``-ffp-contract=off``): the kernels round each operation as torch's elementwise ops do."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("grace_dl.native._kernels", ["grace_dl/native/kernels.c"],
                             extra_compile_args=["-O3", "-ffp-contract=off"], optional=True)])
