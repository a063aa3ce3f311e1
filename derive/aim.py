"""Attention-indexed models (AIM.md §3-§4), symbolic parts: the Stieltjes cubic and its edge
discriminant, the rank of the softmax and linear output channels, the T = 2 hardmax channel's
derivatives g_ab = ∂ log Z_out/∂ω_ab by the chain rule through the bivariate normal CDF, and the
polyhedral cone of a hardmax output for any T.

Indices are the upper triangle of the symmetric T×T matrix h, in the order (a, b), a ≤ b, row by
row (`pairs(T)`).
"""
from __future__ import annotations

from functools import lru_cache

import sympy as sp

G, z = sp.symbols("G z")
rho, Delta = sp.symbols("rho Delta", positive=True)


def pairs(T: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(T) for b in range(a, T)]


def stieltjes_cubic() -> sp.Expr:
    """Δ G³ - (z + √ρ Δ) G² + (√ρ z + 1 - ρ) G - √ρ, from G = G_S(z - ΔG) with
    G_S⁻¹(G) = 1/G - ρ/(G - √ρ) (√ρ × Marchenko–Pastur of ratio 1/ρ)."""
    a = sp.sqrt(rho)
    num = sp.Poly(sp.numer(sp.together((z - Delta * G) - (1 / G - rho / (G - a)))), G)
    return sp.expand(num.as_expr() * Delta / num.LC())


def edge_discriminant() -> sp.Poly:
    """Discriminant of the cubic in G as a polynomial in z (degree 4): its real zeros are the
    band edges."""
    return sp.Poly(sp.factor(sp.discriminant(stieltjes_cubic(), G)), z)


@lru_cache(maxsize=None)
def softmax_rank(T: int) -> tuple[int, tuple]:
    """(K, null vector) of the Jacobian of h ↦ (log(y_ab/y_aT))_{a, b<T} for y = row-softmax(βh):
    K is the number of independent measurements a softmax output gives; the null vector (over
    pairs(T)) is the direction of h the output cannot see."""
    beta = sp.Symbol("beta", positive=True)
    h = {p: sp.Symbol(f"h_{p[0]}{p[1]}") for p in pairs(T)}
    H = sp.Matrix(T, T, lambda a, b: h[(min(a, b), max(a, b))])
    logits = [beta * H[a, b] - beta * H[a, T - 1] for a in range(T) for b in range(T - 1)]
    J = sp.Matrix(logits).jacobian([h[p] for p in pairs(T)])
    null = J.nullspace()
    return J.rank(), tuple(tuple(v) for v in null)


def linear_rank(T: int) -> int:
    """Rank of the Jacobian of h ↦ h (upper triangle): T(T+1)/2."""
    return sp.eye(len(pairs(T))).rank()


def bvn_partial(first: bool = True) -> tuple[sp.Expr, tuple]:
    """∂Φ₂(κ₁, κ₂; r)/∂κ₁ = φ(κ₁) Φ((κ₂ - rκ₁)/√(1 - r²)) (twin for κ₂), from Φ₂ = ∫∫ φ₂ by the
    Leibniz rule: returns (expression, (κ₁, κ₂, r))."""
    k1, k2, r = sp.symbols("kappa1 kappa2 r", real=True)
    x, y = (k1, k2) if first else (k2, k1)
    phi = sp.exp(-x ** 2 / 2) / sp.sqrt(2 * sp.pi)
    return phi * (1 + sp.erf((y - r * x) / sp.sqrt(2 * (1 - r ** 2)))) / 2, (k1, k2, r)


@lru_cache(maxsize=None)
def hardmax2() -> dict:
    """T = 2 hardmax: Z_out = Φ₂(κ₁, κ₂; s₁s₂/3), κ₁ = s₁(ω₀₀ - ω₀₁)/√(3V), κ₂ = s₂(ω₁₁ - ω₀₁)/√(3V).
    g_ab = ∂ log Z_out/∂ω_ab = Σ_i R_i ∂κ_i/∂ω_ab (chain rule) with the ratios
    R_i = (∂Φ₂/∂κ_i)/Φ₂; also Σ_{a≤b} (1+δ_ab) g_ab²."""
    s1, s2 = sp.symbols("s1 s2")
    V = sp.Symbol("V", positive=True)
    w = {p: sp.Symbol(f"omega_{p[0]}{p[1]}") for p in pairs(2)}
    R = sp.symbols("R1 R2")
    kappa = (s1 * (w[(0, 0)] - w[(0, 1)]) / sp.sqrt(3 * V), s2 * (w[(1, 1)] - w[(0, 1)]) / sp.sqrt(3 * V))
    g = {p: sp.simplify(sum(Ri * sp.diff(k, w[p]) for Ri, k in zip(R, kappa))) for p in pairs(2)}
    fisher = sp.simplify(sum((1 + (a == b)) * g[(a, b)] ** 2 for a, b in pairs(2)))
    return {"s": (s1, s2), "V": V, "omega": w, "R": R, "kappa": kappa, "g": g, "fisher": fisher}


def hardmax_cone(T: int, winners: tuple[int, ...]) -> list[list[int]]:
    """Rows c with c·h > 0 ⟺ row a of h has its maximum at winners[a] (h_{a,w} - h_{a,b} > 0 for
    b ≠ w), over pairs(T); T(T - 1) rows."""
    index = {p: i for i, p in enumerate(pairs(T))}
    rows = []
    for a, win in enumerate(winners):
        for b in range(T):
            if b != win:
                c = [0] * len(index)
                c[index[(min(a, win), max(a, win))]] += 1
                c[index[(min(a, b), max(a, b))]] -= 1
                rows.append(c)
    return rows
