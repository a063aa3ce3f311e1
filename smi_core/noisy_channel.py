"""Route 2, ``"noisy"``: any differentiable link with Gaussian output noise,
P(y|Z) = N(y; g(Z), Δ I), integrated over all R·T indices (spec §1, §4).  See smi_core.channels
for the shared machinery and the README ("The noisy route for T = 2 attention").
"""
from __future__ import annotations

import numpy as np

from . import _quadrature, chart, validate
from .channels import (DEFAULT_NODES, Channel, Moments, _given_h1, _h2_var, _keep_lower, _per_token, _settings,
                       _shallow)
from .polar import PolarRule, _about, _growing, _merge, refine


def _token_channel(model, noise, escalate, options):
    """For a one-index link applied to each token alone (T > 1), the noisy channel of its
    one-token link (registered as "<name>·token"), else None."""
    from derive.closed import token_wise
    from .models import LinkModel, register_link
    link = getattr(model, "link", None)
    if link is None or link.indices != 1 or link.tokens == 1:
        return None
    g = token_wise(link.expr, link.tokens)
    if g is None:
        return None
    name = f"{link.name}·token"
    register_link(name, g, params=link.params)
    one = LinkModel(name, backend=model.backend, threads=options.get("threads"),
                    **{str(p): v for p, v in zip(link.params, model.params)})
    return NoisyChannel(one, noise, escalate, **options)


def _inverse_logdet(mix):
    """Node rows [Φ⁻¹ (T×T, row-major), log|det Φ|] (T² + 1, n) from mixing-kernel rows [Φ,
    log|det Φ|], T = 2 or 3, by the adjugate (inf where Φ is singular: integrate_polar skips
    those nodes)."""
    phi = mix.T
    if len(phi) == 5:
        adj = np.stack([phi[3], -phi[1], -phi[2], phi[0]])
        det = phi[0] * phi[3] - phi[1] * phi[2]
    else:
        M = phi[:9].reshape(3, 3, -1)
        C = np.stack([np.cross(M[(j + 1) % 3], M[(j + 2) % 3], axis=0) for j in range(3)])  # cofactors
        adj = C.swapaxes(0, 1).reshape(9, -1)                           # adj_ij = C_ji
        det = np.einsum("in,in->n", M[0], C[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.concatenate([adj / det, phi[-1:]])


def _no_mixing(k):
    """k node rows [Φ⁻¹, log|det Φ|] of Φ = I (one layer: no earlier layer mixes the tokens)."""
    return np.tile([[1.0], [0.0], [0.0], [1.0], [0.0]], (1, k))


class NoisyChannel(PolarRule, Channel):
    """Route 2: any differentiable link with Gaussian output noise, P(y|Z) = N(y; g(Z), Δ I).

    Tied softmax deep attention with T = 2, r = 1 and L ≤ 2 integrates broad posteriors by the
    polar rule (smi_core.polar) in x = (h_{<L}, u_L), u_L = Φ⁽ᴸ⁻¹⁾h_L (dh_L = du_L/|det Φ|): the
    likelihood N(y; σ_β(u_L u_Lᵀ), Δ I) depends on u_L alone and its softmax cliffs are lines
    through u_L = 0, so u_L gets a ring rule about the origin like the earlier layers, with
    counts × sharp = 1 + NOISY_SHARP/√Δ (the likelihood narrows the cliffs by ≈ √Δ; radial
    counts × √sharp).  Below POLAR_MIN_NOISE[L] samples whose likelihood window is well inside
    the softmax's range take the preimage rule (``PREIMAGE``: Gauss–Hermite in the off-diagonal
    entries of σ_β(u_L u_Lᵀ), where the likelihood is Gaussian), the others the chart rule
    (smi_core.chart: along the curves of constant σ_21 out to where the prior stops them)."""

    route, _route_id = "noisy", 1
    NOISY_SHARP = 0.8
    POLAR_SCALE = {1: 1.0, 2: 0.5}      # ring counts at the default ``nodes``
    POLAR_MIN_NOISE = {1: 1e-4, 2: 1e-3}    # below: too many ring nodes (∝ Δ^-3/4 per layer)
    # two layers below POLAR_MIN_NOISE, with the estimate: samples above ``escalate`` get h_1's rings ×1.5
    # (up to three times; ``_polar_run``).  At q = diag(0.3, 0.99), Δ = 1e-5 (64 draws) the
    # estimate is above 1e-4 on 69 % of the samples and at Δ = 1e-5, q = 0 / 0.3 / 0.9 on 0 / 0 /
    # 2 % (above 1e-5: 19 / 9 / 3 %)
    ESCALATE = 1e-4

    def __init__(self, model, noise: float, escalate: float | None = None, conditional: dict | None = None,
                 **options):
        """``escalate`` (T = 2 attention, L = 2, Δ < POLAR_MIN_NOISE[2]): the estimate above which
        a sample gets finer rings of h_1 (default ESCALATE; ``tol`` when given).  ``conditional``:
        entries of CONDITIONAL to change (two layers, Δ ≥ POLAR_MIN_NOISE[2]; e.g. state
        evolution's cheaper rule, ``state_evolution.CONDITIONAL``)."""
        super().__init__(model, **options)
        self._delta = validate.positive("noise", noise)
        self.escalate = self.ESCALATE if escalate is None else validate.positive("escalate", escalate)
        self.conditional = _settings("conditional", self.CONDITIONAL, conditional)
        self._n_node = self._n_data_noise = int(np.prod(model.output_shape)) if model.output_shape else 1
        spec = getattr(model, "spec", None)
        attention = (spec is not None and spec.architecture == "tied" and spec.link == "softmax"
                     and spec.rank == 1 and model.tokens == 2 and model.layers in self.POLAR_SCALE)
        self._preimage = attention and self._delta < self.POLAR_MIN_NOISE[model.layers]
        self._polar_applies = attention and (self._preimage or self._delta >= self.POLAR_MIN_NOISE[model.layers])
        self._token = None if attention else _token_channel(model, noise, escalate, options)
        if self._token is None:         # a token-wise link integrates by its one-token channel's kernels
            self._node_kernel = model.kernel("forward", self.threads)
            self._jac_kernel = model.kernel("jacobian", self.threads)
        if options.get("max_regions") is None and self._token is None and self.ridges and self.R * self.T > 2:
            self.max_regions = self.SURFACE_REGIONS
        if self._polar_applies:         # T = 2 attention, L ≤ 2: Δ ≥ POLAR_MIN_NOISE[L], or the preimage rule
            self._u_model = _shallow(model, self.threads, 1)
            self._u_jacobian = self._u_model.kernel("jacobian")
            self._u_reparam = self._u_model.kernel("reparam")
            if model.layers == 2:
                self._mixing_kernel = model.kernel("mixing", self.threads)
            if self._preimage:
                self._chart_kernels = self._u_model.kernel("chart"), self._u_model.forward

    @property
    def per_token(self):
        """The one-token channel of a token-wise link (``moments``), else None."""
        return self._token

    def moments(self, y, omega, V) -> Moments:
        """A one-index link applied to each token alone (``derive.closed.token_wise``): the
        posterior factorises over the tokens, so the moments are those of T one-token channels
        (log Z summed, ∂g_out diagonal, the estimate the largest) — a 1-D rule per token instead
        of a T-dimensional one."""
        if self._token is None:
            return super().moments(y, omega, V)
        y, omega, V = self._inputs(y, omega, V)
        n, T = len(omega), self.T
        for option in ("error_estimate", "escalate", "tol", "max_regions"):     # as set on this channel
            setattr(self._token, option, getattr(self, option))
        m = self._token.moments(y.reshape(n * T), omega.reshape(n * T, 1, 1), np.repeat(V, T, axis=0))
        dg_out = np.zeros((n, T, T))
        dg_out[:, np.arange(T), np.arange(T)] = m.dg_out.reshape(n, T)
        return Moments(log_z=m.log_z.reshape(n, T).sum(axis=1), g_out=m.g_out.reshape(n, 1, T),
                       dg_out=dg_out, error=m.error.reshape(n, T).max(axis=1))

    # -- T = 2 attention, L ≤ 2: the polar rule in (h_{<L}, u_L) --------------------------------
    @property
    def POLAR_DELTA(self):
        return self._delta

    # two layers: one group per V (each sample runs over its own ball and its arc of h_1, so the
    # node set-up is shared by the whole batch) with 4 radii per √V of each ring layer's range
    # (at least 32, before POLAR_SCALE and √sharp).  64-draw batches at Δ = 0.1, without the
    # estimate, against the previous rule at 1.5× the counts (16 draws): 3.2 / 6.8 / 20.7 ms per
    # sample at q = 0 / 0.3 / 0.9, max error 2.7e-4 / 1.6e-4 / 1.0e-6, where groups of |ω_ℓ|
    # cells 0.25√V wide took 3.3 / 27.4 / 45.7 ms at 2.7e-4 / 2.4e-4 / 1.2e-3
    POLAR_BY_LAYERS = {2: dict(bin=np.inf, density=4.0)}

    def _polar_layers(self, group, mu, V, scale):
        """Rings of h_ℓ (ℓ < L) as the reparametrised route's, and of u_L = Φ h_L from the origin
        to (‖Φ‖ bound s = 1 for L = 1, c + √2 for L = 2) · (|ω_L| + reach·√V_LL)."""
        L, c = self.model.layers, self.model.skip
        s = 1.0 if L == 1 else c + np.sqrt(2.0)
        sharp = 1.0 + self.NOISY_SHARP / np.sqrt(self._delta)
        rings = [self._polar_rings(group, mu[:, l], V[:, l, l], scale, (1 + c) ** (2 * l)) for l in range(L - 1)]
        return rings + [self._polar_rings(group, s * mu[:, L - 1], s * s * V[:, L - 1, L - 1], scale, 1.0,
                                          sharp=sharp, origin=L > 1)]

    _polar_data_rows = 2 * 2 + 1 + 4      # [Φ⁻¹ (2 × 2), log|det Φ|] and g = σ_β(u_L u_Lᵀ) (2 × 2)

    def _polar_fill(self, nodes, m):
        """Rows [Φ⁻¹, log|det Φ|] of Φ⁽ᴸ⁻¹⁾(h_{<L}) (identity for L = 1) and g = σ_β(u_L u_Lᵀ) of
        the nodes x = (h_{<L}, u_L) (rows 0…m-1), in place."""
        x = np.ascontiguousarray(nodes[:m].T)
        k = m - 2
        nodes[m + 1:m + 6] = self._mixing_rows(x[:, :k])
        nodes[m + 6:] = self._u_model.forward(x[:, None, k:]).reshape(len(x), 4).T

    def _polar_input(self, y):
        return y

    def _polar_scale(self):
        return (self.nodes or DEFAULT_NODES[2]) / DEFAULT_NODES[2] * (
            1.0 if self._preimage else self.POLAR_SCALE[self.model.layers])

    @property
    def escalates(self) -> bool:
        """Below POLAR_MIN_NOISE: samples whose estimate is above ``escalate`` get finer rings
        (``_polar_target``); without the estimate the result stands (with the last layer pinned,
        q = diag(0.3, 0.99), Δ = 1e-12: up to 0.35 off where the escalation leaves 1e-6).  Any
        other link with R·T ≤ 4 (``ridges``): samples whose estimate is above ``escalate`` go to
        the adaptive rule.  Two layers at Δ ≥ POLAR_MIN_NOISE[2]: samples above it whose h_2 is
        narrow given h_1 go to the conditional rule (``_laplace``)."""
        return (self._preimage and self.model.layers == 2) or self._conditional_applies or self.ridges

    @property
    def ridges(self):
        """Any link but T = 2 attention with R·T ≤ 4: samples whose estimate is above
        ``escalate`` go to the adaptive rule at that tolerance by default (``_adaptive_target``),
        from starting boxes refined onto the likelihood's ridge (``_ridge_rule``; a curved
        posterior, which the Laplace rule does not resolve: without it state evolution and the
        thresholds of such links are far off at small q — y = h_1 h_2 + noise at Δ = 0.01 has
        α_c 0.256 against 0.602, y = h_1² + h_2² + h_3²/2 + noise at Δ = 0.1 0.792 against
        1.141 and the wrong direction; see README "Adding a model").  R·T = 1 too: at ω = 0 the
        mode search of an even link such as y = z² + noise stays on the saddle z = 0 and the
        Laplace rule misses the two peaks ±√y (up to 450× off at Δ = 0.001, flagged).  A
        token-wise link: its one-token channel's."""
        if self._token is not None:
            return self._token.ridges
        return not self._polar_applies and self.R * self.T <= 4

    @property
    def unresolved(self):
        """Any link but T = 2 attention with R·T > 4 (randomised QMC): curved posteriors keep
        the Laplace rule unless ``tol`` is given; its estimate flags them (state evolution and
        the thresholds keep it on and warn).  A token-wise link: its one-token channel's."""
        if self._token is not None:
            return self._token.unresolved
        return not self._polar_applies and self.R * self.T > 4

    def _adaptive_target(self):
        return self._target(self.ridges)

    def _polar_target(self):
        """Finer rings by default below POLAR_MIN_NOISE only (above it the conditional rule)."""
        return self._target(self._preimage and self.model.layers == 2)

    # -- L = 2, T = 2, Δ < POLAR_MIN_NOISE[2]: the preimage rule ------------------------------
    # In the off-diagonal entries p = σ_12, r = σ_21 of σ_β(u_2 u_2ᵀ) = [[1 − p, p], [r, 1 − r]]
    # the likelihood N(y; σ, Δ I) is exactly N(p; p̄, Δ/2) N(r; r̄, Δ/2) (times a constant), p̄ =
    # (y_12 + 1 − y_11)/2, r̄ = (y_21 + 1 − y_22)/2, and (p, r) ↦ u_2 is the one-layer
    # reparametrisation on the triangle p, r > 0, p + r < 1 (du = dp dr / |det ∂(p, r)/∂u|, which
    # vanishes on the triangle's edges).  Given h_1 the prior of h_2 = Φ⁻¹u_2 is Gaussian; linear
    # in (p, r) about (p̄, r̄) it makes the posterior ≈ Gaussian in (p, r).  So each node of the
    # rings of h_1 (the reparametrised route's) gets a Gauss–Hermite product in (p, r) (``nodes``
    # per dimension at the default ``nodes``) on that Gaussian, per sample; the reflection
    # u_2 → −u_2 is folded (the sign nearer h_2's prior mean is taken).  It applies where the
    # likelihood's window stays ``margin`` sd inside the triangle: min(p̄, r̄, (1 − p̄ − r̄)/√2) ≥
    # margin·√(Δ/2) (margin 4: up to 3.8e-4 off, the Jacobian's zeros too near; 5: 1.6e-6).
    # Other samples take the chart rule (``_chart_run``).  As Δ → 0 the rule tends to the
    # reparametrised route's (one u node).
    PREIMAGE = dict(nodes=8, margin=6.0, piece=1 << 18)   # piece: nodes held at a time (≈ 30 MB)

    @property
    def _ring_layers(self):
        """The preimage rule needs only h_1 broad (h_2's prior is in its Gauss–Hermite rule)."""
        return 1 if self._preimage else self.model.layers

    def _preimage_applies(self, y):
        """Samples whose likelihood window in (p, r) (``chart.window``) stays PREIMAGE["margin"]
        sd inside the triangle."""
        p, r, sd = chart.window(y, self._delta)
        return np.minimum(np.minimum(p, r), (1 - p - r) / np.sqrt(2)) >= self.PREIMAGE["margin"] * sd

    def _preimage_u(self, p, r):
        """u_2 (the + pre-image) of σ = [[1 − p, p], [r, 1 − r]] by the generated one-layer
        reparametrisation, ∂(p, r)/∂u by its Jacobian kernel, and σ itself (rows of 4)."""
        S = np.stack([1 - p, p, r, 1 - r], axis=1)
        u = self._u_reparam(S, self.model.params)[:, :2]
        D = self._u_jacobian(u, self.model.params)[:, 4:].reshape(-1, 4, 2)[:, [1, 2]]    # ∂(p, r)/∂u
        return u, D, S

    def _polar_run(self, u, omega, V, Vinv, logdetV, scale):
        """One pass of the polar rule, or of the preimage rule: the rings of h_1 of every sample
        (groups of one; with one layer, none) at ``scale``, their nodes with the (p, r) rules
        (``_preimage_nodes``) PREIMAGE["piece"] at a time (bounded memory), each piece's moments
        merged by mass.  With two layers the (p, r) rules take at most the default scale: the
        escalation (``PolarRule._polar``) grows only h_1's rings, which limit the rule with the
        last layer pinned (twice the rings: 1.0e-2 → 1.2e-5; twice the chart nodes: no change),
        and its estimate is then the rings' alone."""
        if not self._preimage:
            return super()._polar_run(u, omega, V, Vinv, logdetV, scale)
        n, RT = len(omega), self.R * self.T
        total = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
        applies = self._preimage_applies(u)
        near, far = np.flatnonzero(~applies), np.flatnonzero(applies)
        inner = min(scale, self._polar_scale()) if self.model.layers == 2 else scale
        if near.size:
            _merge(total, near, self._chart_run(u[near], omega[near], V[near], scale, inner))
        if far.size:
            _merge(total, far, self._preimage_run(u[far], omega[far], V[far], Vinv[far], logdetV[far], scale, inner))
        return total

    def _ring_rows(self, omega, V, scale, reflect=False):
        """The nodes x_1 of h_1's rings (the reparametrised route's) of every sample, with their
        sample and log weights (one layer: one empty x_1 per sample); ``reflect``: also -x_1
        (the rings cover a half plane)."""
        n = len(omega)
        if self.model.layers == 1:
            return np.arange(n), np.zeros((n, 0)), np.zeros(n)
        rings = self._polar_rings(np.arange(n), np.linalg.norm(omega[:, 0], axis=1), V[:, 0, 0], scale, 1.0)
        owner = np.repeat(np.arange(n), rings.count.sum(axis=1))
        if reflect:
            order = np.argsort(np.tile(owner, 2), kind="stable")          # by sample
            return np.tile(owner, 2)[order], np.concatenate([rings.x, -rings.x])[order], np.tile(rings.log_w, 2)[order]
        return owner, rings.x, rings.log_w

    def _mixing_rows(self, x1):
        """Rows [Φ⁻¹, log|det Φ|] (5 × k, inf where Φ is singular; ``_inverse_logdet``: the
        adjugate keeps Φ⁻¹ invertible where Φ is near-singular, which the chart rule inverts
        back, where the inverse kernel's columns can lose all but their largest term) of Φ =
        Φ⁽¹⁾(x_1) for nodes x_1; one layer (x_1 with no columns): Φ = I."""
        if not x1.shape[1]:
            return _no_mixing(len(x1))
        return _inverse_logdet(self._mixing_kernel(np.ascontiguousarray(x1), self.model.params))

    def _last_prior(self, x1, omega, V):
        """For nodes x_1 (with their samples' ω, V): ``_mixing_rows`` and h_2 | x_1 ~ N(m, s² I)
        (m, s²).  One layer: no x_1, Φ = I and h_1 ~ N(ω_1, V_11 I)."""
        prior = _given_h1(x1, omega, V) if x1.shape[1] else (omega[:, 0], V[:, 0, 0])
        return (self._mixing_rows(x1),) + prior

    def _chart_run(self, y, omega, V, scale, inner):
        """The chart rule (smi_core.chart) with the tokens swapped where only p's window is
        inside (0, 1) (``chart.swapped``).  Rows: one layer, the samples (u_1 = h_1, F = I);
        two layers, the nodes ±x_1 of h_1's rings with F = Φ⁽¹⁾(x_1)⁻¹ and h_2's prior given
        x_1 (rows where Φ⁽¹⁾ is singular are left out)."""
        swap = chart.swapped(y, self._delta)
        perm = np.arange(2 * self.R).reshape(self.R, 2)[:, ::-1].ravel()      # index a*T + t, t ↔ 1 - t
        y = np.where(swap[:, None], y[:, [3, 2, 1, 0]], y)
        omega = np.where(swap[:, None, None], omega[:, :, ::-1], omega)
        owner, x1, lw1 = self._ring_rows(omega, V, scale, reflect=True)
        inv, m, s2 = self._last_prior(x1, omega[owner], V[owner])
        keep = np.isfinite(inv).all(axis=0)
        rows = owner[keep], x1[keep], lw1[keep], inv[:4, keep].T.reshape(-1, 2, 2), m[keep], np.sqrt(s2[keep])
        log_z, mean, second = chart.integrate(y, omega, V, self._delta, rows, self._chart_kernels,
                                              self.model.params, self.model.beta, self.threads, chart.scaled(inner))
        mean = np.where(swap[:, None], mean[:, perm], mean)
        second = np.where(swap[:, None, None], second[:, perm][:, :, perm], second)
        return log_z, mean, second

    def _preimage_run(self, u, omega, V, Vinv, logdetV, scale, inner):
        """The preimage rule (see PREIMAGE) for samples where it applies: h_1's rings at
        ``scale``, the (p, r) rule at ``inner``."""
        n, RT = len(omega), self.R * self.T
        total = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
        t, wt = np.polynomial.hermite.hermgauss(max(3, int(round(self.PREIMAGE["nodes"] * inner))))
        xi = np.stack(np.meshgrid(t, t, indexing="ij"), axis=-1).reshape(-1, 2)
        rule = xi, np.log(np.outer(wt, wt)).ravel() + (xi ** 2).sum(axis=1)
        centre = np.stack(chart.window(u, self._delta)[:2], axis=1)
        ustar, D, _ = self._preimage_u(*centre.T)
        Dinv = np.linalg.inv(D)                                                 # ∂u/∂(p, r) at u*
        owner, x1, lw1 = self._ring_rows(omega, V, scale)
        step = max(1, self.PREIMAGE["piece"] // len(xi))
        for a in range(0, len(owner), step):
            part = slice(a, a + step)
            i = owner[part]
            nodes = self._preimage_nodes(x1[part], lw1[part], omega[i], V[i], centre[i], ustar[i], Dinv[i], rule)
            ids, first, count = np.unique(i, return_index=True, return_counts=True)
            out = np.empty(len(ids)), np.empty((len(ids), RT)), np.empty((len(ids), RT, RT))
            _quadrature.integrate_polar(u[ids], omega[ids].reshape(-1, RT), Vinv[ids], logdetV[ids],
                                        np.arange(len(ids) + 1), first * len(xi), (first + count) * len(xi),
                                        nodes, *out, self.threads, self._delta)
            _merge(total, ids, out)
        return total

    def _preimage_nodes(self, x1, lw1, omega, V, centre, ustar, Dinv, rule):
        """The preimage rule's nodes for nodes x_1 (log weights lw1) of h_1's rings, each with
        its sample's ω, V, (p̄, r̄), u* and ∂u/∂(p, r) at u* (rows as the polar rule's, one node
        per column, x_1's Gauss–Hermite nodes ``rule`` = (ξ, log w_ξ + |ξ|²) consecutive).  With
        F = Φ⁽¹⁾(x_1)⁻¹: h_2 | x_1 ~ N(m, s² I), and h_2 = ±F u_2(p, r) ≈ h* + B δ with
        δ = (p, r) − (p̄, r̄), B = ±F ∂u/∂(p, r); with the likelihood N(δ; 0, Δ/2 I) the
        posterior ≈ N(δ; μ, Σ), Σ⁻¹ = 2I/Δ + BᵀB/s², μ = −ΣBᵀ(h* − m)/s²; nodes δ = μ + √2 Lξ
        (LLᵀ = Σ) with log weights log(2 det L) + log w_ξ + |ξ|² − log|det ∂(p, r)/∂u| on top of
        x_1's (nodes outside the triangle, or where Φ is singular, weigh 0).  One layer: no x_1,
        Φ = I and h_1 ~ N(ω_1, V_11 I)."""
        xi, lxi = rule
        G = len(xi)
        inv, m, s2 = self._last_prior(x1, omega, V)
        s2 = s2[:, None]
        finite = np.isfinite(inv).all(axis=0)                                  # Φ singular: weight 0
        F = np.where(finite[:, None, None], inv[:4].T.reshape(-1, 2, 2), np.eye(2))     # Φ⁻¹
        h = np.einsum("kab,kb->ka", F, ustar)
        sign = np.where(((h - m) ** 2).sum(1) <= ((h + m) ** 2).sum(1), 1.0, -1.0)[:, None]
        B = sign[:, :, None] * np.einsum("kab,kbc->kac", F, Dinv)
        P = 2 / self._delta * np.eye(2) + np.einsum("kba,kbc->kac", B, B) / s2[:, :, None]
        with np.errstate(all="ignore"):         # Σ = P⁻¹ and its Cholesky factor, 2 × 2
            Sigma = np.stack([P[:, 1, 1], -P[:, 0, 1], -P[:, 1, 0], P[:, 0, 0]], axis=1).reshape(-1, 2, 2) \
                / (P[:, 0, 0] * P[:, 1, 1] - P[:, 0, 1] * P[:, 1, 0])[:, None, None]
            l11 = np.sqrt(Sigma[:, 0, 0])
            L = np.stack([l11, 0 * l11, Sigma[:, 1, 0] / l11, np.sqrt(Sigma[:, 1, 1] - (Sigma[:, 1, 0] / l11) ** 2)],
                         axis=1).reshape(-1, 2, 2)
        finite &= np.isfinite(L).all(axis=(1, 2)) & (L[:, 0, 0] > 0) & (L[:, 1, 1] > 0)   # Φ near-singular:
        L = np.where(finite[:, None, None], L, 1.0)                                      # P lost to rounding
        mu = np.where(finite[:, None], -np.einsum("kab,kcb,kc->ka", Sigma, B, sign * h - m) / s2, 0.0)
        pr = ((centre + mu)[:, None] + np.sqrt(2.0) * np.einsum("kab,gb->kga", L, xi)).reshape(-1, 2)
        inside = (pr > 0).all(axis=1) & (pr.sum(axis=1) < 1) & np.repeat(finite, G)
        pr = np.where(inside[:, None], pr, 0.25)                               # placeholders, weight 0
        u2, Dn, S = self._preimage_u(*pr.T)
        u2 *= np.repeat(sign, G, axis=0)
        det = np.abs(Dn[:, 0, 0] * Dn[:, 1, 1] - Dn[:, 0, 1] * Dn[:, 1, 0])
        log_w = ((lw1 + np.log(2 * L[:, 0, 0] * L[:, 1, 1]))[:, None] + lxi[None]).ravel()
        log_w = np.where(inside, log_w - np.log(det), -np.inf)
        return np.ascontiguousarray(np.concatenate([np.repeat(x1.T, G, axis=1), u2.T, log_w[None],
                                                    np.repeat(inv, G, axis=1), S.T]))

    # -- L = 2, T = 2, Δ ≥ POLAR_MIN_NOISE[2], h_2 narrow: the conditional rule ------------------
    # With the last layer pinned (V_22 small) h_2's posterior given h_1 is a small ball about its
    # conditional prior mean, so u_2 = Φ⁽¹⁾(h_1) h_2 is a small ball that moves with h_1 over a
    # disc ≈ (c + √2)|ω_2| wide: a product of rings in h_1 and in u_2 puts few nodes on it, and
    # where h_2's sd falls below POLAR_MIN_SD the samples take the Laplace rule, whose
    # Gauss–Hermite in Z does not resolve h_1's softmax cliffs (Δ = 0.1, q = diag(0, 0.99): median
    # 4e-3 off, up to 1.3).  The conditional rule integrates over (h_1, h_2) instead: h_1 by the
    # reparametrised route's rings over the whole plane (``scale`` × the default counts), and per
    # node x_1 a Gauss–Hermite product in h_2 on N(m(x_1), s² I) (``nodes`` per dimension), with
    # the likelihood N(y; σ_β(u uᵀ), Δ I) at u = Φ⁽¹⁾(x_1) h_2 as the integrand — no 1/|det Φ|,
    # no reflections.  It applies where s ≤ ``sd`` (at s = 0.32, q₂₂ = 0.9, 8–12 nodes were
    # 3e-3 … 1e-2 off: the likelihood is not smooth on h_2's window) and is tried on the samples
    # whose estimate is above ``escalate`` (``tol`` when given); its result is kept where its own
    # estimate (``_conditional``) is lower.
    # ``aspect``: h_1's rings take √aspect × the angles and 1/√aspect × the radii (about as many
    # nodes): with h_2 narrow the posterior over h_1 is narrow across the rays, not along them.
    # On 32 draws at Δ = 0.1, q = diag(0, 0.999) (rounds off, against the rule at 4× the counts
    # and 16 nodes): aspect 1 / 1.56 / 2 / 2.8 90th percentile 1.5e-6 / 3.2e-8 / 1.6e-8 / 7.2e-7,
    # max 4.1e-4 / 3.8e-5 / 5.8e-6 / 5.2e-5, 12.7–13.0 ms per sample each (see the README)
    # escalate: its rounds' target (None: ``escalate``, or ``tol``)
    CONDITIONAL = dict(nodes=10, scale=2.0, rounds=3, sd=0.2, escalate=None, aspect=2.0)

    @property
    def _conditional_applies(self):
        """Two-layer T = 2 attention at Δ ≥ POLAR_MIN_NOISE[2] (below it, the preimage rule)."""
        return self._polar_applies and not self._preimage and self.model.layers == 2

    def _laplace(self, y, omega, V, Vinv, logdetV):
        """The Laplace rule (``Channel._laplace``); two layers with Δ ≥ POLAR_MIN_NOISE[2] and
        the estimate: its samples above ``escalate`` (``tol`` when given) whose h_2 is narrow
        given h_1 (s ≤ ``conditional["sd"]``; the rings take the samples with s ≥ POLAR_MIN_SD) get
        the conditional rule, kept where its estimate is lower (with ``tol``, instead of the
        adaptive rule: ``_escalated_elsewhere``)."""
        out = super()._laplace(y, omega, V, Vinv, logdetV)
        held = self._escalated_elsewhere(V)
        if held.any():
            target = self._target(True)
            redo = np.flatnonzero(held & ~(out[3] <= target))
            if redo.size:
                _keep_lower(out, redo, self._conditional(y[redo], omega[redo], V[redo], Vinv[redo], target))
        return out

    def _escalated_elsewhere(self, V):
        """Where the conditional rule runs (``_laplace``), the samples whose h_2 is narrow given
        h_1 (s ≤ ``conditional["sd"]``): the conditional rule, not the adaptive rule in Z, escalates
        them (at Δ = 0.1, q = diag(0, 0.99) that rule at its 4 000-box budget was ≈ 1e-4 off, the
        conditional rule ≈ 1e-6)."""
        if not self._conditional_applies or self._target(True) is None:
            return np.zeros(len(V), dtype=bool)
        return _h2_var(V) <= self.conditional["sd"] ** 2

    def _conditional(self, y, omega, V, Vinv, target):
        """The conditional rule at ``conditional``'s ``scale`` and ``nodes`` (both × ``nodes`` /
        DEFAULT_NODES[2]), its estimate the difference to the rule at scale / 1.5 and nodes − 2;
        samples above ``target`` (``conditional``'s ``escalate`` where given) get scale × 1.5 and
        nodes + 2 (the previous rule as the coarse one), up to ``rounds`` times.  Returns (log_z,
        E[Z], Cov[Z], error)."""
        c, ref = self.conditional, omega.reshape(len(omega), -1)
        target = c["escalate"] or target
        f = (self.nodes or DEFAULT_NODES[2]) / DEFAULT_NODES[2]
        scale, nodes = c["scale"] * f, max(3, round(c["nodes"] * f))
        coarse, fine = (self._conditional_run(y, omega, V, *lv) for lv in ((scale / 1.5, nodes - 2),
                                                                            (scale, nodes)))
        error = self._spread([fine, coarse], omega, V, Vinv, ref)
        scales = _growing(scale, 1.5, c["rounds"])
        refine(fine, error, target, c["rounds"], lambda i, k: self._conditional_run(
            y[i], omega[i], V[i], scales[k], nodes + 2 * (k + 1)),
            lambda i, runs: self._spread(runs, omega[i], V[i], Vinv[i], ref[i]))
        return (*_about(ref, *fine), error)

    def _conditional_run(self, y, omega, V, scale, count):
        """One pass of the conditional rule: h_1's rings at ``scale`` (radii × 1/√aspect, angles ×
        √aspect: ``conditional["aspect"]``; both half planes; nodes with |x_1 − ω_1|² > reach²
        V_11 left out, as the polar rule's), per node x_1 the
        ``count``² Gauss–Hermite nodes h_2 = m + √2 s ξ of N(h_2; m, s² I) (h_2 given x_1): the
        rule Σ e^{lb} N(Z; ω, V) N(y; g(Z), Δ I) at Z = (x_1, h_2) (``_quadrature.integrate_nodes``
        with the route's node kernel), lb = log w(x_1) + log(w_ξ/π) + |ξ|² + log(2π s²) (the
        Gauss–Hermite weight over N(h_2; m, s² I), which N(Z; ω, V) holds).  Returns (log_z,
        E[Z − ω], E[(Z − ω)(Z − ω)ᵀ])."""
        n, RT = len(omega), self.R * self.T
        total = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        t, wt = np.polynomial.hermite.hermgauss(count)
        xi = np.stack(np.meshgrid(t, t, indexing="ij")).reshape(2, -1)          # the nodes by columns
        lxi = np.log(np.outer(wt, wt) / np.pi).ravel() + (xi ** 2).sum(axis=0)
        Vinv, logdetV = np.linalg.inv(V), np.linalg.slogdet(V)[1]
        root = np.sqrt(self.conditional["aspect"])           # radii ÷ √aspect, angles × √aspect
        owner, x1, lw1 = self._ring_rows(omega, V, scale * np.array([1 / root, root]), reflect=True)
        near = ((x1 - omega[owner, 0]) ** 2).sum(axis=1) <= self._polar_params()["reach"] ** 2 * V[owner, 0, 0]
        owner, x1, lw1 = owner[near], x1[near], lw1[near]
        m, s2 = _given_h1(x1, omega[owner], V[owner])
        rows = np.column_stack([x1, m, np.sqrt(2 * s2), lw1 + np.log(2 * np.pi * s2)])
        ptr = np.searchsorted(owner, np.arange(n + 1))
        _quadrature.integrate_nodes(self._route_id, self._node_kernel.capsule("columns"), self.model.params,
                                    np.ascontiguousarray(y), omega.reshape(n, RT), np.ascontiguousarray(Vinv),
                                    logdetV, rows, ptr, xi, lxi, self.R, self.T, self._n_node, self._delta,
                                    *total, self.threads)
        return total

    # -- any other link: the adaptive rule's starting boxes refined onto the likelihood (R·T ≤ 4 by default) --
    # reach: boxes whose linearised residual stays above reach·√Δ are left whole (the likelihood
    # below e^{-reach²/2} there); width: the others are halved until g moves by at most width·√Δ
    # across them; cap: starting boxes per sample at most; floor: boxes where the prior bounds the
    # integrand below e^-floor of the highest point seen are left whole
    # (surface: the width for R·T ≥ 3, whose ridge is a surface; there the adaptive rule's default
    # budget is SURFACE_REGIONS)
    RIDGE = dict(reach=9.0, width=0.5, surface=4.0, cap=20000, floor=30.0)
    SURFACE_REGIONS = 10000

    def _ridge_rule(self):
        """Any link but T = 2 attention, d = R·T ≤ 4: the adaptive rule integrates the prior's
        piece alone (weight 1; its box ±ADAPTIVE_BOUND prior sd holds the posterior) from its
        PRIOR_SPLIT^d equal boxes, every box that the likelihood's ridge {g(x) = y} may cross
        halved until g changes by at most RIDGE["width"]·√Δ across it (RIDGE["surface"]·√Δ for
        R·T ≥ 3: on the shell y = h_1² + h_2² + h_3²/2 + noise the same errors as with 0.5 or 2
        at 0.5–0.8 of the time, 8 up to 15× the error at Δ = 0.01; ``_quadrature._ridge_boxes``:
        g and ∂g at the box's centre and corners; a heuristic, not a bound).  So a ridge far
        narrower than the prior, where the modes' Laplace pieces do not reach (a curved
        posterior), is seen by the starting boxes' points: otherwise none of them need lie on it,
        and the rule never refines there.  Boxes where the prior bounds the integrand below
        e^-RIDGE["floor"] of the highest point seen are left whole (far out along y = h_1 h_2 the
        ridge narrows as 1/|h|); the sums are relative to that point (at ω = 0 the Gauss–Newton
        search for y = h_1 h_2 + noise stays at the origin, a saddle e^-1000 below the ridge).
        One piece, not every piece's own boxes: where pieces overlap the ridge was refined two
        or three times."""
        if self._polar_applies or self.R * self.T > 4:
            return None
        r, sd = self.RIDGE, np.sqrt(self._delta)
        width = r["width"] if self.R * self.T <= 2 else r["surface"]
        return np.array([r["reach"] * sd, width * sd, r["cap"], r["floor"]])

    def _check_y(self, y, n):
        y = np.asarray(y, dtype=np.float64)
        shape = tuple(self.model.output_shape)
        if shape == () and y.ndim == 1:          # scalar outputs: (n,) is the natural form
            y = y.reshape(-1)
        else:
            y, _ = validate.batch("y", y, shape)
        if len(y) != n:
            raise ValueError(f"y and omega must have the same number of samples, got {len(y)} and {n}")
        return y.reshape(n, -1)

    def _prepare(self, y, omega, V):
        flips = self.model.symmetries()                                  # (S, R) row signs
        x0 = omega[:, None] * flips[None, :, :, None]
        signs = np.zeros((len(y), len(flips)))
        return y, np.ascontiguousarray(x0.reshape(len(y), len(flips), -1)), signs

    def _point(self, y, x, sign):
        return x

    def _prior(self, omega, V):
        """The prior of x = Z: N(ω, V ⊗ I_T)."""
        return omega.reshape(len(V), -1), _per_token(np.linalg.inv(V), self.T)
