"""Link functions of the attention logits, written as blocks of a :class:`Program`.

- ``softmax``: row-wise σ_β(M)_ts = exp(β(M_ts - m_t)) / Σ_s' exp(β(M_ts' - m_t)), with m_t the
  row maximum, so no exp overflows however saturated the row is.  Its derivative is given in
  the form without cancellation, dσ_ts = β σ_ts Σ_{k≠s} σ_tk (dM_ts - dM_tk) (with 1 - σ_ts
  summed as Σ_{k≠s} σ_tk, so a saturated entry σ_ts ≈ 1 keeps its relative accuracy).
- ``hardmax``: one-hot argmax per row (first maximum on ties); forward only.
- ``linear``: the logits M themselves.
"""
from __future__ import annotations

import sympy as sp

from .program import Program


def softmax(prog: Program, M: sp.Matrix, beta) -> sp.Matrix:
    T = M.shape[1]
    out = sp.zeros(*M.shape)
    for t in range(M.shape[0]):
        row = [M[t, s] for s in range(T)]
        m = prog.assign("m", sp.Max(*row), constant=True)
        e = [prog.assign("e", sp.exp(beta * (x - m)), constant=True) for x in row]
        inv = prog.assign("w", 1 / sp.Add(*e), constant=True)
        for s in range(T):
            others = [k for k in range(T) if k != s]
            partials = {row[k]: -beta * e[s] * e[k] * inv ** 2 for k in others}
            partials[row[s]] = beta * e[s] * inv ** 2 * sp.Add(*[e[k] for k in others])
            out[t, s] = prog.assign("sig", e[s] * inv, partials=partials)
    return out


def hardmax(prog: Program, M: sp.Matrix, beta=None) -> sp.Matrix:
    T = M.shape[1]
    out = sp.zeros(*M.shape)
    for t in range(M.shape[0]):
        for s in range(T):
            wins = [M[t, s] > M[t, k] for k in range(s)] + [M[t, s] >= M[t, k] for k in range(s + 1, T)]
            out[t, s] = prog.assign("hard", sp.Piecewise((1, sp.And(*wins)), (0, True)))
    return out


def linear(prog: Program, M: sp.Matrix, beta=None) -> sp.Matrix:
    return M


LINKS = {"softmax": softmax, "hardmax": hardmax, "linear": linear}
DIFFERENTIABLE = {"softmax": True, "hardmax": False, "linear": True}
