"""Link functions of the attention logits, written as blocks of a :class:`Program`.

- ``softmax``: row-wise σ_β(M)_ts = exp(β(M_ts - m_t)) / Σ_s' exp(β(M_ts' - m_t)), with m_t the
  row maximum (held constant by the chain rule: the softmax is shift-invariant), so no exp
  overflows however saturated the row is.
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
        e = [prog.assign("e", sp.exp(beta * (x - m))) for x in row]
        inv = prog.assign("w", 1 / sp.Add(*e))
        for s in range(T):
            out[t, s] = prog.assign("sig", e[s] * inv)
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
