"""The pure-Python twin of a kernel: the same straight-line program, through ``sympy.lambdify``.

``twin(prog)(x, params) -> out`` has the kernel's contract (x: (n, n_in), out: (n, n_out)),
evaluated with NumPy arrays over samples.  It is the fallback when no compiler is available and
the oracle the compiled kernels are tested against.
"""
from __future__ import annotations

import numpy as np
import sympy as sp

from derive.program import Program


def twin(prog: Program):
    """A NumPy function with the kernel contract, built by ``lambdify`` from ``prog``."""
    args = prog.input_symbols() + list(prog.params)
    outs = prog.output_exprs()
    f = sp.lambdify(args, outs, modules=["numpy", "scipy"], cse=lambda exprs: (list(prog.body), exprs))
    n_in, n_par = prog.n_in, len(prog.params)

    def run(x: np.ndarray, params: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        cols = [x[:, i] for i in range(n_in)] + [np.full(len(x), p) for p in params[:n_par]]
        with np.errstate(all="ignore"):
            values = f(*cols)
        return np.stack([np.broadcast_to(np.asarray(v, dtype=float), (len(x),)) for v in values], axis=1)

    return run


def expressions_twin(args, exprs):
    """A NumPy function of ``args`` returning ``exprs`` (``lambdify``): derived formulas that are
    not kernel programs (e.g. the AIM hardmax channel's ratios, derive.aim.hardmax2)."""
    return sp.lambdify(args, exprs, "numpy")
