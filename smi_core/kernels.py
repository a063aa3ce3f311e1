"""Kernel adapters: find the compiled kernel of a :class:`derive.KernelSpec` (committed in
generated/, else compiled on demand into the cache), or its lambdify twin, behind one call."""
from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

BACKENDS = ("compiled", "twin")
MANIFEST = Path(__file__).resolve().parent.parent / "generated" / "MANIFEST.json"


@lru_cache(maxsize=1)
def pregenerated() -> dict[str, dict]:
    """Name → manifest entry of every kernel committed under generated/."""
    return json.loads(MANIFEST.read_text())["kernels"] if MANIFEST.exists() else {}


class Kernel:
    """``kernel(x, params) -> out``: x (n, n_in) → out (n, n_out), float64, one row per sample."""

    def __init__(self, spec, backend: str = "compiled", siblings=(), threads: int = 0):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.spec, self.backend, self.threads = spec, backend, threads
        self.n_in, self.n_out = _shape(spec)
        self._run = _compiled(spec, tuple(siblings) or (spec,)) if backend == "compiled" else None
        self._twin = None

    def __call__(self, x: np.ndarray, params: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        params = np.ascontiguousarray(params, dtype=np.float64)
        if params.size == 0:
            params = np.zeros(1)
        if self._run is None:
            if self._twin is None:
                from codegen.twin import twin
                self._twin = twin(self.spec.program)
            result = self._twin(x, params)
            if out is None:
                return result
            out[...] = result
            return out
        if out is None:
            out = np.empty((x.shape[0], self.n_out))
        self._run(x, params, out, self.threads)
        return out

    def columns(self, x: np.ndarray, params: np.ndarray, out: np.ndarray) -> None:
        """``out[:, i] = f(x[:, i], params)`` in place: x (n_in, n), out (n_out, n), by columns
        (rows contiguous at any row stride, e.g. row blocks of one array)."""
        params = np.ascontiguousarray(params, dtype=np.float64)
        if params.size == 0:
            params = np.zeros(1)
        if self._run is None:
            out[...] = self(np.ascontiguousarray(x.T), params).T
            return
        self._run.columns(x, params, out, self.threads)

    def capsule(self, layout: str = "row"):
        """The compiled C function (a PyCapsule) for model-independent drivers: one sample's row,
        or samples by columns (layout="columns")."""
        if self._run is None:
            raise ValueError(f"{self.spec.name}: the {self.backend!r} backend has no C function; "
                             "use backend='compiled'")
        return self._run.capsule(layout)


def _shape(spec) -> tuple[int, int]:
    entry = pregenerated().get(spec.name)
    if entry is not None:
        return entry["n_in"], entry["n_out"]
    return spec.program.n_in, spec.program.n_out


def _compiled(spec, siblings):
    """The compiled callable: from generated/ when committed there, else built on demand
    together with ``siblings`` (the other kernels of the same model) into one cached module."""
    if spec.name in pregenerated():
        return importlib.import_module(f"generated.{spec.module}").KERNELS[spec.name]
    return _on_demand(siblings).KERNELS[spec.name]


@lru_cache(maxsize=None)
def _on_demand(siblings):
    from codegen.build import compile_module
    return compile_module(list(siblings))


def first_bad_row(values: np.ndarray) -> int | None:
    """Index of the first sample with a non-finite entry, or None."""
    bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None
