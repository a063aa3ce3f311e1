"""The chart rule: the noisy T = 2 softmax channel near the edges of the softmax's range.

For the last softmax σ_β(u uᵀ) = [[1 - p, p], [r, 1 - r]] of T = 2 tied attention the likelihood
N(y; σ, Δ I) is N(p; p̄, Δ/2) N(r; r̄, Δ/2) (times a constant).  Where the window p̄ ± k√(Δ/2),
r̄ ± k√(Δ/2) reaches the edges of the triangle p, r > 0, p + r < 1, the posterior runs off to
|u| → ∞ along the curves of constant r until the prior stops it (p → 0: u ≈ (D, 0); the fold
p + r → 1: u ≈ (ℓ/D)(1, 1)), and in (p, r) its density has integrable singularities.  In the
chart x = (D, ℓ) of derive.reparam.chart_program (D = u_1 - u_2, ℓ = log(r/(1 - r))/β,
du = dD dℓ/|D|) both are plain intervals of D: with the prior N(F u; m, s² I) of u (F = Φ⁻¹
and m, s² the conditional prior of h_L),

    ∫ du N(F u; m, s² I) N(y; σ(u), Δ I) = ∫ dℓ ∫ dD/|D| N(F u(D, ℓ); m, s² I) N(y; σ(D, ℓ), Δ I),

with D over both signs (u(-D, ℓ) = -u(D, ℓ)).  Outer rule in ℓ (``ell_rule``): Gauss–Hermite in
r on the likelihood where r's window lies inside (0, 1) and inside the range of ℓ over the
prior's ``reach``-sd ellipse, else Gauss–Legendre panels.  Inner rule per ℓ node (``nodes``):
Gauss–Legendre panels (``panels``) on the intervals of D where the curve of constant ℓ lies inside
the prior's ellipse — there |D·(F u) - m D|² ≤ reach² s² D², a quartic in D from the chart's
``poly`` — and p inside its window (D² = -logit(p)/β - ℓ).  With several rows per sample (two
layers: the nodes of h_1) the u nodes are placed on an ``envelope`` of the rows' priors and
shared; ``_quadrature.integrate_product`` sums rows × u nodes.
"""
from __future__ import annotations

import numpy as np

from . import _quadrature
from .quadrature import gauss_legendre

RULE = dict(reach=9.0, window=7.0, legendre=32, hermite=16, angles=128)
U, SIGMA, LOGDET, POLY = slice(0, 2), slice(2, 6), 6, slice(7, 13)     # the chart kernel's outputs


def window(y, delta):
    """(p̄, r̄) per row of y (n × 4, row-major) and the likelihood's sd √(Δ/2) in each."""
    return 0.5 * (y[:, 1] + 1 - y[:, 0]), 0.5 * (y[:, 2] + 1 - y[:, 3]), np.sqrt(delta / 2)


def _logit(x, beta):
    """log(x/(1 - x))/β, ∓inf outside (0, 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(x / (1 - x)) / beta
    return np.where(x <= 0, -np.inf, np.where(x >= 1, np.inf, out))


def _boundary(Finv, m, s, count, rule=RULE):
    """``count`` points u (rows × count × 2) on the boundary of each prior ellipse
    |F u - m| = reach·s."""
    theta = np.linspace(0, 2 * np.pi, count, endpoint=False)
    circle = np.stack([np.cos(theta), np.sin(theta)], axis=1)
    return np.einsum("kab,kgb->kga", Finv, m[:, None] + rule["reach"] * s[:, None, None] * circle)


def prior_ell_range(forward, m, s, Finv, beta, rule=RULE):
    """[min, max] of ℓ = log(σ_21/σ_22)/β over the boundary of the prior's ellipse
    |F u - m| = reach·s (ℓ is an indefinite quadratic form in u, so its extremes are on the
    boundary), sampled at ``angles`` points and widened by one sampling step."""
    u = _boundary(Finv, m, s, rule["angles"], rule)
    sig = forward(u.reshape(-1, 1, 2)).reshape(len(m), -1, 4)
    with np.errstate(divide="ignore"):
        ell = (np.log(sig[..., 2]) - np.log(sig[..., 3])) / beta
    ell = np.where(np.isfinite(ell), ell, np.sign(ell) * 700.0 / beta)
    lo, hi = ell.min(axis=1), ell.max(axis=1)
    step = np.abs(np.diff(ell, axis=1, append=ell[:, :1])).max(axis=1)
    return lo - step, hi + step


def _sigmoid(x, beta):
    """r = σ_21 at ℓ: 1/(1 + e^{-βℓ})."""
    return 0.5 * (1 + np.tanh(0.5 * beta * x))


def ell_rule(rbar, sd, lo, hi, beta, rule=RULE):
    """Outer nodes: (row, ℓ, log weight of dℓ) for every row, flat.  Gauss–Hermite in r on
    N(r; r̄, sd²) where r's ``window`` [r_lo, r_hi] lies inside (0, 1), inside the prior's range
    [lo, hi] of ℓ and away from r = 1/2.  Else Gauss–Legendre panels on window ∩ [lo, hi]:
    - r = 1/2 (ℓ = 0) inside: there the curves of constant ℓ pass through the fold's line
      u_1 = u_2 and ∫ dD/|D| grows like log(1/|ℓ|), so each side [0, b] of ℓ = 0 takes [b/e², b]
      in ℓ and [b e^-40, b/e²] in log|ℓ|;
    - otherwise in r on [max(r_lo, r_hi/20), min(r_hi, 1 - (1 - r_lo)/20)], and beyond, towards
      r = 0 or 1 (ℓ → ∓∞, where the prior decides), in τ = √|ℓ - ℓ_end| (ℓ is quadratic in u,
      so the prior is ≈ Gaussian in τ)."""
    n, k = len(rbar), rule["window"]
    r_lo, r_hi = rbar - k * sd, rbar + k * sd
    wl_lo, wl_hi = _logit(r_lo, beta), _logit(r_hi, beta)
    a, b = np.maximum(wl_lo, lo), np.minimum(wl_hi, hi)
    cross = (a < 0) & (b > 0)
    # panels (rows × 4) [start, stop] in the panel's variable, kind 0: ℓ, 1: log|ℓ| (side), 2: r
    r1 = np.maximum(r_lo, r_hi / 20)
    r2 = np.minimum(r_hi, 1 - (1 - r_lo) / 20)
    with np.errstate(divide="ignore", invalid="ignore"):
        cut0, cut2 = np.minimum(b, _logit(r1, beta)), np.maximum(a, _logit(r2, beta))
        edge = [np.stack([0 * a, np.sqrt(cut0 - a)], -1),
                _sigmoid(np.stack([np.maximum(a, _logit(r1, beta)), np.minimum(b, _logit(r2, beta))], -1), beta),
                np.stack([0 * a, np.sqrt(b - cut2)], -1),
                np.full((n, 2), np.nan)]
        centre = [np.stack([b / np.e ** 2, b], -1), np.stack([np.log(b) - 40, np.log(b) - 2], -1),
                  np.stack([a, a / np.e ** 2], -1), np.stack([np.log(-a) - 40, np.log(-a) - 2], -1)]
    spans = np.where(cross[:, None, None], np.stack(centre, 1), np.stack(edge, 1))
    kinds = np.where(cross[:, None], [0, 1, 0, 1], [3, 2, 3, 0])
    side = np.where(cross[:, None], [1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, 1.0, 1.0])
    base = np.stack([cut0, 0 * a, cut2, 0 * a], 1)[..., None]
    t, w = gauss_legendre(rule.get("outer", rule["legendre"]))
    with np.errstate(divide="ignore", invalid="ignore"):
        v = 0.5 * spans.sum(-1)[..., None] + 0.5 * (spans[..., 1] - spans[..., 0])[..., None] * t
        lw = np.log(0.5 * (spans[..., 1] - spans[..., 0]))[..., None] + np.log(w)
        kind = kinds[..., None]
        ell = np.select([kind == 1, kind == 2, kind == 3],
                        [side[..., None] * np.exp(v), _logit(v, beta), base + side[..., None] * v ** 2], v)
        lw = np.select([kind == 1, kind == 2, kind == 3],
                       [lw + v, lw - np.log(beta * v * (1 - v)), lw + np.log(2 * v)], lw)
    ell, lw = ell.reshape(n, -1), lw.reshape(n, -1)
    hermite = (r_lo > 0) & (r_hi < 1) & (lo <= wl_lo) & (hi >= wl_hi) & ~cross
    th, wh = np.polynomial.hermite.hermgauss(rule["hermite"])
    r = rbar[:, None] + np.sqrt(2.0) * sd * th
    with np.errstate(divide="ignore", invalid="ignore"):
        lh = np.log(np.sqrt(2.0) * sd * wh) + th ** 2 - np.log(beta * r * (1 - r))
    ell = np.where(hermite[:, None], np.pad(_logit(r, beta), ((0, 0), (0, ell.shape[1] - len(th)))), ell)
    lw = np.where(hermite[:, None], np.pad(lh, ((0, 0), (0, lw.shape[1] - len(th))), constant_values=-np.inf), lw)
    keep = np.isfinite(lw) & np.isfinite(ell)
    return np.nonzero(keep)[0], ell[keep], lw[keep]


def _quartic_roots(c):
    """Real roots of Σ_k c[..., k] D^k (k = 0 … 4, c_4 > 0), sorted, nan-padded to 4."""
    shape = c.shape[:-1]
    comp = np.zeros(shape + (4, 4))
    comp[..., 1:, :3] = np.eye(3)
    comp[..., :, 3] = -c[..., :4] / c[..., 4:5]
    z = np.linalg.eigvals(comp.reshape(-1, 4, 4)).reshape(shape + (4,))
    real = np.abs(z.imag) <= 1e-9 * np.maximum(1.0, np.abs(z.real))
    return np.sort(np.where(real, z.real, np.nan), axis=-1)


def d_intervals(poly, F, m, s, rule=RULE):
    """Intervals of D > 0 for each sign ± of u (rows × 2 signs × 2 intervals × [lo, hi], nan
    where empty): where the curve of constant ℓ is inside the prior's ellipse.
    ``poly`` (rows, 2, 3): D·u = poly[:, :, 0] + poly[:, :, 1] D + poly[:, :, 2] D²."""
    a = np.einsum("kab,kbj->kja", F, poly)                         # D·F u = a_0 + a_1 D + a_2 D²
    out = np.full((len(m), 2, 2, 2), np.nan)
    for i, sign in enumerate((1.0, -1.0)):                         # -u: D·F(-u) - m D ∝ a - (-m)
        b1 = a[:, 1] - sign * m
        c = np.stack([(a[:, 0] ** 2).sum(1), 2 * (a[:, 0] * b1).sum(1),
                      (b1 ** 2).sum(1) + 2 * (a[:, 0] * a[:, 2]).sum(1) - (rule["reach"] * s) ** 2,
                      2 * (a[:, 2] * b1).sum(1), (a[:, 2] ** 2).sum(1)], axis=1)
        roots = _quartic_roots(c)
        roots = np.where(roots > 0, roots, np.nan)
        roots = np.sort(roots, axis=1)
        # the quartic is ≥ 0 at D = 0 and D → ∞: inside between consecutive positive roots where
        # it is negative (checked at the midpoint)
        for j in range(3):
            lo, hi = roots[:, j], roots[:, j + 1]
            mid = 0.5 * (lo + hi)
            val = sum(c[:, k] * mid ** k for k in range(5))
            ok = np.isfinite(mid) & (val < 0) & (hi > lo)
            slot = np.where(np.isnan(out[:, i, 0, 0]), 0, 1)
            rows = np.flatnonzero(ok)
            out[rows, i, slot[rows]] = np.stack([lo[rows], hi[rows]], axis=1)
    return out


def _p_of_d(D, ell, beta):
    """p = σ_12 on the chart (ℓ_12 = -D² - ℓ)."""
    return 0.5 * (1 - np.tanh(0.5 * beta * (D ** 2 + ell)))


def _d_of_p(p, ell, beta):
    """D ≥ 0 with p = σ_12 (0 at and beyond the fold, inf for p ≤ 0)."""
    with np.errstate(invalid="ignore"):
        return np.sqrt(np.clip(np.nan_to_num(-_logit(p, beta) - ell, nan=0.0, neginf=0.0), 0, None))


def panels(p_lo, p_hi, ell, beta):
    """Panels of D along a curve of constant ℓ, for p's window [p_lo, p_hi] (rows × 3 × [lo, hi]):
    0 the edge's tail, D from p = p_hi/20 to p_lo (∞ if p_lo ≤ 0), integrated in D (there the
    likelihood is flat on its scale and the prior decides); 1 the window between, in p (the
    likelihood's Gaussian in p; the ends stay 1/20 of the window away from p = 0 and the fold,
    where dD/D = dp/(2βD² p(1 - p)) is singular); 2 the fold's side, D from 0, in log D."""
    top = _p_of_d(0.0, ell, beta)                                   # p at the fold, 1 - r
    lo, hi = np.maximum(p_lo, 0.0), np.minimum(p_hi, top)
    p1 = np.maximum(lo, hi / 20)
    p2 = np.minimum(hi, top - (top - lo) / 20)
    d_lo, d1, d2, d_hi = (_d_of_p(x, ell, beta) for x in (hi, p1, p2, lo))
    d_hi = np.where(p_lo <= 0, np.inf, d_hi)
    out = np.stack([np.stack([d1, d_hi], -1), np.stack([d2, d1], -1), np.stack([d_lo, d2], -1)], axis=1)
    return np.where((hi > lo)[:, None, None], out, np.nan)


def _legendre_panel(kind, lo, hi, ell, beta, t, w):
    """Nodes D and log weights of dD on [lo, hi] (in D) by Gauss–Legendre in the panel's
    variable (0: D, 1: p, 2: log D)."""
    if kind == 0:
        a, b = lo, hi
    elif kind == 1:
        a, b = _p_of_d(hi, ell, beta), _p_of_d(lo, ell, beta)
    else:
        with np.errstate(divide="ignore"):
            a, b = np.log(lo), np.log(hi)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = 0.5 * (a + b)[..., None] + 0.5 * (b - a)[..., None] * t
        lw = np.log(0.5 * (b - a))[..., None] + np.log(w)
        if kind == 0:
            D = v
        elif kind == 1:
            D = _d_of_p(v, ell[..., None], beta)
            lw = lw - np.log(2 * beta * D * v * (1 - v))
        else:
            D = np.exp(v)
            lw = lw + v
    ok = np.isfinite(lw) & np.isfinite(D) & (D > 0)
    return np.where(ok, D, 1.0), np.where(ok, lw, -np.inf)


def nodes(chart, params, owner, ell, log_w_ell, pbar, sd, F, m, s, beta, rule=RULE):
    """The chart rule's nodes for the outer nodes (``owner`` row, ℓ, log weight) with each row's
    p̄ and prior N(F u; m, s² I) of u: u (N, G, 2), σ(u) (N, G, 4) and log weights of du (N, G;
    -inf for unused slots), N = len(ell)."""
    k = rule["window"]
    N = len(ell)
    poly = chart(np.stack([np.ones(N), ell], axis=1), params)[:, POLY].reshape(N, 2, 3)
    box = d_intervals(poly, F[owner], m[owner], s[owner], rule)
    pan = panels(pbar[owner] - k * sd, pbar[owner] + k * sd, ell, beta)     # (N, 3, 2)
    t, w = gauss_legendre(rule["legendre"])
    Ds, lws = [], []
    for kind in range(3):                   # each panel ∩ each prior interval (sign, slot)
        lo = np.maximum(box[..., 0], pan[:, None, None, kind, 0])
        hi = np.minimum(box[..., 1], pan[:, None, None, kind, 1])
        bad = ~(hi > lo)
        lo, hi = np.where(bad, 1.0, lo), np.where(bad, 2.0, hi)
        D, lw = _legendre_panel(kind, lo, hi, ell[:, None, None], beta, t, w)
        Ds.append(D)
        lws.append(np.where(bad[..., None], -np.inf, lw))
    D, lw = np.concatenate(Ds, axis=-1), np.concatenate(lws, axis=-1)     # (N, sign, slot, G')
    out = chart(np.stack([D.ravel(), np.broadcast_to(ell[:, None, None, None], D.shape).ravel()], axis=1), params)
    sign = np.broadcast_to(np.array([1.0, -1.0])[None, :, None, None], D.shape).reshape(-1, 1)
    u = (sign * out[:, U]).reshape(N, -1, 2)
    sig = out[:, SIGMA].reshape(N, -1, 4)
    log_w = (lw + out[:, LOGDET].reshape(D.shape) + log_w_ell[:, None, None, None]).reshape(N, -1)
    return u, sig, log_w


def swapped(y, delta, rule=RULE):
    """Samples to run with the tokens swapped (y → P y P, p ↔ r): the outer rule wants r's
    window inside (0, 1); swap where only p's is."""
    p, r, sd = window(y, delta)
    k = rule["window"]
    inside = lambda x: (x - k * sd > 0) & (x + k * sd < 1)
    return ~inside(r) & inside(p)


def scaled(scale, rule=RULE):
    """The rule with its node counts × ``scale``."""
    return dict(rule, legendre=max(4, int(round(rule["legendre"] * scale))),
                hermite=max(4, int(round(rule["hermite"] * scale))))


def envelope(owner, F, m, s, n, rule=RULE):
    """One ellipse per sample containing the prior ellipses |F u - m| ≤ reach·s of all its rows
    (``owner`` sorted), as (F_e, m_e, s_e): 16 boundary points of every row's ellipse, their mean
    μ and covariance C, F_e = C^-½, m_e = F_e μ and reach·s_e the largest |F_e (point - μ)|
    (× 1.02: |point|² is a trigonometric polynomial of degree 2 along each boundary)."""
    per = 16
    pts = _boundary(np.linalg.inv(F), m, s, per, rule).reshape(-1, 2)
    count = np.bincount(owner, minlength=n) * per
    start = np.cumsum(count) - count
    mu = np.add.reduceat(pts, start, axis=0) / count[:, None]
    d = pts - np.repeat(mu, count, axis=0)
    C = np.add.reduceat(d[:, :, None] * d[:, None, :], start, axis=0) / count[:, None, None]
    w, U = np.linalg.eigh(C)
    Fe = np.einsum("kab,kb,kcb->kac", U, 1 / np.sqrt(np.maximum(w, 1e-300)), U)
    r = np.maximum.reduceat(np.linalg.norm(np.einsum("kab,kb->ka", np.repeat(Fe, count, axis=0), d), axis=1), start)
    return Fe, np.einsum("kab,kb->ka", Fe, mu), 1.02 * r / rule["reach"]


def integrate(y, omega, V, delta, rows, kernels, params, beta, threads=0, rule=RULE):
    """Moments about ω (log Z, E[Z - ω], E[(Z - ω)(Z - ω)ᵀ]) of every sample by the chart rule.
    ``rows`` = (owner sample (sorted), x_{<L} (rows × 2(L-1)), their log weights, F, m, s): one
    row per node of the earlier layers (one layer: one row per sample, F = I), each with the
    prior N(F u; m, s² I) of u_L given x_{<L}; h_L = F u_L.  The nodes of u_L are shared by a
    sample's rows, placed on the ``envelope`` of their priors.  ``kernels`` = (chart, forward) of
    the one-layer model.  The integrand is N(Z; ω, V ⊗ I_2) N(y; σ, Δ I) over Z = (x_{<L}, h_L),
    unfolded (rows and u nodes cover the whole space; ``_quadrature.integrate_product``)."""
    owner, x1, lw1, F, m, s = rows
    chart, forward = kernels
    n, RT = len(omega), omega.shape[1] * omega.shape[2]
    pbar, rbar, sd = window(y, delta)
    Fe, me, se = envelope(owner, F, m, s, n, rule)
    lo, hi = prior_ell_range(forward, me, se, np.linalg.inv(Fe), beta, rule)
    sample, ell, lw_ell = ell_rule(rbar, sd, lo, hi, beta, rule)
    u, sig, lw = nodes(chart, params, sample, ell, lw_ell, pbar, sd, Fe, me, se, beta, rule)
    lw = lw - 0.5 * ((y[sample][:, None] - sig) ** 2).sum(-1) / delta - 2 * np.log(2 * np.pi * delta)
    k, g = np.nonzero(np.isfinite(lw))
    n_u = np.bincount(sample[k], minlength=n)
    out = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
    if not k.size:
        return out
    unodes = np.ascontiguousarray(np.stack([u[k, g, 0], u[k, g, 1], lw[k, g]]))
    # rows: the prior of Z = (x_{<L}, h_L) as N(x_{<L}; ω_{<L}, V_{<L} ⊗ I) N(h_L; m, s² I)
    i = owner
    if x1.shape[1]:
        c = -np.log(2 * np.pi * V[i, 0, 0]) - 0.5 * ((x1 - omega[i, 0]) ** 2).sum(1) / V[i, 0, 0]
    else:
        c = np.zeros(len(i))
    c = c + lw1 + np.log(np.abs(np.linalg.det(F))) - np.log(2 * np.pi * s ** 2)
    table = np.concatenate([x1, c[:, None], F.reshape(-1, 4), m, 1 / s[:, None] ** 2], axis=1)
    order = np.lexsort((-c, i))                                   # by sample, heaviest rows first
    ptr = lambda count: np.concatenate([[0], np.cumsum(count)])
    _quadrature.integrate_product(np.ascontiguousarray(table[order]), ptr(np.bincount(i, minlength=n)), unodes,
                                  ptr(n_u), np.ascontiguousarray(omega.reshape(n, RT)), *out, threads)
    return out
