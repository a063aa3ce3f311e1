"""Compile a kernel module on demand into a cache folder and import it.

Used for models outside the pre-generated set.  The module name is the hash of its text, the
compiler flags and the host's CPU (the build is for this CPU, -march=native), so a changed model
never loads a stale binary, nor a cache shared between machines one built for another CPU.
Compiler errors are shown, never swallowed.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

from derive.registry import KernelSpec

from .flags import kernel_flags
from .generate import render_module


def cache_dir() -> Path:
    """``$SMI_CACHE`` or ``~/.cache/smi/kernels``."""
    root = os.environ.get("SMI_CACHE") or Path.home() / ".cache" / "smi"
    return Path(root) / "kernels"


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_module(kernels: list[KernelSpec], verbose: bool = True):
    """Render, write, compile (Cython + C compiler with OpenMP) and import a module."""
    text = render_module(kernels)
    compile_args, link_args = kernel_flags()
    key = "\n".join([text, *compile_args, *link_args, _cpu()])
    name = "smi_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:    # one compiler per module: other processes (pytest -n,
        fcntl.flock(lock, fcntl.LOCK_EX)        # MPI ranks) wait here, then import its build
        built = sorted(folder.glob(f"{name}*.so"))
        return _import(name, built[0]) if built else _compile(name, folder, text, kernels, verbose)


def _compile(name, folder, text, kernels, verbose):
    pyx = folder / f"{name}.pyx"
    pyx.write_text(text)
    if verbose:
        print(f"smi: compiling kernels {', '.join(k.name for k in kernels)} into {folder} "
              "(first use only; this takes a few seconds)…", file=sys.stderr, flush=True)
    start = time.perf_counter()
    _build_inplace(pyx)
    if verbose:
        print(f"smi: compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return _import(name, next(folder.glob(f"{name}*.so")))


def _cpu() -> str:
    """The host CPU: its architecture and (Linux) the feature flags -march=native builds for."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build_inplace(pyx: Path) -> None:
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    compile_args, link_args = kernel_flags()
    ext = Extension(pyx.stem, [str(pyx)], extra_compile_args=compile_args, extra_link_args=link_args)
    dist = Distribution({"ext_modules": cythonize([ext], language_level=3, quiet=True),
                         "script_name": "smi-build"})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(pyx.parent)
    cmd.build_temp = str(pyx.parent / "build")
    cmd.inplace = False
    dist.run_command("build_ext")
