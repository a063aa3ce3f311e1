"""Closed-form output channels, derived by SymPy where the integral is elementary (spec §4,
route 3): one index, one token (R = T = 1).

    Z_out(y; ω, V) = ∫ N(z; ω, V) P(y|z) dz,   g_out = ∂_ω log Z_out,   ∂_ω g_out = ∂²_ω log Z_out

- Gaussian output noise, P(y|z) = N(y; g(z), Δ): elementary when g is affine in z.
- Noiseless sign-type output g(z) = sign(z), y ∈ {−1, +1}: P(y|z) = Θ(y z), giving erf forms.
- Noiseless even output with two pre-images z = ±r(y) for y > 0 (phase retrieval z², |z|):
  P(y|z) = δ(y − g(z)), the posterior is two points with weights ∝ N(±r; ω, V), so with
  x = r ω / V:  log Z_out = −(r² + ω²)/(2V) − ½ log 2πV + log 2cosh x − log|g'(r)|,
  E[z|y] = r tanh x,  Var[z|y] = r² (1 − tanh² x).

``closed_form_program`` returns None when SymPy cannot do the integral in closed form.
"""
from __future__ import annotations

import sympy as sp

from .attention import index_symbols
from .program import Program

Z = index_symbols(1, 1)[0, 0]          # the index symbol z_0_0 that links are written in
OMEGA, Y = sp.symbols("omega y", real=True)
V, DELTA = sp.symbols("V Delta", positive=True)


class erfc(sp.erfc):
    """erfc that keeps erfc(-x) as it is (SymPy rewrites it as 2 - erfc(x), which cancels)."""

    @classmethod
    def eval(cls, arg):
        return None


def _gauss(x, mean, var):
    return sp.exp(-(x - mean) ** 2 / (2 * var)) / sp.sqrt(2 * sp.pi * var)


def _is_sign(g) -> bool:
    return sp.simplify(g - sp.sign(Z)) == 0


def partition_function(g, noisy: bool):
    """Z_out(y; ω, V) for the link g(z) (an expression in ``Z``), or None if not elementary."""
    prior = _gauss(Z, OMEGA, V)
    if noisy:
        if sp.diff(g, Z, 2) != 0:
            return None
        value = sp.integrate(prior * _gauss(Y, g, DELTA), (Z, -sp.oo, sp.oo))
    elif _is_sign(g):   # Θ(yz), y = ±1: the integral over z < 0 at -yω (z → -z), in stable erfc form
        minus = sp.integrate(prior, (Z, -sp.oo, 0)).replace(sp.erfc, erfc)
        value = minus.subs(OMEGA, -Y * OMEGA)
    else:
        return None
    return None if value.has(sp.Integral) else value


def _two_preimages(g):
    """r(y) > 0 with g(±r) = y for y > 0, if g is even and solve() gives exactly ±r; else None."""
    if sp.simplify(g.subs(Z, -Z) - g) != 0:
        return None
    yp = sp.Symbol("y", positive=True)
    roots = sp.solve(sp.Eq(g, yp), Z)
    if len(roots) != 2 or sp.simplify(roots[0] + roots[1]) != 0:
        return None
    r = sp.Abs(roots[0]).subs(yp, Y)
    return r if not r.has(sp.I) else None


def two_point_channel(g):
    """(log Z_out, g_out, ∂_ω g_out) of the noiseless two-pre-image channel (see above), in a
    form without overflow: log 2cosh x = |x| + log(1 + e^{−2|x|})."""
    r = _two_preimages(g)
    if r is None:
        return None
    x = r * OMEGA / V
    log_z = (-(r ** 2 + OMEGA ** 2) / (2 * V) - sp.log(2 * sp.pi * V) / 2 + sp.Abs(x)
             + sp.log(1 + sp.exp(-2 * sp.Abs(x))) - sp.log(sp.Abs(sp.diff(g, Z).subs(Z, r))))
    mean, var = r * sp.tanh(x), r ** 2 * (1 - sp.tanh(x) ** 2)
    return log_z, (mean - OMEGA) / V, var / V ** 2 - 1 / V


def token_wise(expr: sp.Matrix, tokens: int):
    """The scalar link g(z) (in ``Z``) when a one-index link applies it to every token alone,
    expr = [g(z_0_t)]_t (one shared weight vector, outputs independent given the tokens);
    else None.  Its channel is the product of T one-token channels."""
    entries = list(expr)
    if len(entries) != tokens:
        return None
    z = [index_symbols(1, tokens)[0, t] for t in range(tokens)]
    g = entries[0]
    for t, e in enumerate(entries):
        index = {s for s in e.free_symbols if s.name.startswith("z_")}
        if not index <= {z[t]} or sp.simplify(e - g.subs(z[0], z[t])) != 0:
            return None
    return g


def support(g, noisy: bool) -> str:
    """The outputs y a closed-form channel accepts: "real" (noisy), "sign" (y = ±1) or
    "positive" (y > 0, two pre-images)."""
    if noisy:
        return "real"
    return "sign" if _is_sign(g) else "positive"


def closed_form_program(name: str, g, params=(), noisy: bool = False) -> Program | None:
    """Kernel (y, ω, V) → (log Z_out, g_out, ∂_ω g_out) for a scalar link ``g`` of ``Z``;
    runtime parameters: the link's ``params`` (+ Δ when ``noisy``)."""
    pair = None if noisy else two_point_channel(g)
    Zout = None if pair is not None else partition_function(g, noisy)
    if Zout is None and pair is None:
        return None
    params = tuple(params) + ((DELTA,) if noisy else ())
    prog = Program(f"{name}_closed", {"y": sp.Matrix([[Y]]), "omega": sp.Matrix([[OMEGA]]),
                                      "V": sp.Matrix([[V]])}, params,
                   source="derive.closed.closed_form_program")
    if pair is not None:
        log_z, g_out, dg_out = pair
    else:
        log_z = sp.expand_log(sp.log(Zout), force=True)
        g_out = sp.simplify(sp.diff(log_z, OMEGA))
        dg_out = sp.simplify(sp.diff(g_out, OMEGA))
    for name, expr in (("log_z", log_z), ("g_out", g_out), ("dg_out", dg_out)):
        prog.outputs[name] = sp.Matrix([[prog.assign(name, expr)]])
    return prog
