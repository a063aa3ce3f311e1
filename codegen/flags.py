"""Compiler and linker flags of the kernel modules, for setup.py (generated/ and
smi_core._quadrature, at install) and ``codegen.build`` (on demand) alike.  No imports beyond the
standard library: setup.py loads this file by path, in a build environment without SymPy."""
from __future__ import annotations

import platform
import sys


def kernel_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags: the samples' loops vectorised for the CPU the kernels are built on
    (-march=native), calling glibc's vector exp and log (libmvec, where -fno-math-errno lets them;
    x86-64 Linux only: elsewhere the loops stay scalar)."""
    mvec = platform.machine() == "x86_64" and sys.platform.startswith("linux")
    return (["-O3", "-fopenmp", "-march=native", "-fno-math-errno"] + ["-DSMI_MVEC"] * mvec,
            ["-fopenmp"] + ["-lmvec"] * mvec)
