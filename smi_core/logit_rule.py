"""Two layers, T = 2, the last layer pinned and V diagonal: a tensor rule in layer 1's logits.

The likelihood depends on h_1 only through the attention weights θ = (p, r) = σ(β a) of the
logits a = (h_11(h_11 − h_12), h_12(h_12 − h_11)) (spec §2), and with V₁₂ = 0 it is, per sign
of u_2, the Gaussian N(±u_2; Φ ω_2, V₂₂ Φ Φᵀ), Φ = cI + A(θ): Φ ω_2 is affine in θ, so the
posterior over θ lies within k·w of the θ* with Φ(θ*) ω_2 = ±u_2 (``attention_targets``), w =
√V₂₂ (c + √2)/|ω_21 − ω_22| (‖Φ‖ ≤ c + √2 bounds the likelihood outside by e^{−k²/2}).  In a
the walls of that window are straight lines, and the prior's density over a,
Σ_± N(±h_1; ω_1, V₁₁)/(2(a_1 + a_2)) (h_1 = (a_1, −a_2)/√(a_1 + a_2), the one-layer pre-image of
spec §4, and its reflection), is smooth there unless the window holds a = 0 (θ = (½, ½), where
the density is ∝ 1/|a|); those samples are left to the other rules.  Each axis is cut at the
walls θ*_t + j·w (``WALLS``) and, where the window reaches θ_t = 0 or 1, by panels growing ×TAIL in
length out to the prior's reach; Gauss–Legendre on every panel, the tensor product over the
wedge a_1 + a_2 > 0 (every node carries the reflections ±h_1 and both signs of u_2, as the
polar rule's nodes do: ``_quadrature.integrate_polar``).

Where a window lies well inside the range, the likelihood is nearly Gaussian in θ itself (Φ ω_2
affine in θ, ΦΦᵀ slowly varying over it) and the prior's density over θ smooth: there a
Gauss–Hermite product in θ, centred on θ* and scaled by the likelihood's covariance (``gauss``),
converges with ≈ 10² nodes instead of the panels' 10⁴ (``gauss_nodes``).
"""
from __future__ import annotations

import numpy as np

from . import _quadrature
from .quadrature import gauss_legendre

WALLS = np.array([-9.0, -6.0, -4.0, -2.5, -1.25, 0.0, 1.25, 2.5, 4.0, 6.0, 9.0])   # in units of w
REACH = 45.0                    # the prior is cut at e^-REACH: |h_1| ≤ |ω_1| + √(2 REACH V₁₁)
TAIL = 4.0                      # the tails' panels grow by this factor


def attention_targets(u, v, skip, sign):
    """θ* = (A_11, A_22) with (cI + A) v = sign·u for a row-stochastic 2×2 A (linear in its two
    free entries), per row of u, v (n, 2); NaN where v_1 = v_2."""
    dv = v[:, 0] - v[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return (sign * u - skip * v - v[:, ::-1]) / np.stack([dv, -dv], axis=1)


def windows(u, omega, V, skip):
    """Per sample: the window centres θ* (n, 2 signs, 2), their half-width unit w (n,), which
    signs' windows meet the attention's range (n, 2), and whether the rule applies (n,): V₁₂ =
    0, some sign's window meets the range, no window holds θ = (½, ½), and the two windows do
    not overlap (each node sums both signs: overlapping windows would count one twice)."""
    k = WALLS[-1]                   # the window's half-width in units of w
    d = omega[:, 1, 0] - omega[:, 1, 1]
    with np.errstate(divide="ignore"):
        w = np.sqrt(V[:, 1, 1]) * (skip + np.sqrt(2.0)) / np.abs(d)
    centre = np.stack([attention_targets(u, omega[:, 1], skip, s) for s in (1.0, -1.0)], axis=1)
    with np.errstate(invalid="ignore"):
        lo, hi = centre - k * w[:, None, None], centre + k * w[:, None, None]
        meets = (hi > 0).all(axis=2) & (lo < 1).all(axis=2) & (hi.sum(axis=2) > 1)
        cusp = ((lo < 0.5) & (hi > 0.5)).all(axis=2)
        overlap = (np.abs(centre[:, 0] - centre[:, 1]) < 2 * k * w[:, None]).all(axis=1)
    applies = ((V[:, 0, 1] == 0) & np.isfinite(w) & meets.any(axis=1) & ~(cusp & meets).any(axis=1)
               & ~(overlap & meets.all(axis=1)))
    return centre, w, meets, applies


def _axis(centre, w, beta, reach, step):
    """Panel ends in a_t of one axis: the walls θ*_t + j·w inside (0, 1) as logits, and where
    the window passes θ_t = 0 or 1, panels growing ×TAIL from ``step`` out to ±reach."""
    theta = centre + w * WALLS
    inner = theta[(theta > 0) & (theta < 1)]
    ends = list((np.log(inner) - np.log1p(-inner)) / beta)
    for side, past in ((-1.0, theta[0] <= 0), (1.0, theta[-1] >= 1)):
        if past:
            start = (ends[0] if side < 0 else ends[-1]) if ends else 0.0
            k = np.arange(1, 64)
            tail = start + side * step * (TAIL ** k - 1) / (TAIL - 1)
            tail = list(tail[side * tail < reach]) + [side * reach]
            ends = tail[::-1] + ends if side < 0 else ends + tail
    return np.unique(np.clip(ends, -reach, reach))


def panels(omega, V, beta, centre, w, meets):
    """The rule's panels for the samples given (all must apply), once for every node count: per
    axis t, the panels (lo, hi) and the pair each belongs to, the pairs being the (sample, sign)
    of ``meets`` in sample order (``pairs``: their samples)."""
    reach = 1.21 * (np.linalg.norm(omega[:, 0], axis=1) + np.sqrt(2 * REACH * V[:, 0, 0])) ** 2   # |a_t| ≤ 1.21 |h_1|²
    step = np.minimum(0.5 * V[:, 0, 0], 0.5 / beta)
    pairs, sign = np.nonzero(meets)
    axes = []
    for t in range(2):
        ends = [_axis(centre[i, s, t], w[i], beta, reach[i], step[i]) for i, s in zip(pairs, sign)]
        axes.append((np.concatenate([e[:-1] for e in ends]), np.concatenate([e[1:] for e in ends]),
                     np.repeat(np.arange(len(ends)), [len(e) - 1 for e in ends])))
    return pairs, axes


def nodes(pairs, axes, todo, n):
    """The rule's nodes for the samples ``todo`` (ascending indices into those of ``panels``), n
    Gauss–Legendre nodes per panel: rows [h_1 (2), log weight, 5 rows for Φ⁻¹ and log|det Φ|
    (left to the caller's inverse kernel)] by columns, and per sample of ``todo`` its range
    start:stop of columns."""
    x, wt = gauss_legendre(n)
    keep = np.isin(pairs, todo)
    rules = []
    for lo, hi, pair in axes:
        sel = keep[pair]
        half, mid = (hi[sel] - lo[sel])[:, None] / 2, (hi[sel] + lo[sel])[:, None] / 2
        per = np.bincount(pair[sel], minlength=len(pairs))[keep] * n
        rules.append(((mid + half * x).ravel(), (half * wt).ravel(), np.concatenate([[0], np.cumsum(per)])))
    (a1, w1, p1), (a2, w2, p2) = rules
    count = np.empty(len(p1) - 1, dtype=np.int64)
    _quadrature.logit_counts(a1, p1, a2, p2, count)
    first = np.concatenate([[0], np.cumsum(count)])
    cols = np.empty((8, first[-1]))
    _quadrature.logit_product(a1, w1, p1, a2, w2, p2, cols, first)
    stop = np.cumsum(np.bincount(np.searchsorted(todo, pairs[keep]), weights=count, minlength=len(todo)).astype(np.int64))
    return cols, np.concatenate([[0], stop[:-1]]), stop


GAUSS_REACH = 8.0               # the Gauss–Hermite rule's Gaussian must lie this many sd inside the range


def gauss(centre, omega, V, meets, logit, skip):
    """The likelihood's Gaussian in θ per sample and sign: covariance C = V₂₂ (Jᵀ(ΦΦᵀ)⁻¹J)⁻¹ =
    V₂₂ J⁻¹ΦΦᵀJ⁻¹ at θ* (J = ∂(Φ ω_2)/∂θ = diag(d, −d), d = ω_21 − ω_22; Φ = Φ(θ*)) and its
    Cholesky factor (n, 2, 2, 2), and per sample whether the Gauss–Hermite rule applies: V₁₂ = 0,
    the logit rule applies (``logit``, ``windows``) or one sign's window meets the range, and
    every sign whose window meets it has its Gaussian inside it: θ*_t ± GAUSS_REACH sd_t within
    (0, 1) and θ*_1 + θ*_2 − 1 (the wedge a_1 + a_2 > 0) above GAUSS_REACH sd of it (d = 0 or a
    non-finite θ*: not inside)."""
    d = omega[:, 1, 0] - omega[:, 1, 1]
    Phi = np.empty(centre.shape + (2,))
    Phi[..., 0, 0], Phi[..., 0, 1] = skip + centre[..., 0], 1 - centre[..., 0]
    Phi[..., 1, 0], Phi[..., 1, 1] = 1 - centre[..., 1], skip + centre[..., 1]
    flip = np.array([[1.0, -1.0], [-1.0, 1.0]])                                 # J⁻¹ · J⁻¹ = flip / d²
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        C = (V[:, 1, 1] / d ** 2)[:, None, None, None] * flip * (Phi @ np.swapaxes(Phi, -1, -2))
        sd = np.sqrt(np.diagonal(C, axis1=-2, axis2=-1))
        k = GAUSS_REACH
        low = C[..., 0, 1] / sd[..., 0]
        rest = C[..., 1, 1] - low ** 2                                          # C = L Lᵀ, L lower
        inside = ((centre - k * sd > 0).all(axis=2) & (centre + k * sd < 1).all(axis=2)
                  & (centre.sum(axis=2) - 1 > k * np.sqrt(C.sum(axis=(2, 3)))) & (rest > 0))
    chol = np.zeros(C.shape)
    chol[..., 0, 0], chol[..., 1, 0] = np.where(inside, sd[..., 0], 1.0), np.where(inside, low, 0.0)
    chol[..., 1, 1] = np.sqrt(np.where(inside, rest, 1.0))
    fits = (inside | ~meets).all(axis=1) & meets.any(axis=1)
    return chol, fits & (V[:, 0, 1] == 0) & (logit | (meets.sum(axis=1) == 1))


def gauss_nodes(centre, chol, meets, beta, todo, n):
    """The Gauss–Hermite rule in θ for the samples ``todo`` (``gauss``: every meeting sign's
    Gaussian inside the range), n × n nodes per sign θ = θ* + √2 L t: rows [h_1 (2), log weight, 5
    rows for Φ⁻¹ and log|det Φ| (left to the caller's inverse kernel)] by columns, h_1 from a =
    logit(θ)/β as in ``logit_product``, weight w_i w_j e^{|t|²} 2|det L| Π_t dθ_t/(β θ_t (1 − θ_t))
    / (2(a_1 + a_2)), and per sample of ``todo`` its range start:stop of columns."""
    t, wt = np.polynomial.hermite.hermgauss(n)
    grid = np.stack(np.meshgrid(t, t, indexing="ij")).reshape(2, -1)            # (2, n²)
    log_w = np.log(np.outer(wt, wt).ravel()) + (grid ** 2).sum(axis=0)
    pair, sign = np.nonzero(meets[todo])
    L = chol[todo[pair], sign]                                                  # (pairs, 2, 2)
    theta = centre[todo[pair], sign][:, :, None] + np.sqrt(2.0) * L @ grid      # (pairs, 2, n²)
    log_w = log_w + np.log(2 * np.abs(np.linalg.det(L)))[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = (np.log(theta) - np.log1p(-theta)) / beta
    # in the range (the grid's corners reach past GAUSS_REACH sd) and the wedge a_1 + a_2 > 0
    keep = ((theta > 0) & (theta < 1)).all(axis=1) & (a.sum(axis=1) > 0)                  # (pairs, n²)
    theta, a, log_w = theta.transpose(0, 2, 1)[keep], a.transpose(0, 2, 1)[keep], log_w[keep]
    S = a.sum(axis=1)
    cols = np.empty((8, S.size))
    cols[0], cols[1] = a[:, 0] / np.sqrt(S), -a[:, 1] / np.sqrt(S)
    cols[2] = log_w - np.log(beta * theta * (1 - theta)).sum(axis=1) - np.log(2 * S)
    count = np.bincount(pair, weights=keep.sum(axis=1), minlength=len(todo)).astype(np.int64)
    stop = np.cumsum(count)
    return cols, stop - count, stop
