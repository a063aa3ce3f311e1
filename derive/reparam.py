"""Channel reparametrisation of noiseless softmax deep attention with r = 1 (spec §4).

Row t of y = σ_β(u uᵀ) gives ℓ_ts := log(y_ts / y_tt) / β = u_t (u_s - u_t).  For a pair (t, s):

    (u_t - u_s)² = -ℓ_ts - ℓ_st =: d_ts,   u_t = -ℓ_ts / √d_ts,   u_s = ℓ_st / √d_ts

(T = 2: u = (a, -b)/√(a+b) with a = -ℓ_12, b = -ℓ_21).  For T ≥ 3 the pair with the largest
d_ts fixes the global sign and the scale, and every other token k follows from rows t and s by
least squares, u_k = [u_t(ℓ_tk + u_t²) + u_s(ℓ_sk + u_s²)] / (u_t² + u_s²).  The residuals
β u_t (u_s - u_t) - log(y_ts / y_tt) of the full overdetermined system are returned so the caller
can reject an inconsistent y.  Then h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹ u_L, solved through one layer factor
c I + A_ℓ at a time, and log|det Φ⁽ᴸ⁻¹⁾| = Σ_ℓ log|det(c I + A_ℓ)| is the log-Jacobian of
h_L ↦ u_L.  The other pre-image is (-u_L, -h_L).
"""
from __future__ import annotations

from itertools import combinations

import sympy as sp

from .attention import BETA, AttentionSpec, index_symbols, log_abs_det, mixing_layers, solve
from .links import softmax
from .program import Program


def _pair_solution(ell, t, s, T, prog):
    D = prog.assign("D", sp.sqrt(-ell[t, s] - ell[s, t]))
    u = [None] * T
    u[t], u[s] = prog.assign("ut", -ell[t, s] / D), prog.assign("us", ell[s, t] / D)
    others = [k for k in range(T) if u[k] is None]
    norm = prog.assign("n", 1 / (u[t] ** 2 + u[s] ** 2)) if others else None
    for k in others:
        u[k] = prog.assign("uk", (u[t] * (ell[t, k] + u[t] ** 2) + u[s] * (ell[s, k] + u[s] ** 2)) * norm)
    return u


def last_layer_vector(prog: Program, y: sp.Matrix) -> tuple[list, sp.Matrix]:
    """u_L (one of ±) from a softmax output y, and the residual matrix of the log-ratio system."""
    T = y.shape[0]
    lg = y.applyfunc(lambda e: prog.assign("lg", sp.log(e)))
    ell = sp.Matrix(T, T, lambda t, s: prog.assign("ell", (lg[t, s] - lg[t, t]) / BETA) if s != t else 0)
    pairs = list(combinations(range(T), 2))
    sols = [_pair_solution(ell, t, s, T, prog) for t, s in pairs]
    if len(pairs) == 1:
        u = sols[0]
    else:   # the pair with the largest (u_t - u_s)²; first such pair on ties
        d = [-ell[t, s] - ell[s, t] for t, s in pairs]
        conds = [sp.And(*[d[i] > d[j] for j in range(i)], *[d[i] >= d[j] for j in range(i + 1, len(d))])
                 for i in range(len(d))]
        u = [prog.assign("u", sp.Piecewise(*[(sol[k], cond) for sol, cond in zip(sols[:-1], conds[:-1])],
                                           (sols[-1][k], True)))
             for k in range(T)]
    resid = sp.Matrix(T, T, lambda t, s: prog.assign("res", BETA * (u[t] * (u[s] - u[t]) - ell[t, s]))
                      if s != t else 0)
    return u, resid


def last_layer_index(prog: Program, spec: AttentionSpec, hprev: sp.Matrix, u: sp.Matrix):
    """h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹ u_L and log|det Φ⁽ᴸ⁻¹⁾|, one layer factor at a time: with
    Φ⁽ᴸ⁻¹⁾ = B_{L-1} ⋯ B_1, B_ℓ = c I + A_ℓ, solve B_{L-1} x = u_L, then B_{L-2} x' = x, …, down
    to B_1 h_L = x'', each by the LU factors of its own B_ℓ (attention.log_abs_det: elimination
    without pivoting, stable because B_ℓ is diagonally similar to a symmetric positive definite
    matrix).  The product Φ⁽ᴸ⁻¹⁾ itself is never formed."""
    (h,), logdet = _solve_layers(prog, spec, hprev, [u])
    return sp.Matrix(h), logdet


def _solve_layers(prog: Program, spec: AttentionSpec, hprev: sp.Matrix, rhs: list):
    """(Φ⁽ᴸ⁻¹⁾)⁻¹b for every b of ``rhs`` (``last_layer_index``'s solve, the factors shared) and
    log|det Φ⁽ᴸ⁻¹⁾|."""
    _, attention = mixing_layers(prog, spec, hprev, spec.layers - 1, product=False)
    factors, logdet = log_abs_det(prog, spec, attention)
    solutions = []
    for b in rhs:
        x = list(b)
        for L, U in reversed(factors):
            x = solve(prog, L, U, x)
        solutions.append(x)
    return solutions, logdet


def _check_reparametrisable(spec: AttentionSpec) -> None:
    if not (spec.architecture == "tied" and spec.link == "softmax" and spec.rank == 1):
        raise ValueError("the reparametrisation needs architecture='tied', link='softmax', rank=1")


def reparam_program(spec: AttentionSpec) -> Program:
    """(y, h_{<L}) → u_L, h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹u_L, log|det Φ⁽ᴸ⁻¹⁾|, residuals (the + sign)."""
    _check_reparametrisable(spec)
    T = spec.tokens
    y = index_symbols(T, T, "y")
    hprev = index_symbols(spec.layers - 1, T)
    prog = Program(spec.key + "_reparam", {"y": y, "z": hprev}, spec.params(),
                   source="derive.reparam.reparam_program")
    u, resid = last_layer_vector(prog, y)
    h, logdet = last_layer_index(prog, spec, hprev, sp.Matrix(u))
    prog.outputs["u"] = sp.Matrix(u)
    prog.outputs["h"] = h
    prog.outputs["logdet"] = sp.Matrix([[logdet]])
    prog.outputs["residual"] = sp.Matrix([resid[t, s] for t in range(T) for s in range(T) if s != t])
    return prog


def channel_node_program(spec: AttentionSpec) -> Program:
    """The route-1 channel integrand at one node x = h_{<L}, given u_L: inputs ``u`` (T) and
    ``z`` = h_{<L} ((L-1)×T); output ``hl`` = [h_L; log|det Φ⁽ᴸ⁻¹⁾|] (T+1).  The integrand is
    Σ_± N([x; ±h_L]; ω, V) / |det Φ⁽ᴸ⁻¹⁾(x)|."""
    _check_reparametrisable(spec)
    u = index_symbols(spec.tokens, 1, "u")
    hprev = index_symbols(spec.layers - 1, spec.tokens)
    prog = Program(spec.key + "_node", {"u": u, "z": hprev}, spec.params(),
                   source="derive.reparam.channel_node_program")
    h, logdet = last_layer_index(prog, spec, hprev, u)
    prog.outputs["hl"] = sp.Matrix(list(h) + [logdet])
    return prog


def inverse_program(spec: AttentionSpec) -> Program:
    """(Φ⁽ᴸ⁻¹⁾)⁻¹ and log|det Φ⁽ᴸ⁻¹⁾| from h_{<L} (input ``z``): outputs ``phi_inv`` (T×T) and
    ``logdet``, each column (Φ⁽ᴸ⁻¹⁾)⁻¹e_j solved one layer factor at a time as
    ``last_layer_index`` solves for h_L (the polar rules' node data: h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹u_L per
    sample)."""
    _check_reparametrisable(spec)
    T = spec.tokens
    hprev = index_symbols(spec.layers - 1, T)
    prog = Program(spec.key + "_inverse", {"z": hprev}, spec.params(), source="derive.reparam.inverse_program")
    columns, logdet = _solve_layers(prog, spec, hprev, [sp.eye(T)[:, j] for j in range(T)])
    prog.outputs["phi_inv"] = sp.Matrix(T, T, lambda i, j: columns[j][i])
    prog.outputs["logdet"] = sp.Matrix([[logdet]])
    return prog


def chart_program(spec: AttentionSpec) -> Program:
    """T = 2, the last softmax σ_β(u uᵀ) in the chart x = (D, ℓ) with D = u_1 - u_2 > 0 and ℓ =
    ℓ_21 = log(y_21/y_22)/β: then ℓ_12 = -D² - ℓ (``_pair_solution``'s d_12 = D²), u = (D² + ℓ,
    ℓ)/D (the other pre-image, D < 0, is -u), and y = σ_β of the rows' log-ratios.  The fold
    p + r = 1 of the off-diagonal entries p = y_12, r = y_21 is D → 0, the softmax edge p → 0 is
    D → ∞ and r → 0, 1 is ℓ → ∓∞.  Outputs ``u``, ``y`` (2×2), ``logdet`` = log|det ∂u/∂(D, ℓ)|
    and ``poly``: D·u = Σ_k poly[:, k] D^k (k = 0, 1, 2: the curve of constant ℓ meets a
    Gaussian's ellipse where a quartic in D vanishes)."""
    _check_reparametrisable(spec)
    if spec.tokens != 2:
        raise ValueError("the chart needs tokens=2")
    D = sp.Symbol("x_0_0", positive=True)
    ell = sp.Symbol("x_0_1", real=True)
    prog = Program(spec.key + "_chart", {"x": sp.Matrix([[D, ell]])}, spec.params(),
                   source="derive.reparam.chart_program")
    ratios = sp.Matrix([[0, -D ** 2 - ell], [ell, 0]])
    u = _pair_solution(ratios, 0, 1, 2, prog)
    prog.outputs["u"] = sp.Matrix(u)
    prog.outputs["y"] = softmax(prog, ratios, BETA).reshape(1, 4)
    inline = sp.Matrix(u).subs(list(reversed(prog.body)))
    det = sp.simplify(inline.jacobian([D, ell]).det())
    prog.outputs["logdet"] = sp.Matrix([[prog.assign("ld", sp.log(sp.Abs(det)))]])
    prog.outputs["poly"] = sp.Matrix([sp.Poly(sp.expand(D * e), D).all_coeffs()[::-1] + [0] * (2 - sp.degree(sp.expand(D * e), D))
                                      for e in inline])
    return prog
