"""The large-depth series of deep attention (spec §3), derived symbolically.

Rescale every layer by 1/c (ε = 1/c).  With h_ℓ the r×T block of layer ℓ (rows ℓ·r … ℓ·r+r-1 of
the index matrix, ℓ = 0 … L-1 here, zero-based):

    Φ⁽⁰⁾ = I_T,   u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ,   Φ⁽ℓ⁾ = (I + ε σ_β(u_ℓ u_ℓᵀ)) Φ⁽ℓ⁻¹⁾      (ℓ < L-1)
    M = u_L u_Lᵀ  (last-layer logits),    y = s(M)   (s = σ_β or the identity)

This rescaled recursion equals the original model's Φ⁽ℓ⁾ / c^ℓ when the original is fed the rescaled
indices h_ℓ / c^ℓ (every layer, zero-based ℓ): then the original's u_ℓ equals the rescaled u_ℓ.

Expanding in ε at fixed indices:

    Φ⁽ᴸ⁻¹⁾ = Φ₀ + ε Φ₁ + ε² Φ₂ + O(ε³),        M = M₀ + ε M₁ + ε² M₂ + O(ε³)

and the closed forms the derivation reproduces (they are *checked*, not used, here) are

    Φ₀ = I,   Φ₁ = Σ_{ℓ<L-1} σ_β(h_ℓᵀ h_ℓ),   M₀ = h_Lᵀ h_L,   M₁ = Φ₁ M₀ + M₀ Φ₁ᵀ,
    M₂ = Φ₂ M₀ + M₀ Φ₂ᵀ + Φ₁ M₀ Φ₁ᵀ,
    Φ₂ = Σ_{ℓ'<ℓ} σ_ℓ σ_ℓ' + Σ_ℓ Dσ_β(h_ℓᵀh_ℓ)[Φ₁⁽ℓ⁾ h_ℓᵀh_ℓ + h_ℓᵀh_ℓ Φ₁⁽ℓ⁾ᵀ]
         (σ_ℓ = σ_β(h_ℓᵀh_ℓ), Φ₁⁽ℓ⁾ = Σ_{ℓ'<ℓ} σ_ℓ', Dσ_β the derivative of the row-wise softmax).

How it is derived (no closed form is typed in): each block of the exact recursion is a function of
ε, and its Taylor coefficients X_k = (1/k!) dᵏX/dεᵏ |_{ε=0}, k = 0, 1, 2, are obtained with
``sympy.diff`` at ε = 0.  Into each block the previous block's quadratic Taylor polynomial is
substituted (Φ⁽ℓ⁻¹⁾(ε) → Φ₀ + εΦ₁ + ε²Φ₂ in symbols), which changes the block only at O(ε³), so its
first two ε-derivatives at 0 are exact.  Every coefficient entry is its own intermediate symbol
(a straight-line :class:`Program`, DESIGN "Generating deep models without blow-up"): the size grows
linearly with depth.  The softmax of an ε-dependent row N(ε) is differentiated in the exact form

    σ_β(N(ε))_s = σ_s e^{β(N_s(ε)-N_s(0))} / Σ_s' σ_s' e^{β(N_s'(ε)-N_s'(0))},   σ = σ_β(N(0)),

(an identity: multiply numerator and denominator by Σ e^{βN(0)}), after which Σ_s σ_s = 1 is used.

Outputs of the program (all T×T): ``phi0 phi1 phi2`` (Φ⁽ᴸ⁻¹⁾), ``M0 M1 M2`` (logits), ``y0 y1 y2``
(Taylor coefficients of the exact output y(ε) = s(M(ε))), ``dy2`` = Ds(M₀)[M₂] (the leading
coefficient of y(ε) - s(M₀ + εM₁) = ε² Ds(M₀)[M₂] + O(ε³)), and ``y_first`` = s(M₀ + ε M₁) with ε the
runtime parameter ``EPS``.  Runtime parameters: (BETA, EPS).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

from .attention import BETA, index_symbols
from .links import softmax
from .program import Program

EPS = sp.Symbol("epsilon", positive=True)     # ε = 1/c, runtime parameter of ``y_first``
_e = sp.Symbol("_e")                          # the expansion variable of the derivation
ORDER = 2
SERIES_LINKS = ("softmax", "linear")
OUTPUTS = ("phi0", "phi1", "phi2", "M0", "M1", "M2", "y0", "y1", "y2", "dy2", "y_first")


@dataclass(frozen=True)
class DepthSeries:
    """The large-depth series of an (L, T, r) tied deep-attention model.

    ``phi``, ``M``, ``y`` are the Taylor coefficients (k = 0, 1, 2) of Φ⁽ᴸ⁻¹⁾, of the last-layer
    logits and of the output, as SymPy matrices in the program's intermediate symbols;
    :meth:`explicit` substitutes those back into the index symbols ``z_a_t`` and ``BETA``.
    ``dy2`` = Ds(M₀)[M₂]; ``program`` holds the straight-line definitions and all outputs."""

    layers: int
    tokens: int
    rank: int
    link: str
    program: Program

    @property
    def phi(self) -> tuple[sp.Matrix, sp.Matrix, sp.Matrix]:
        return tuple(self.program.outputs[f"phi{k}"] for k in range(ORDER + 1))

    @property
    def M(self) -> tuple[sp.Matrix, sp.Matrix, sp.Matrix]:
        return tuple(self.program.outputs[f"M{k}"] for k in range(ORDER + 1))

    @property
    def y(self) -> tuple[sp.Matrix, sp.Matrix, sp.Matrix]:
        return tuple(self.program.outputs[f"y{k}"] for k in range(ORDER + 1))

    @property
    def dy2(self) -> sp.Matrix:
        return self.program.outputs["dy2"]

    @property
    def index_symbols(self) -> sp.Matrix:
        return self.program.inputs["z"]

    def explicit(self, expr) -> sp.Matrix:
        """``expr`` (a matrix, or an output name such as ``"phi1"``) with every intermediate
        symbol replaced by its definition: a matrix in ``z_a_t``, ``BETA`` (and ``EPS``)."""
        mat = self.program.outputs[expr] if isinstance(expr, str) else sp.Matrix(expr)
        values: dict[sp.Symbol, sp.Expr] = {}
        for sym, e in self.program.body:
            values[sym] = e.xreplace(values)
        return mat.applyfunc(lambda e: sp.sympify(e).xreplace(values))


def _taylor(expr, replace=None) -> list[sp.Expr]:
    """[X₀, X₁, X₂] with X_k = (1/k!) dᵏX/dεᵏ at ε = 0 (the derivation's ε is ``_e``);
    ``replace`` (a dict) is applied at ε = 0, before expanding."""
    out, d = [], sp.sympify(expr)
    for k in range(ORDER + 1):
        if k:
            d = sp.diff(d, _e)
        c = d.subs(_e, 0)
        if replace:
            c = c.xreplace(replace)
        out.append(sp.expand(c) / sp.factorial(k))
    return out


def _taylor_matrix(prog: Program, prefix: str, mat: sp.Matrix, symmetric: bool = False) -> list[sp.Matrix]:
    """Taylor coefficients of a matrix function of ε, each entry assigned to a symbol."""
    rows, cols = mat.shape
    coeffs = [sp.zeros(rows, cols) for _ in range(ORDER + 1)]
    for i in range(rows):
        for j in range(cols):
            if symmetric and j < i:
                for k in range(ORDER + 1):
                    coeffs[k][i, j] = coeffs[k][j, i]
                continue
            for k, c in enumerate(_taylor(mat[i, j])):
                coeffs[k][i, j] = prog.assign(f"{prefix}{k}", c)
    return coeffs


def _polynomial(coeffs: list[sp.Matrix]) -> sp.Matrix:
    return sum((_e ** k * c for k, c in enumerate(coeffs)), sp.zeros(*coeffs[0].shape))


@functools.lru_cache(maxsize=None)
def _softmax_row_jet(T: int):
    """The generic row: placeholders (σ_s, N1_s, N2_s) and, for each s, the coefficients k = 1, 2
    of σ_s e^{β(εN1_s+ε²N2_s)} / Σ_s' σ_s' e^{β(εN1_s'+ε²N2_s')}, with Σ_s σ_s = 1 used.
    Derived once per T and reused for every row (substitution is much cheaper than diff)."""
    sig = sp.symbols(f"_sig0:{T}", real=True)
    n1 = sp.symbols(f"_n1_0:{T}", real=True)
    n2 = sp.symbols(f"_n2_0:{T}", real=True)
    w = [sig[s] * sp.exp(BETA * (_e * n1[s] + _e ** 2 * n2[s])) for s in range(T)]
    total, norm = sp.Add(*w), {sp.Add(*sig): sp.Integer(1)}
    coeffs = [_taylor(w[s] / total, replace=norm)[1:] for s in range(T)]
    return sig, n1, n2, coeffs


def _softmax_jet(prog: Program, N: list[sp.Matrix], prefix: str, sig: sp.Matrix | None = None) -> list[sp.Matrix]:
    """Taylor coefficients of σ_β(N(ε)) (row-wise), N(ε) = N₀ + εN₁ + ε²N₂, by differentiating
    σ_s e^{β(N_s(ε)-N_s(0))} / Σ_s' σ_s' e^{β(N_s'(ε)-N_s'(0))} in ε at 0 (σ = σ_β(N₀), given
    or assigned here)."""
    sig = softmax(prog, N[0], BETA) if sig is None else sig
    T = N[0].shape[1]
    psig, pn1, pn2, coeffs = _softmax_row_jet(T)
    out = [sig] + [sp.zeros(*sig.shape) for _ in range(ORDER)]
    for t in range(sig.shape[0]):
        values = {}
        for s in range(T):
            values.update({psig[s]: sig[t, s], pn1[s]: N[1][t, s], pn2[s]: N[2][t, s]})
        for s in range(T):
            for k, c in enumerate(coeffs[s], start=1):
                out[k][t, s] = prog.assign(f"{prefix}{k}", c.xreplace(values))
    return out


def _link_jet(prog: Program, link: str, N: list[sp.Matrix], prefix: str, sig=None) -> list[sp.Matrix]:
    return _softmax_jet(prog, N, prefix, sig) if link == "softmax" else list(N)


@functools.lru_cache(maxsize=None)
def large_depth_series(layers: int, tokens: int, rank: int = 1, link: str = "softmax") -> DepthSeries:
    """Derive Φ₀, Φ₁, Φ₂ of Φ⁽ᴸ⁻¹⁾ and M₀, M₁, M₂ of the last-layer logits (and the output's
    coefficients) of the rescaled L-layer tied attention model with T tokens and rank r; see the
    module docstring for the recursion, the method and the closed forms."""
    for name, value in (("layers", layers), ("tokens", tokens), ("rank", rank)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if link not in SERIES_LINKS:
        raise ValueError(f"link must be one of {SERIES_LINKS}, got {link!r}")
    T, r = tokens, rank
    Z = index_symbols(layers * r, T)
    prog = Program(f"series_{link}_L{layers}_T{T}_r{r}", {"z": Z}, (BETA, EPS),
                   source="derive.series.large_depth_series")
    I = sp.eye(T)
    phi = [I, sp.zeros(T, T), sp.zeros(T, T)]               # Φ⁽⁰⁾ = I exactly
    for layer in range(layers):
        h = Z[layer * r:(layer + 1) * r, :]
        u = _taylor_matrix(prog, f"u{layer}_", _polynomial(phi) * h.T)
        U = _polynomial(u)
        N = _taylor_matrix(prog, f"N{layer}_", U * U.T, symmetric=True)
        if layer == layers - 1:
            break
        A = _softmax_jet(prog, N, f"A{layer}_")
        phi = _taylor_matrix(prog, f"phi{layer}_", (I + _e * _polynomial(A)) * _polynomial(phi))
    y = _link_jet(prog, link, N, "y")
    dy = _link_jet(prog, link, [N[0], sp.zeros(T, T), N[2]], "dy", sig=y[0])
    first = N[0] + EPS * N[1]
    y_first = softmax(prog, first, BETA) if link == "softmax" else first
    for k in range(ORDER + 1):
        prog.outputs[f"phi{k}"] = phi[k]
    for k in range(ORDER + 1):
        prog.outputs[f"M{k}"] = N[k]
    for k in range(ORDER + 1):
        prog.outputs[f"y{k}"] = y[k]
    prog.outputs["dy2"] = dy[2]
    prog.outputs["y_first"] = y_first
    return DepthSeries(layers, tokens, rank, link, prog)
