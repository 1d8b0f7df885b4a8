"""The optional C fast path of the line scanner (src/slotscope/_cscan.c).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built
(no C compiler), slotscope installs without it and reads logs with numpy alone, same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("slotscope._cscan", ["src/slotscope/_cscan.c"], optional=True,
                             extra_compile_args=["-O2"])])
