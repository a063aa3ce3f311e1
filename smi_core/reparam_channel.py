"""Route 1, ``"reparam"``: noiseless softmax deep attention, tied, r = 1 (spec §4).

The integral over the earlier layers x = h_{<L} of Σ_± N([x; ±h_L(x)]; ω, V) / |det Φ⁽ᴸ⁻¹⁾(x)|
(L = 1: two points ±u_L), by the Laplace rule of ``Channel``, the polar rule (smi_core.polar)
where the earlier layers are broad, and adaptive cubature for a pinned last layer.  See
smi_core.channels for the shared machinery and the README ("Channel rules in detail").
"""
from __future__ import annotations

from functools import partial
from itertools import product

import numpy as np

from . import _quadrature, cusp_rule, logit_rule, theta3_rule, theta_rule, validate
from .channels import (DEFAULT_NODES, Channel, _amp, _given_h1, _keep_lower, _per_token, _settings,
                       _shallow, _whitening)
from .logit_rule import attention_targets
from .polar import PolarRule, _about, _growing


def _cliff_grid(nr, nth, beta_tmax, max_grade=12):
    """Boxes [t, θ, half-width in t, in θ] over t ∈ [0, 1] (in units of tmax), θ ∈ [0, π): nr
    intervals uniform in √t, and per interval nth uniform in θ plus cuts graded towards the softmax
    cliffs θ = 0, π/4, π/2 down to ≈ 1/(β t), the cliffs' width at the interval's outer end."""
    rays = np.array([0.0, 0.25, 0.5, 0.75, 1.0]) * np.pi      # the cliffs a = 0, b = 0, a = b
    t_cuts = (np.arange(nr + 1) / nr) ** 2
    base = []
    for k in range(nr):
        grade = int(np.clip(np.ceil(np.log2(np.pi / 8 * beta_tmax * t_cuts[k + 1])), 0, max_grade))
        near = (np.pi / 8) * 2.0 ** -np.arange(grade + 1)
        cuts = np.unique(np.clip(np.concatenate([np.linspace(0, np.pi, nth + 1), (rays[:, None] + near).ravel(),
                                                 (rays[:, None] - near).ravel()]), 0, np.pi))
        base.append(np.stack([np.full(len(cuts) - 1, t_cuts[k] + t_cuts[k + 1]) / 2,
                              (cuts[1:] + cuts[:-1]) / 2, np.full(len(cuts) - 1, t_cuts[k + 1] - t_cuts[k]) / 2,
                              np.diff(cuts) / 2], axis=1))
    return np.concatenate(base)


def _split_about(boxes, owner, centre, sd, k, cells):
    """Boxes [centre, half-widths] (2-D) of the samples ``owner``; per sample a window centre ±
    k·sd (rows of ``centre``, ``sd``; NaN: none).  Every box that meets its sample's window is
    cut along the window's edges (up to 9 pieces), the piece inside the window into cells of
    about sd (at most ``cells`` per axis); the other boxes, and those inside the window already
    no wider than sd, stay as they are.  Returns the boxes and their owners."""
    lo, hi, sd = (centre - k * sd)[owner], (centre + k * sd)[owner], sd[owner]
    a, z = boxes[:, :2] - boxes[:, 2:], boxes[:, :2] + boxes[:, 2:]
    work = np.all((a < hi) & (z > lo), axis=1) & ~np.all((a >= lo) & (z <= hi) & (2 * boxes[:, 2:] <= sd), axis=1)
    if not work.any():
        return boxes, owner
    a, z, lo, hi, sd, who = a[work], z[work], lo[work], hi[work], sd[work], owner[work]
    l, h = np.clip(lo, a, z), np.clip(hi, a, z)
    spans = np.stack([np.stack([a, l], axis=2), np.stack([l, h], axis=2), np.stack([h, z], axis=2)], axis=1)
    pieces = [np.concatenate([spans[:, i0, 0], spans[:, i1, 1]], axis=1)      # outside the window: one piece
              for i0, i1 in product(range(3), repeat=2) if (i0, i1) != (1, 1)]
    owners = [who] * len(pieces)
    m = np.clip(np.ceil((h - l) / sd), 1, cells).astype(int)                    # inside: m₀ × m₁ cells
    count = m[:, 0] * m[:, 1]
    row = np.repeat(np.arange(len(m)), count)
    c = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    index = np.stack([c // m[row, 1], c % m[row, 1]], axis=1)
    start = l[row] + (h - l)[row] * index / m[row]
    end = np.where(index + 1 == m[row], h[row], l[row] + (h - l)[row] * (index + 1) / m[row])
    pieces.append(np.stack([start[:, 0], end[:, 0], start[:, 1], end[:, 1]], axis=1))
    owners.append(who[row])
    e, who = np.concatenate(pieces), np.concatenate(owners)
    keep = (e[:, 1] > e[:, 0]) & (e[:, 3] > e[:, 2])
    e = e[keep]
    cut = np.stack([(e[:, 0] + e[:, 1]) / 2, (e[:, 2] + e[:, 3]) / 2, (e[:, 1] - e[:, 0]) / 2, (e[:, 3] - e[:, 2]) / 2], axis=1)
    return np.concatenate([boxes[~work], cut]), np.concatenate([owner[~work], who[keep]])


def _polar_sd(x, C):
    """(t, θ) = (|x|², arg x mod π) of points x (…, 2) of the h_1 plane and the sd of t and θ under
    their covariances C (…, 2, 2) (linearised)."""
    t = (x ** 2).sum(axis=-1)
    g = np.stack([2 * x, np.stack([-x[..., 1], x[..., 0]], axis=-1) / np.maximum(t, 1e-300)[..., None]], axis=-2)
    var = np.einsum("...ai,...ij,...aj->...a", g, C, g)
    return np.stack([t, np.arctan2(x[..., 1], x[..., 0]) % np.pi], axis=-1), np.sqrt(np.maximum(var, 0.0))


def _bisect_about(boxes, owner, point, sd, depth=40):
    """Per sample (rows of ``point``, ``sd``; NaN: none) the first of its boxes [centre,
    half-widths] (2-D; ``owner``: their samples) holding the point bisected, along the axis wider
    relative to sd, keeping the half with the point, until no wider than sd (at most ``depth``
    times); the halves left behind join the boxes.  Returns the boxes (changed in place) and
    their owners."""
    rows = np.flatnonzero(np.isfinite(point[owner, 0]))
    hold = rows[np.all(np.abs(point[owner[rows]] - boxes[rows, :2]) <= boxes[rows, 2:], axis=1)]
    hold = hold[np.unique(owner[hold], return_index=True)[1]]
    who = owner[hold]
    b, p, d = boxes[hold].copy(), point[who], sd[who]
    pieces, owners = [], []
    for _ in range(depth):
        r = np.flatnonzero(~np.all(b[:, 2:] <= d, axis=1))
        if not r.size:
            break
        ax = np.argmax(b[r, 2:] / d[r], axis=1)
        b[r, 2 + ax] *= 0.5
        other = b[r].copy()
        side = np.where(p[r, ax] >= b[r, ax], 1.0, -1.0) * b[r, 2 + ax]
        b[r, ax] += side
        other[np.arange(len(r)), ax] -= side
        pieces.append(other)
        owners.append(who[r])
    if not pieces:
        return boxes, owner
    boxes[hold] = b
    return np.concatenate([boxes] + pieces), np.concatenate([owner] + owners)


def _packed(centres, sds, found, tmax, heights=None):
    """Per rank k, the k-th usable (t, θ) centre and sd of every sample (n, 2) each, NaN where a
    sample has fewer: those ``found``, with t < tmax, sd finite and > 0; with ``heights``, from
    the highest down, skipping any within half an sd (per axis) of one already taken (peaks that
    Gauss–Newton reached from several starts, and their reflections ±x, one point in (t, θ))."""
    ok = found & (centres[..., 0] < tmax[:, None]) & np.all(np.isfinite(sds) & (sds > 0), axis=2)
    picks = []
    for i in range(len(tmax)):
        k = np.flatnonzero(ok[i])
        if heights is not None:
            taken = []
            for j in k[np.argsort(-heights[i, k], kind="stable")]:
                if not any(np.all(np.abs(centres[i, j] - centres[i, t]) <= 0.5 * sds[i, t]) for t in taken):
                    taken.append(j)
            k = taken
        picks.append(k)
    for rank in range(max((len(k) for k in picks), default=0)):
        c, d = np.full((len(tmax), 2), np.nan), np.full((len(tmax), 2), np.nan)
        for i, k in enumerate(picks):
            if rank < len(k):
                c[i], d[i] = centres[i, k[rank]], sds[i, k[rank]]
        yield c, d


class ReparamChannel(PolarRule, Channel):
    """Route 1: noiseless softmax deep attention, tied, r = 1 (spec §4 reparametrisation)."""

    route, _route_id, _delta, _n_data_noise = "reparam", 0, 0.0, 0

    def __init__(self, model, escalate: float | None = None, escalation: dict | None = None, **options):
        """``escalate``: the estimate above which a sample gets finer rules (``tol`` when given;
        default PINNED["escalate"] for L = 2, LAPLACE3_ESCALATE for L = 3, where only the
        Laplace rule escalates).  ``escalation``: entries of ESCALATION[T] to change (two
        layers; e.g. state evolution's, ``state_evolution.ESCALATION[2]``)."""
        spec = model.spec
        if not (spec.architecture == "tied" and spec.link == "softmax" and spec.rank == 1):
            raise ValueError("route='reparam' needs a tied softmax DeepAttention with rank=1; "
                             "use noise=Δ > 0 for the noisy route")
        super().__init__(model, **options)
        default = self.LAPLACE3_ESCALATE if model.layers == 3 else self.PINNED["escalate"]
        self.escalate = default if escalate is None else validate.positive("escalate", escalate)
        self.escalation = _settings("escalation", self.ESCALATION.get(model.tokens, self.ESCALATION[2]), escalation)
        self._u_model = _shallow(model, self.threads, 1)
        self._theta_grids = {}          # the θ rule's node rows per level (``_theta_nodes``)
        self._theta_weights = {}        # three layers: the weights per level (``_theta_rule``)
        if model.layers >= 2:
            self._node_kernel = model.kernel("node", self.threads)
            self._jac_kernel = model.kernel("node_jacobian", self.threads)
            self._inverse_kernel = model.kernel("inverse", self.threads)
            self._n_node = model.tokens + 1
        if model.layers == 3:
            # Φ⁽¹⁾⁻¹u_2 for the adaptive rule (``_pinned3``)
            self._phi1_kernel = _shallow(model, self.threads, 2).kernel("node")
            self._phi1_inverse = _shallow(model, self.threads, 2).kernel("inverse")   # Φ⁽¹⁾ (``_theta_layer1``)
            if options.get("max_regions") is None:      # the Laplace path's adaptive budget
                self.max_regions = self.LAPLACE3_REGIONS
        self.model_is_points = model.layers == 1

    # L = 3 on the Laplace path with ``tol``: the adaptive rule's default budget (``max_regions``;
    # two layers cross-check there with PINNED["cross_regions"]).  A near-singular V (h_1, h_2
    # correlated 0.98, conditional sd 0.011 / 0.029) at tol = 1e-7: estimate 2.1e-2 with 4 000
    # regions, 7.2e-5 with 200 000 (11 s), 6.4e-6 with 1 000 000 (46 s), the last two 2.3e-5 apart.
    LAPLACE3_REGIONS = 200000
    # L = 3 on the Laplace path by default (with the estimate): samples above it get the finer
    # Gauss–Hermite round (7 → 11 nodes per dimension; 17 would exceed GH_BUDGET).  On 64
    # state-evolution draws per q, against the rule at 16 nodes: max error 1.1e-2 / 6.0e-3 /
    # 1.6e-3 → 4.6e-4 / 1.7e-4 / 2.0e-5 at q = 0.97 / 0.98 / 0.99·I, 0.57 / 0.54 / 0.53 →
    # 1.69 / 1.36 / 1.06 ms per sample (see the README)
    LAPLACE3_ESCALATE = 1e-4

    # -- L = 2, 3 and T = 2: the polar rule about the cliffs' meeting point (smi_core.polar) ----
    POLAR_SCALE = {2: 1.0, 3: 4 / 7}    # node counts at the default ``nodes``
    # three layers: one group per V (bin = inf: each sample runs over its own ball and arcs, so
    # the node set-up is shared by the whole batch), 3 radii per √V_ℓℓ of the range (at least
    # 20.6), 6.9 to 57 angles per ring (c0·scale, cap·scale; more where the prior concentrates,
    # capk below), the prior cut at e^-15.  Max
    # error on 64 draws per q (1024-draw batches) against the previous rule at nodes = 20:
    # 6.9e-5 / 6.4e-5 / 3.6e-5 at q = 0 / 0.3 / 0.9 (the previous defaults: 1.3e-4 / 2.9e-4 /
    # 9.5e-4; its groups of |ω_ℓ| cells 2√V_ℓℓ wide set up 4.5 M nodes for 1024 draws at q = 0.9,
    # against 1.3 M).  c2 = 1.5: the prior's concentration needs ≈ 2.6√k angles for 1e-6 (k the
    # von Mises concentration), c2 = 3 gave 2× the node pairs at q = 0.9 for the same error;
    # c0 and radial set the q = 0 and q = 0.3 tails (c0 = 10: 1.3e-4 at q = 0; 32 radii:
    # 1.4e-4 at q = 0.3); capk = 0.5: the cap grows ∝ (k/k0)^¼ where the prior concentrates (a
    # sample runs over ∝ 1/√k of such a ring), for a q = 0.9 draw whose h_2 rings at
    # r ≈ |ω_2| = 2.4 needed ≈ 70 angles (1.6e-3 → 6.2e-5; a flat cap of 180 did the same but
    # took q = 0.3 to 2.4 ms)
    # blend: the polar and Laplace rules are mixed for conditional sd in [0.2, 0.25] (see
    # _polar_weight): with the last layer pinned they disagree (up to 13× on 32 draws at
    # q = diag(0.96, 0.945, 0.9995)), and a hard switch made three-layer state evolution cycle
    # about it (α = 1.5, amplitude 1.5e-3 in q₁₁).  Two layers keep the hard switch: both rules
    # are accurate there and the mixture would take in the Laplace rule's unescalated error
    # (q̂₁₁ off the tol = 1e-7 channel by 3.5e-5 at q = diag(0.95, 0.998), 1024 draws, against
    # 4.6e-8 with the switch)
    POLAR_BY_LAYERS = {3: dict(radial=36, density=3.0, c0=12.0, c2=1.5, cap=100, capk=0.5, reach=5.5,
                               bin=np.inf, blend=0.25)}

    # T = 3 (the spherical rule, two layers): groups of |ω_1| cells 2√V_11 wide (each sample runs
    # over its own shells; a shell holds ≈ 0.64 N² nodes against N for a ring, so the T = 2 cells,
    # 0.25√V_11, spent most of the time in node set-up: 1.76 against 0.51 ms per sample at q = 0.9,
    # 1024 draws, without the estimate; one group per V, 0.52 ms, left a draw 9.8e-6 off)
    POLAR_T3 = dict(bin=2.0)

    def _polar_params(self):
        return super()._polar_params() | (self.POLAR_T3 if self.T == 3 else {})

    # three layers, every layer about as narrow (the last layer's conditional sd over the narrowest
    # earlier layer's, ρ, at least ratio[1]): the polar rule down to conditional sd 0.13 instead of
    # POLAR_MIN_SD, by a hard switch (both rules accurate there, and the blend ran both: at q =
    # 0.975 / 0.98·I 5.2 / 6.1 ms per sample where either alone took ≈ 1.5–3); threshold and blend
    # width move linearly between ρ = ratio[0] and ratio[1].  Against the channel at tol = 1e-6
    # (24 draws per q, 256-draw batches): at q = 0.95·I the polar rule 1.2e-5 max in 1.4 ms per
    # sample where the blend of both rules took 4.2 ms at 8.4e-4; at 0.97·I 2.5e-5 where the
    # Laplace rule was up to 1.5e-4 off (5.3e-3 on another draw, y at the softmax edge); at 0.98
    # both within 2e-5.  With the last layer pinned the polar rule is the worse one (q = diag(0.97,
    # 0.97, 0.999), ρ = 0.18: up to 0.51 off where the Laplace rule is 6.3e-3), so there threshold
    # and blend stay.
    POLAR3_MIN_SD = dict(sd=0.13, ratio=(0.5, 0.8))

    def _evenness(self, prec):
        """ρ = √(max_ℓ<L (V⁻¹)_ℓℓ / (V⁻¹)_LL) per sample (prec: each sample's diagonal of V⁻¹):
        about 1 where every layer is about as narrow, small where the last layer is pinned."""
        return np.sqrt(self._ring_prec(prec) / prec[:, -1])

    def _polar_threshold(self, prec):
        """POLAR_MIN_SD and the blend; three layers: towards POLAR3_MIN_SD["sd"] and a hard switch
        as ρ (``_evenness``) grows through POLAR3_MIN_SD["ratio"]."""
        s_min, blend = super()._polar_threshold(prec)
        if self.model.layers != 3:
            return s_min, blend
        lo, hi = self.POLAR3_MIN_SD["ratio"]
        t = np.clip((self._evenness(prec) - lo) / (hi - lo), 0.0, 1.0)
        return s_min + t * (self.POLAR3_MIN_SD["sd"] - s_min), blend * (1 - t)

    # three layers with every layer about as narrow (ρ ≥ POLAR3_MIN_SD["ratio"][0], see
    # _polar_threshold: broad q·I and the polar rule's narrow range alike), by default with the
    # estimate: samples whose estimate is above it get one round of the polar rule at 1.5× the
    # counts.  The estimate is pessimistic (at 0.9·I its median is 1e-4 … 3e-4 at errors ≈ 1e-6),
    # but the default's errors above 1e-4 came with estimates above it: on 512 state-evolution
    # draws per q (seed 3, against tol = 1e-6) max error 9.0e-4 → 5.2e-5 at q = 0.9·I (39 samples take the round,
    # 28 % of the time), 1.1e-4 → 5.6e-5 at 0.95, 1.2e-4 → 2.1e-5 at 0.97, 2.3e-4 → 4.7e-5 at
    # 0.975 (13–15 samples, 16–20 %); none at q = 0 and 0.3.  Until 2026-12-02 it was 1e-2 and
    # only where the polar rule took over from the Laplace rule (the threshold lowered and the
    # conditional sd below 0.25), which left 4 of those 512 draws at 0.9·I above 1e-4 (1.3e-3 on
    # another draw, estimating 3.4e-2).  Not where the last layer is pinned (ρ small: the rounds
    # do not converge there).
    POLAR3_ESCALATE = 3e-3

    # two layers, T = 2: the samples whose estimate is above the target (``tol``, else
    # ``escalate``) get the polar rule at 1.5× the counts for up to ``rounds`` rounds, then the
    # adaptive rule (``_pinned``), until their estimate is below ``refine`` × the target.  With
    # three rounds to the target itself (before 2026-11-28), 256 draws at q = diag(0, 0.99) /
    # diag(0, 0.999) / diag(0.3, 0.995) took 0.84 / 5.1 / 1.2 ms per sample, max error 5.8e-7 /
    # 2.9e-7 / 2.4e-7 (against tol = 1e-8); now 0.30 / 1.1 / 0.54 ms, 5.8e-7 / 2.2e-7 / 1.1e-7:
    # the finer polar rules converge for most pinned samples, and cost less than the adaptive
    # rule.  Eight rounds to the target itself (256 other draws): 0.20 / 0.96 / 0.29 ms, but up
    # to 2.4e-6 off.  T = 3 (the spherical rule, then the Laplace rule): six rounds to the target
    # itself.  With the last layer pinned three rounds left 37 of 64 draws at q = diag(0, 0.999)
    # estimating above 1e-3, up to 9.9 off the 3-D reference; six rounds leave 2 (max 4.6e-3) at
    # 14× the time, and on the six draws checked against the reference at n = 20 are within its
    # bound plus 1.6e-5 (three rounds: 5.7e-4 … 9.9 off).  Seven rounds: 2.6× more again.
    # ``angular``: of each round's growth 1.5² in nodes, the angles take 1.5^angular and the radii
    # 1.5^(2 − angular) (``_polar_round_scales``; three layers: both 1.5).  With the last layer
    # pinned the posterior's error is mostly angular: on 256 draws at q = diag(0, 0.99), the rule
    # without the estimate at 2× / 8× the radii / angles was within 2.1e-8 (90th percentile) in
    # 87 µs per sample, at 8× / 2× 1.2e-4 in 114 µs.  1.2 against 1 (sequential, one core; errors
    # against tol = 1e-9): see the README ("The last layer pinned").  Ten rounds (eight until
    # 2026-11-29): the adaptive rule after eight costs more than two more rounds at q₂₂ = 0.9999,
    # 256 draws at diag(0, 0.9999), one core: 26 samples reached it after eight rounds, 6 after
    # ten; the benchmark's pinned draws, 6.7–7.6 against 30.5–35.0 ms per sample; the same max
    # error on 128 draws against tol = 1e-8 (3.3e-6, the draw estimating 1.0e-6); twelve rounds
    # were slower again beside a busy process (36 against 15 ms, round 11's nodes)
    ESCALATION = {2: dict(rounds=10, refine=0.1, angular=1.2, logit=True, cusp=True, gauss=True, theta=True), 3: dict(rounds=6, refine=1.0, angular=1.0)}

    def _polar_escalation(self, Vinv, error):
        """``tol`` (two layers: ``escalate`` by default), three rounds; two layers: the samples
        above it, ``escalation``'s rounds to its ``refine`` × it; three layers without ``tol``:
        POLAR3_ESCALATE where every layer is about as narrow (ρ ≥ POLAR3_MIN_SD["ratio"][0]),
        one round."""
        target, rounds = super()._polar_escalation(Vinv, error)
        if self.model.layers == 2:
            if target is not None:
                target = np.where(error > target, target * self.escalation["refine"], np.inf)
            return target, self.escalation["rounds"]
        if target is None and self.model.layers == 3 and self.error_estimate:
            prec = np.diagonal(Vinv, axis1=1, axis2=2)
            even = self._evenness(prec) >= self.POLAR3_MIN_SD["ratio"][0]
            return np.where(even, self.POLAR3_ESCALATE, np.inf), 1
        return target, rounds

    def _polar_round_scales(self, scale, rounds):
        """Two layers: (radial, angular) multipliers per round, × 1.5^(2 − a) and × 1.5^a, a =
        ``escalation["angular"]``; three layers: × 1.5 both."""
        if self.model.layers != 2:
            return super()._polar_round_scales(scale, rounds)
        a = self.escalation["angular"]
        return _growing(np.array([scale, scale]), 1.5 ** np.array([2 - a, a]), rounds)

    @property
    def _ring_layers(self):
        return self.model.layers - 1

    @property
    def _polar_stall(self):
        """L = 3: a sample whose estimate fell by less than half when the counts grew by 1.5 is
        left to the adaptive rule (``_pinned3``): with the last layer pinned the rings converge
        too slowly to be worth growing (on a q₃₃ = 0.99 draw the three rounds took 7.8 of the
        13.7 s of the sample with tol = 1e-3)."""
        return 0.5 if self.model.layers == 3 else None

    @property
    def escalates(self) -> bool:
        """L = 2: samples whose estimate is above ``escalate`` get finer rules (``_polar``,
        ``_laplace``); without the estimate the result stands, off by up to 1e3 (relative) in
        the pinned regime.  L = 3 escalates only its Laplace rule (``_laplace_target``) and
        counts as not escalating: state evolution and GAMP keep turning its estimate off (one
        finer round there cost 2–4× per sample at q = 0.97 … 0.99·I)."""
        return self.model.layers == 2

    @property
    def _polar_applies(self):
        """T = 2 and L ∈ {2, 3}, or T = 3 and L = 2 (shells: the spherical rule); the rings are
        on the earlier layers (the likelihood pins h_L on a plateau of Φ)."""
        return self.model.layers in self.POLAR_SCALE and (self.T == 2 or (self.T == 3 and self.model.layers == 2))

    def _polar_layers(self, group, mu, V, scale):
        """The rings of every earlier layer h_ℓ about the origin (amp = (1 + c)^{2(ℓ-1)})."""
        return [self._polar_rings(group, mu[:, l], V[:, l, l], scale, (1 + self.model.skip) ** (2 * l))
                for l in range(self.model.layers - 1)]

    @property
    def _polar_data_rows(self):
        return self.T * self.T + 1

    def _polar_fill(self, nodes, m):
        """Rows [Φ⁻¹ (row-major), log|det Φ|] of Φ = Φ⁽ᴸ⁻¹⁾(x) (x: rows 0…m-1), by the generated
        inverse kernel, in place."""
        self._inverse_kernel.columns(nodes[:m], self.model.params, nodes[m + 1:])

    def _polar_input(self, y):
        return self._u_model.reparametrise(y).u

    def _polar_scale(self):
        d = 2 * (self.model.layers - 1)
        return (self.nodes or DEFAULT_NODES[d]) / DEFAULT_NODES[d] * self.POLAR_SCALE[self.model.layers]

    def _polar_target(self):
        return self._target(self.escalates)

    def _laplace_target(self):
        """As the polar rule's (two layers: ``escalate`` by default), and for three layers
        ``escalate`` by default too (LAPLACE3_ESCALATE), while their polar rule escalates only
        with ``tol``.  Without it, at q = 0.965·I nine of 1024 two-layer state-evolution draws
        (T = 2, 14 nodes per dimension) were 1.4e-5 … 3.2e-5 off, and with T = 3 (9 nodes) up
        to 1.1e-5 of 8, estimating 24–180× their errors; at 14 nodes (T = 3) within 9.1e-9."""
        return self._target(self.escalates or self.model.layers == 3)

    def _polar(self, y, omega, V, Vinv, logdetV):
        """The θ rule first where it applies (``_theta``), the polar rules (``_polar_rules``) for
        the samples it leaves."""
        theta = self._theta_applies(omega, V)
        if not theta.any():
            return self._polar_rules(y, omega, V, Vinv, logdetV)
        n, RT = len(omega), self.R * self.T
        out = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT)), np.empty(n)
        idx = np.flatnonzero(theta)
        rest = np.setdiff1d(np.arange(n), idx[self._theta(y[idx], omega[idx], V[idx], Vinv[idx], out, idx)])
        if rest.size:
            for a, b in zip(out, self._polar_rules(y[rest], omega[rest], V[rest], Vinv[rest], logdetV[rest])):
                a[rest] = b
        return out

    # two layers, T = 2, the first layer not learned (ω_1 = 0, V₁₂ = 0: state evolution at
    # q₁₁ = 0; ``escalation["theta"]``), with the estimate: the θ rule (smi_core.theta_rule) at
    # n × n nodes for n in ``levels`` while its estimate is above the rounds' target (``escalate``
    # or ``tol`` × ``escalation["refine"]``); the samples it leaves above go to the polar rules.
    # A level only takes samples whose likelihood it resolves, n·w ≥ ``resolve`` (w its sd in θ,
    # ``_theta_width``): where the grid misses the likelihood's peak, both weight sets miss it
    # alike and the estimate is no guide (2026-12-03: the ridge draw 119 at q₂₂ = 0.9999, w =
    # 0.0055, was 1.5e3 off at 81 estimating 4.7e-7).  Without the guard, of 256 draws each at
    # q = diag(0, 0.99), diag(0, 0.999), diag(0, 0.9999) (seed 0) the estimate accepted two
    # 8.5e2 off (n = 33, n·w = 0.35 and 0.26, at 0.9999) and every other one within 9e-7.  The
    # levels before the last take only n·w ≥ ``start`` (it took none below 2.9 at 33 and 2.0 at
    # 57): 1 903 / 6 154 / 7 030 → 1 835 / 4 891 / 5 227 nodes per sample at the three q.  The
    # estimate is no strict bound: on those draws it was up to 2.7× below the error at n·w ≥ 3 and
    # 5.8× at n·w = 1.2 (a benchmark draw at 0.9999: 1.03e-6 off estimating 7.2e-7), so a sample
    # stands at ``margin`` × the target, n·w ≥ 1.5: all 256 / 192 / 67 taken within 6.3e-8 /
    # 1.1e-7 / 1.2e-7 at 2 166 / 5 172 / 4 010 nodes per sample.  The level 121 (moments to degree
    # 121, theta_rule.DEGREES: within 5e-13 of the same at 24 nodes per panel) takes 35 / 47 more
    # of those draws at 0.999 / 0.9999, within 3.6e-8 / 1.3e-7 of the nested reference (estimates
    # ≤ 9.3e-8 / 1.5e-7); a level 161 after it took 33 more at 0.9999 but saved no time.
    THETA = dict(levels=(33, 57, 81, 121), resolve=1.5, start=3.0, margin=0.25)

    # three layers, T = 2, the first two not learned (ω_1 = ω_2 = 0, V diagonal: state evolution
    # at q = diag(0, 0, q₃₃)) and the last layer pinned (V₃₃ ≤ ``pinned``; at q₃₃ = 0.9 the polar
    # rule converges, 7e-7 against twice its counts, at 0.99 it is up to 1.2 off): the nested θ
    # rule (smi_core.theta3_rule) at (n_1, n_2) nodes per layer for ``levels`` while its
    # estimate is above ``margin`` × the target (``tol``, else ``escalate``), a sample going on to
    # the first level its estimate predicts below that (``_theta_next``, ``slopes``: the median
    # log10 ratios of consecutive levels' estimates on 64 draws at q₃₃ = 0.99, seed 0, where
    # these levels would take 30 / 15 / 9 / 4 / 5 of them and leave one; the jumps cut the nodes
    # per sample by 11 % there, the (27, 21) level by 3 %).  The prediction only moves a sample up:
    # every result still stands on its own estimate.  Without ``tol`` the
    # last level's result stands for every sample left, with its estimate (flagged where above the
    # target: better than the polar rule's there), with ``tol`` those go on to the polar rounds
    # and the adaptive rule (``_pinned3``).
    # No width guard: the likelihood is broad in θ (on 8 draws at q₃₃ = 0.99, 77–100 % of the
    # (21, 21) nodes within e^−60 of the largest), and w = √V₃₃ (c + √2)²/|ω_31 − ω_32| did not tell the levels'
    # samples apart.  On 256 draws at q₃₃ = 0.99 (seed 0), against the rule at (57, 33): a level
    # took 96 / 142 / 212 / 236 of them at (15, 15) / (21, 21) / (33, 27) / (45, 33), within
    # 3.5e-6 / 2.2e-6 / 6.1e-6 / 5.4e-7 (the estimate up to 23× below the error, so the margin).
    # skip: the table's interpolation in θ_1 (K = 9, not in the estimate) degrades as c → 0, where
    # Φ_1 turns singular at the wedge's edge: K = 9 against 13 at (33, 27), 32 draws at q₃₃ = 0.99
    # on the samples resolved, median / max 1.3e-8 / 1.3e-7 at c = 1 (β = 2), 1.3e-6 / 1.6e-5 at
    # c = 0.5, 5.5e-4 / 9.5e-3 at c = 0.1.
    THETA3 = dict(levels=((15, 15), (21, 21), (27, 21), (33, 27), (45, 33)), slopes=(-1.5, -1.4, -1.2, -2.0),
                  margin=0.25, pinned=0.05, skip=0.5)

    def _theta_applies(self, omega, V):
        """Per sample: T = 2, the θ rule on and a target (``_theta_target``), the earlier layers not
        learned (ω_ℓ = 0 and V diagonal) and, for three layers, c ≥ THETA3["skip"] and V₃₃ ≤
        THETA3["pinned"]."""
        L = self.model.layers
        if not (L in (2, 3) and self.T == 2 and self.escalation.get("theta") and self._theta_target() is not None
                and (L == 2 or self.model.skip >= self.THETA3["skip"])):
            return np.zeros(len(omega), dtype=bool)
        off = V - np.einsum("nii->ni", V)[:, :, None] * np.eye(L)
        ok = (omega[:, :L - 1] == 0).all(axis=(1, 2)) & (off == 0).all(axis=(1, 2))
        return ok & (V[:, 2, 2] <= self.THETA3["pinned"]) if L == 3 else ok

    def _theta_target(self):
        """Two layers: the polar rounds' target × ``escalation["refine"]``; three: the Laplace
        rule's (``tol``, else ``escalate``)."""
        if self.model.layers == 2:
            target = self._polar_target()
            return None if target is None else target * self.escalation["refine"]
        return self._laplace_target()

    def _theta(self, y, omega, V, Vinv, out, idx):
        """The θ rule's levels for the samples (y, ω, V) (``_theta_applies``), each set of prior
        variances V_ℓℓ (ℓ < L) apart; its results (log Z, E[Z], Cov[Z], estimate) written into
        ``out`` at idx where the estimate ends below ``margin`` × the target (three layers without
        ``tol``: and every sample at the last level).  Returns the mask of those samples."""
        L = self.model.layers
        settings = self.THETA if L == 2 else self.THETA3
        goal = self._theta_target() * settings["margin"]
        u = np.ascontiguousarray(self._polar_input(y))
        ref = np.ascontiguousarray(omega.reshape(len(y), -1))
        prec = np.stack([Vinv[:, -1, -1], np.zeros(len(y)), Vinv[:, -1, -1]], axis=1)
        omega_l = np.ascontiguousarray(omega[:, -1])
        done = np.zeros(len(y), dtype=bool)
        width = self._theta_width(omega, V) if L == 2 else None         # three layers: no width guard
        priors = np.einsum("nii->ni", V)[:, :L - 1]
        levels = settings["levels"]
        step = np.zeros(len(y), dtype=int)                      # three layers: each sample's next level
        for v in np.unique(priors, axis=0):
            for k, n in enumerate(levels):
                last = L == 3 and n == levels[-1] and self.tol is None
                todo = (priors == v).all(axis=1) & ~done
                if L == 3:
                    todo &= step == k
                if width is not None:
                    todo &= n * width >= settings["resolve" if n == levels[-1] else "start"]
                i = np.flatnonzero(todo)
                if not i.size:
                    continue
                nodes, weights, outer = self._theta_rule(tuple(v), n)
                sums = np.empty((i.size, 1 + 2 * (9 + 3 * (L - 1))))
                _quadrature.theta_product(nodes, weights, u[i], omega_l[i], prec[i], sums, self.threads, outer)
                full, cut = (theta_rule.sums(sums, s, omega_l[i], v, V[i, -1, -1]) for s in (0, 1))
                estimate = self._spread([full, cut], omega[i], V[i], Vinv[i], ref[i])
                take = (estimate <= goal) | last
                for a, b in zip(out, (*_about(ref[i], *full), estimate)):
                    a[idx[i[take]]] = b[take]
                done[i[take]] = True
                if L == 3 and n != levels[-1]:
                    step[i] = self._theta_next(k, estimate, goal)
        return done

    def _theta_next(self, k, estimate, goal):
        """Three layers: the next level for samples whose estimate at level k is ``estimate``, the
        first whose estimate THETA3["slopes"] (the typical log10 ratio of consecutive levels')
        predicts to be ≤ goal, at most the last."""
        slopes = np.asarray(self.THETA3["slopes"][k:])
        predicted = np.log10(np.maximum(estimate, 1e-300))[:, None] + np.cumsum(slopes)
        below = predicted <= np.log10(goal)
        return k + 1 + np.where(below.any(axis=1), below.argmax(axis=1), len(slopes) - 1)

    def _theta_width(self, omega, V):
        """The likelihood's sd in θ (theta_rule): w = √V₂₂ (c + √2)/|ω_21 − ω_22|, ‖Φ‖ ≤ c + √2."""
        with np.errstate(divide="ignore"):
            return np.sqrt(V[:, 1, 1]) * (self.model.skip + np.sqrt(2)) / np.abs(omega[:, 1, 0] - omega[:, 1, 1])

    def _theta_rule(self, priors, n):
        """(node rows, weights, outer weights) of the θ rule at level n for prior variances
        ``priors`` (V_ℓℓ, ℓ < L): node rows [Φ⁽ᴸ⁻¹⁾⁻¹ (2×2, row-major), log|det Φ⁽ᴸ⁻¹⁾|] by the
        generated inverse kernel at a pre-image of each node, kept per n; weights
        ``theta_rule.weights`` (two layers, no outer ones) or the inner and outer ones of
        ``theta3_rule.weights`` (three), kept per (priors, n)."""
        beta = self.model.beta
        if self.model.layers == 2:
            return self._theta_nodes(n, lambda: theta_rule.grid(n, beta)), theta_rule.weights(beta * priors[0], n), None
        if self._theta_weights.get("priors") != priors:          # kept for one set of priors (≈ 230 MB, all levels)
            self._theta_weights = {"priors": priors}
        if n not in self._theta_weights:
            phi1 = np.linalg.inv(self._theta_layer1(theta3_rule.K)[1])
            inner = theta3_rule.interpolate(theta3_rule.table(beta * priors[1], phi1), n[0])
            self._theta_weights[n] = theta3_rule.weights(beta * priors[0], inner, self._theta_layer1(n[0])[1], *n)

        def preimages():
            h1, phi1inv = self._theta_layer1(n[0])
            g = theta_rule.grid(n[1], beta)
            h2 = np.einsum("iab,bj->aij", phi1inv, g)                        # h_2 = Φ_1⁻¹g per (θ_1, θ_2) node
            return np.concatenate([np.repeat(h1, g.shape[1], axis=1), h2.reshape(2, -1)])
        return (self._theta_nodes(n, preimages), *self._theta_weights[n])

    def _theta_layer1(self, n):
        """h_1 (2, n²) at the θ rule's n × n grid (``theta_rule.grid``) and Φ_1⁻¹ there (n², 2, 2),
        by the two-layer model's generated inverse kernel."""
        cols = np.zeros((8, n * n))
        cols[:2] = theta_rule.grid(n, self.model.beta)
        self._phi1_inverse.columns(cols[:2], self.model.params, cols[3:])
        return cols[:2], cols[3:7].T.reshape(-1, 2, 2)

    def _theta_nodes(self, n, preimages):
        """The θ rule's node rows [Φ⁻¹ (2×2, row-major), log|det Φ|] at level n (the generated
        inverse kernel at the pre-images x (``preimages()``, (L−1)T × nodes) of its nodes), once per n."""
        if n not in self._theta_grids:
            x = preimages()
            m = len(x)
            cols = np.zeros((m + 6, x.shape[1]))
            cols[:m] = x
            self._polar_fill(cols, m)
            self._theta_grids[n] = np.ascontiguousarray(cols[m + 1:])
        return self._theta_grids[n]

    def _polar_rules(self, y, omega, V, Vinv, logdetV):
        """Each earlier layer h_ℓ in polar coordinates about the origin (``PolarRule._polar``);
        ``nodes`` scales every count (by nodes / DEFAULT_NODES[d] · POLAR_SCALE[L], d = 2(L - 1)).
        L = 2 (with the estimate): tol defaults to ``escalate``, and samples still above the
        escalation's target (``escalation["refine"]`` × it after its rounds) are
        integrated again by the adaptive rule to it (``_pinned``; T = 3: the Laplace rule,
        ``_laplace``), kept where its estimate is lower (T = 3: the estimate taken no lower than
        the two rules' difference; at q = diag(0, 0.99) the Laplace rule's adaptive cubature was
        once kept 29 off while estimating 1.4e-4).  L = 3 with ``tol``: samples above
        max(tol, PINNED3["floor"]) are integrated again by the four-dimensional adaptive rule
        (``_pinned3``), kept where its estimate is lower."""
        log_z, mean, cov, error, target, spare = self._polar_refined(y, omega, V, Vinv, logdetV)
        if self.model.layers == 3:
            target = self._polar_target()
            target = None if target is None else max(target, self.PINNED3["floor"])
        redo = np.flatnonzero(error > target) if target is not None else []
        if len(redo):       # e.g. the last layer pinned: the adaptive rule, kept where its estimate is lower
            if self.model.layers == 3:
                rule = partial(self._pinned3, ref=mean[redo], shift=log_z[redo])
            else:
                rule = partial(self._pinned, tol=target[redo]) if self.T == 2 else self._laplace
            better = rule(y[redo], omega[redo], V[redo], Vinv[redo], logdetV[redo])
            if self.T == 3:     # the Laplace rule's estimate can miss mass: no lower than the rules' difference
                differ = self._differ(omega[redo], V[redo], Vinv[redo], (log_z[redo], mean[redo], cov[redo]), better)
                better = (*better[:3], np.maximum(better[3], differ))
            _keep_lower((log_z, mean, cov, error), redo, better)
        if spare is not None:       # the logit rule where its estimate was above the target
            _keep_lower((log_z, mean, cov, error), *spare)
        return log_z, mean, cov, error

    # two layers, T = 2, V diagonal (``escalation["logit"]``): samples the polar rule flags whose
    # windows in θ avoid θ = (½, ½) (smi_core.logit_rule) get the logit rule before the polar
    # rounds, at nodes[start] and the next count of Gauss–Legendre nodes per panel (from
    # nodes[0] where the target is at least ``loose``: state evolution's 1e-3) — the estimate
    # their difference — then the next while the estimate is above the rounds' target; kept
    # where it is below, and otherwise at the end where its estimate is lower than the other
    # rules'.  Max error on the samples it takes at q = diag(0, 0.9999) / diag(0, 0.999): 5 nodes
    # 4.5e-3 / 7.9e-4, 6 1.2e-4 / 8.3e-5, 8 1.0e-5 / 1.5e-6, 10 4.4e-7 / 1.4e-8.  Those samples took most of the rounds' time: 56 of 128
    # state-evolution draws at q = diag(0, 0.9999) (seed 0) took 80 %, 30 of 256 at diag(0,
    # 0.999) 68 % (see the README, "The logit rule").
    LOGIT = dict(nodes=(5, 6, 8, 10, 12, 16), start=2, loose=1e-4, target=np.inf)
    # the same for the samples whose window is about θ = (½, ½) (``escalation["cusp"]``,
    # smi_core.cusp_rule), at (d panel, m) node counts.  Max error on the 71 / 29 it takes of 256
    # draws at q = diag(0, 0.9999) / diag(0, 0.999) (seed 0, against tests/nested_reference.py):
    # (4, 8) 1.8e-4 / 1.1e-4, (5, 10) 2.5e-6 / 3.2e-6, (6, 12) 1.8e-7 / 1.4e-7, (8, 14)
    # 2.8e-8 / 1.9e-9, each below its difference to the count before.  They took 57 % / 34 % of
    # the channel's time there (3.3 / 2.0 ms per sample).  From (5, 10) and to at most
    # ``target`` whatever the rounds' target: state evolution's 1e-3 from (4, 8) put q̂₁₁ 4.8e-6
    # (relative) off the tol = 1e-7 channel at q = diag(0.59, 0.995) (256 draws; 4.8e-8 now).
    CUSP = dict(nodes=((5, 10), (6, 12), (8, 14), (10, 18)), start=0, loose=0.0, target=1e-6)
    # before both (``escalation["gauss"]``), the samples whose every window's Gaussian lies inside
    # the range (``logit_rule.gauss``) — the logit rule's, and those with one window that holds
    # θ = (½, ½) at k = 9 but whose Gaussian keeps 8 sd from it — get the Gauss–Hermite rule in θ
    # at n × n nodes per sign, the same way; those it leaves above the target go on to the others.
    # Max error on the 60 / 10 it takes of 256 draws at q = diag(0, 0.9999) / diag(0, 0.999) (seed
    # 0, against tests/nested_reference.py): 6.2e-8 / 7.8e-10 (README: "Gauss–Hermite in θ").
    GAUSS = dict(nodes=(8, 10, 12, 16, 20), start=1, loose=1e-4, target=np.inf)

    def _polar_shortcut(self, u, omega, V, Vinv, logdetV, fine, error, target):
        """Two layers, T = 2: the Gauss–Hermite rule in θ (``logit_rule.gauss``), then the logit
        rule (``logit_rule``) and the cusp rule (``cusp_rule``) for the samples above ``target``
        where they apply (and the rules before left them above it), written into ``fine`` and ``error``
        where their estimate is below it; returns the samples where it is not and their (log Z,
        E[Z], Cov[Z], estimate), or None."""
        if self.model.layers != 2 or self.T != 2:
            return None
        c, beta = self.model.skip, self.model.beta
        flagged = np.flatnonzero(error > target)
        centre, w, meets, logit = logit_rule.windows(u[flagged], omega[flagged], V[flagged], c)
        cusp, near = cusp_rule.applies(centre, w, meets, omega[flagged], V[flagged], c, beta)
        spare, done = [], np.zeros(len(flagged), dtype=bool)
        if self.escalation["gauss"]:    # the logit rule's samples, and those with one window, whose Gaussians fit
            chol, fits = logit_rule.gauss(centre, omega[flagged], V[flagged], meets, logit, c)
            if fits.any():
                left = self._node_rule(flagged[fits], self.GAUSS, partial(logit_rule.gauss_nodes, centre[fits], chol[fits],
                                                                          meets[fits], beta),
                                       u, omega, V, Vinv, logdetV, fine, error, target)[0]
                done = fits & ~np.isin(flagged, left)
        logit, cusp = logit & ~done, cusp & ~done
        if self.escalation["logit"] and logit.any():
            i = flagged[logit]
            pairs, axes = logit_rule.panels(omega[i], V[i], beta, centre[logit], w[logit], meets[logit])
            spare.append(self._node_rule(i, self.LOGIT, partial(logit_rule.nodes, pairs, axes),
                                         u, omega, V, Vinv, logdetV, fine, error, target))
        if self.escalation["cusp"] and cusp.any():
            i = flagged[cusp]
            layout = cusp_rule.Layout(near[cusp], omega[i], V[i], c, beta)
            spare.append(self._node_rule(i, self.CUSP, lambda todo, n: layout.nodes(todo, *n),
                                         u, omega, V, Vinv, logdetV, fine, error, target))
        if not spare:
            return None
        return np.concatenate([s[0] for s in spare]), tuple(np.concatenate(a) for a in zip(*(s[1] for s in spare)))

    # the node rules' columns are set up for NODE_RULE_NODES nodes at a time (the first part:
    # NODE_RULE_FIRST samples, then as many as the previous part's nodes per sample let in): all
    # at once, 12–19 M nodes (0.8–1.2 GB of fresh pages) for 4096 draws at q = diag(0, 0.9999)
    NODE_RULE_NODES = 1 << 16
    NODE_RULE_FIRST = 8

    def _node_rule(self, idx, settings, nodes_of, u, omega, V, Vinv, logdetV, fine, error, target):
        """A rule of growing node counts (``settings["nodes"]``; ``nodes_of(todo, count)`` gives
        its node columns and per sample their range) for the samples idx: from count
        ``start`` (0 where the target is at least ``loose``), the estimate each run's difference
        to the one before, the next count while it is above ``target`` (at most
        ``settings["target"]``).  Written into ``fine`` and ``error`` where it ends below;
        returns the other samples and their (log Z, E[Z], Cov[Z], estimate)."""
        RT, ref, m = 4, np.ascontiguousarray(omega.reshape(-1, 4)), len(idx)
        runs = np.empty(m), np.empty((m, RT)), np.empty((m, RT, RT))
        estimate, ran = np.full(m, np.inf), np.zeros(m, dtype=bool)
        first = np.where(target[idx] >= settings["loose"], 0, settings["start"])
        goal = np.minimum(target[idx], settings["target"])
        for k, n in enumerate(settings["nodes"]):
            todo = np.flatnonzero((first <= k) & ~(estimate <= goal))
            if not todo.size:
                continue
            out = np.empty(todo.size), np.empty((todo.size, RT)), np.empty((todo.size, RT, RT))
            done, size = 0, self.NODE_RULE_FIRST
            while done < todo.size:         # NODE_RULE_NODES at a time, from the previous part's count
                part = slice(done, done + size)
                s = idx[todo[part]]
                cols, start, stop = nodes_of(todo[part], n)
                self._polar_fill(cols, 2)
                _quadrature.integrate_polar(u[s], ref[s], Vinv[s], logdetV[s], np.arange(len(s) + 1), start, stop,
                                            cols, *(a[part] for a in out), self.threads)
                done += size
                size = max(1, int(self.NODE_RULE_NODES * len(s) / max(stop[-1], 1)))
            again = ran[todo]
            if again.any():
                t = todo[again]
                estimate[t] = self._spread([tuple(a[again] for a in out), tuple(a[t] for a in runs)],
                                           omega[idx[t]], V[idx[t]], Vinv[idx[t]], ref[idx[t]])
            for a, b in zip(runs, out):
                a[todo] = b
            ran[todo] = True
        take = estimate <= goal
        for total, part in zip(fine, runs):
            total[idx[take]] = part[take]
        error[idx[take]] = estimate[take]
        rest = np.flatnonzero(~take)
        return idx[rest], (*_about(ref[idx[rest]], *(a[rest] for a in runs)), estimate[rest])

    def _laplace(self, y, omega, V, Vinv, logdetV):
        """The Laplace rule (``Channel._laplace``); L = 2 with ``tol``: every sample is integrated
        again by the adaptive rule (``_pinned``, whose estimate includes κ) at tol·PINNED["cross"]
        (up to PINNED["cross_regions"] regions), whose result is kept; the error is the larger of
        its estimate / PINNED["cross"] and the difference between the two rules (κ: on a
        near-singular draw with y uninformative along V's thin direction, κ ≈ 3e3, the rule at
        tol·PINNED["cross"] without κ was 4.5e-6 off, with it 1.1e-8).  The
        Laplace rule's estimate (the difference of two Gauss–Hermite rules) misses a posterior
        that is a thin curved ridge (near-singular V at an angle to the layers): on such draws
        it was off by 1.3e-6 to 9e-6 while estimating 1e-9 to 1e-7; the adaptive rule at 1e-9
        was within 7e-8 of an independent brute-force rule on 9 of 10 such draws and 1.2e-6 off
        on the tenth (estimating 1e-9), hence the difference."""
        out = super()._laplace(y, omega, V, Vinv, logdetV)
        if self.model.layers != 2 or self.tol is None or self.T != 2:
            return out
        cross = self.PINNED["cross"]
        better = self._pinned(y, omega, V, Vinv, logdetV, tol=self.tol * cross,
                              max_regions=self.PINNED["cross_regions"])
        differ = self._differ(omega, V, Vinv, out, better)
        return (*better[:3], np.maximum(better[3] / cross, differ))

    # -- L = 2, T = 2, samples the polar rule flags: adaptive cubature seeded at the posterior's peaks --
    # window, cells, ridge: see ``_pinned_boxes`` and ``_pinned_ridges``.  Before 2026-11-28 the
    # box holding a peak was only bisected down to the peak's sd, which left long thin siblings
    # whose Genz–Malik nodes straddled the peak's tails: at q = diag(0, 0.9999) a posterior ridge
    # of sd 0.007 × 0.026 in h_1 (state-evolution draw 119 of 128, seed 0) lost 42 % of its mass
    # while estimating 1e-6.  Windows of ± 3 sd still lost 0.1 %, ± 4 sd 7e-7 of the mass; ± 6 sd
    # is exact to the reference's 1e-8.  Draw 101 is a long curved ridge whose tail (8.6e-9 of
    # the mass, but h_2 5 sd from its mean) lies far beyond the window, across the cliff θ = 0:
    # 4.5e-5 off at every target from 1e-6 to 1e-7 until the boxes followed the ridge
    # (``test_reparam_l2_pinned_ridge``).
    PINNED = dict(escalate=1e-5, grid=(8, 8), reach=8.0, max_regions=20000, window=6.0, cells=12, ridge=40, floor=30.0,
                  cross=1e-2, cross_regions=200000)

    def _pinned_starts(self, u, omega, V):
        """Gauss–Newton starts at the h_1 that puts h_2 at its mean given h_1, per sign of u_2:
        Φ⁽¹⁾ = cI + A with A row-stochastic, so (cI + A) h_2 = ±u_2 is linear in A's two free
        entries; A is then the softmax output of one layer, whose pre-image is h_1 (up to sign;
        the reflection nearer ω_1 is kept).  Iterated three times (the mean of h_2 depends on
        h_1 when V₁₂ ≠ 0).  Returns (n, 2, 2) starts and (n, 2) signs; NaN where A is outside
        the softmax's range (no such h_1)."""
        n, c = len(u), self.model.skip
        starts = np.full((n, 2, 2), np.nan)
        for k, sign in enumerate((1.0, -1.0)):
            h1 = omega[:, 0].copy()
            for _ in range(3):
                v = _given_h1(h1, omega, V)[0]
                own = attention_targets(u, v, c, sign)          # NaN where dv = 0: no such A
                with np.errstate(invalid="ignore"):
                    ok = np.isfinite(own).all(axis=1) & (own > 0).all(axis=1) & (own < 1).all(axis=1) & (own.sum(axis=1) > 1)
                A = np.stack([own[:, 0], 1 - own[:, 0], 1 - own[:, 1], own[:, 1]], axis=1).reshape(n, 2, 2)
                h = np.full((n, 2), np.nan)
                if ok.any():
                    h[ok] = self._u_model.reparametrise(A[ok]).u
                nearer = ((h - omega[:, 0]) ** 2).sum(axis=1) <= ((h + omega[:, 0]) ** 2).sum(axis=1)
                h1 = np.where(ok[:, None], np.where(nearer[:, None], h, -h), omega[:, 0])
            starts[ok, k] = h1[ok]
        return starts, np.broadcast_to([1.0, -1.0], (n, 2))

    def _pinned_peaks(self, u, omega, V, Vinv, const0):
        """Local maxima of each term of the integrand over h_1 (Gauss–Newton, ``_quadrature.modes``)
        from the pinned starts, from ±ω_1 and, for each sign of u_2, from two rings about ω_1
        (radii √V₁₁ and 2√V₁₁, 8 angles: a sign without an exact pre-image still has a peak where
        h_2 comes closest to its mean), with their Laplace covariances; peaks more than
        PINNED["floor"] below the highest are dropped.  Returns centres (n, K, 2), covariances
        (n, K, 2, 2), log heights (n, K) (-inf: dropped), signs of u_2 (n, K)."""
        n = len(u)
        pinned, pin_signs = self._pinned_starts(u, omega, V)
        _, x0, signs = self._prepare_starts(u, omega)
        phi = np.arange(8) * np.pi / 4
        ring = np.concatenate([r * np.stack([np.cos(phi), np.sin(phi)], axis=1) for r in (1.0, 2.0)])
        ring = omega[:, None, 0] + np.sqrt(V[:, 0, 0])[:, None, None] * ring[None]
        x = np.concatenate([np.where(np.isfinite(pinned), pinned, omega[:, None, 0]), x0, ring, ring], axis=1)
        ring_signs = np.repeat([1.0, -1.0], len(phi) * 2)
        signs = np.ascontiguousarray(np.concatenate([pin_signs, signs, np.broadcast_to(ring_signs, (n, ring_signs.size))], axis=1))
        x = np.ascontiguousarray(x)
        logf, cov = self._log_f(u, omega, Vinv, const0, x, signs)
        logf[logf < logf.max(axis=1, keepdims=True) - self.PINNED["floor"]] = -np.inf
        return x, cov, logf, signs

    def _log_f(self, u, omega, Vinv, const0, x, signs, iterations=50):
        """log f of the integrand's term of sign ``signs`` (n, K) at h_1 = x (n, K, 2), -inf where
        not finite, and its Gauss–Newton Laplace covariance; with ``iterations`` > 0, x first moves
        to the local maximum (in place; ``_quadrature.modes``)."""
        n = len(u)
        logf, hess = np.empty(x.shape[:2]), np.empty(x.shape[:2] + (2, 2))
        _quadrature.modes(0, self._jac_kernel.capsule(), self.model.params, np.ascontiguousarray(u),
                          np.ascontiguousarray(omega.reshape(n, 4)), Vinv, const0, x,
                          np.ascontiguousarray(signs, dtype=float), logf, hess, 2, 2, self._n_node, 0.0,
                          iterations=iterations, threads=self.threads)
        det = hess[..., 0, 0] * hess[..., 1, 1] - hess[..., 0, 1] * hess[..., 1, 0]
        adj = np.stack([hess[..., 1, 1], -hess[..., 0, 1], -hess[..., 1, 0], hess[..., 0, 0]], axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):     # a singular Hessian (e.g. skip = 0): NaN or inf
            cov = (adj / det[..., None]).reshape(hess.shape)
        return np.where(np.isfinite(logf), logf, -np.inf), cov

    def _pinned_ridges(self, u, omega, Vinv, const0, peaks, logf, signs):
        """Points along the ridge through each sign's highest peak (the posterior over h_1 can be a
        long curved ridge whose tails reach far beyond the peak's window): from the peak, up to
        PINNED["ridge"] steps each way of one local Laplace sd along the major axis, each followed
        by the best of 17 points across it (± 4 minor sd), while log f stays within
        PINNED["floor"] of the peak.  Returns points (n, P, 2), their Laplace covariances
        (n, P, 2, 2) and a mask (n, P) of the points found."""
        n, rows = len(u), np.arange(len(u))[:, None]
        top = np.argmax(np.where(signs[:, None, :] == [[1.0], [-1.0]], logf[:, None, :], -np.inf), axis=2)
        start, height, sign = peaks[rows, top], logf[rows, top], np.broadcast_to([1.0, -1.0], (n, 2))
        across = np.linspace(-4.0, 4.0, 17)
        points, covs, found = [], [], []
        for direction in (1.0, -1.0):
            x, prev = start.copy(), np.zeros((n, 2, 2))
            C = self._log_f(u, omega, Vinv, const0, np.ascontiguousarray(x), sign, iterations=0)[1]
            alive = np.isfinite(height)
            for _ in range(self.PINNED["ridge"]):
                alive &= np.isfinite(C).all(axis=(2, 3))
                live = np.flatnonzero(alive.any(axis=1))        # the samples with a track still going
                if not live.size:
                    break
                w, E = np.linalg.eigh(np.where(alive[live, :, None, None], C[live], np.eye(2)))
                e = direction * E[..., 1]
                e = np.where((e * prev[live]).sum(axis=2, keepdims=True) < 0, -e, e)
                perp = np.stack([-e[..., 1], e[..., 0]], axis=2)
                sd = np.sqrt(np.maximum(w, 0.0))
                trial = (x[live] + sd[..., 1:] * e)[:, :, None] + (sd[..., :1] * perp)[:, :, None] * across[:, None]
                lf, Ct = self._log_f(u[live], omega[live], Vinv[live], const0[live],
                                     np.ascontiguousarray(trial.reshape(len(live), -1, 2)),
                                     np.repeat(sign[live], len(across), axis=1), iterations=0)
                lf, Ct = lf.reshape(len(live), 2, -1), Ct.reshape(len(live), 2, -1, 2, 2)
                r, k = np.arange(len(live))[:, None], np.argmax(lf, axis=2)
                alive[live] &= lf[r, [[0, 1]], k] > height[live] - self.PINNED["floor"]
                x[live], C[live], prev[live] = trial[r, [[0, 1]], k], Ct[r, [[0, 1]], k], e
                points.append(x.copy())
                covs.append(C.copy())
                found.append(alive.copy())
        if not points:
            return np.zeros((n, 0, 2)), np.zeros((n, 0, 2, 2)), np.zeros((n, 0), dtype=bool)
        return (np.concatenate(points, axis=1), np.concatenate(covs, axis=1),
                np.concatenate(found, axis=1) & np.isfinite(np.concatenate(covs, axis=1)).all(axis=(2, 3)))

    def _pinned_boxes(self, peaks, cov, logf, tmax, ridges):
        """Initial boxes [t, θ, half-widths] in x = h_1 = √t (cos θ, sin θ), t ∈ [0, tmax],
        θ ∈ [0, π): PINNED["grid"] = (n_r, n_θ) intervals uniform in √t and θ, the θ cuts
        graded towards the softmax cliffs θ = 0, π/4, π/2 (where one constraint on h_2 holds
        while the other saturates: thin ridges of small mass a coarse box would not see) down
        to ≈ 1/(β t), the cliffs' width at the outer end of each √t interval; every box
        that meets a peak's window (its centre ± PINNED["window"] Laplace sd in t and θ; peaks
        within half an sd of a higher one share its window, ``_packed``) cut along the window's
        edges, its part inside the window into cells of about one sd (``_split_about``), so that
        the cubature sees every peak however narrow, and its tails; and the box holding each
        point of ``ridges`` (``_pinned_ridges``) outside the highest peak's window bisected down
        to the point's sd (``_bisect_about``).  All samples at once (``owner``: each box's
        sample).  Returns the rows, sample by sample, and each sample's start offset."""
        n, base = len(tmax), _cliff_grid(*self.PINNED["grid"], self.model.beta * tmax.max())
        owner = np.repeat(np.arange(n), len(base))
        boxes = np.tile(base, (n, 1)) * np.stack([tmax, np.ones(n), tmax, np.ones(n)], axis=1)[owner]
        centres, sds = _polar_sd(peaks, cov)
        for centre, sd in _packed(centres, sds, np.isfinite(logf), tmax, heights=logf):
            boxes, owner = _split_about(boxes, owner, centre, sd, self.PINNED["window"], self.PINNED["cells"])
        top = np.argmax(logf, axis=1)[:, None, None]        # ridge points in the highest peak's window: its cells
        reach = self.PINNED["window"] * np.take_along_axis(sds, top, axis=1)
        ridge_centres, ridge_sds = _polar_sd(ridges[0], ridges[1])
        outside = ~np.all(np.abs(ridge_centres - np.take_along_axis(centres, top, axis=1)) <= reach, axis=2)
        for centre, sd in _packed(ridge_centres, ridge_sds, ridges[2] & outside, tmax):
            boxes, owner = _bisect_about(boxes, owner, centre, sd)
        order = np.argsort(owner, kind="stable")
        return (np.ascontiguousarray(boxes[order]),
                np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=n))]).astype(np.int64))

    def _pinned(self, y, omega, V, Vinv, logdetV, tol, max_regions=None):
        """Adaptive Genz–Malik cubature over h_1 in coordinates (t = |h_1|², θ), where the prior
        is smooth (dh_1 = ½ dt dθ) and the softmax cliffs are lines θ = const
        (``_quadrature.integrate_polar_adaptive``), from boxes refined about every peak
        (``_pinned_peaks``, ``_pinned_boxes``), to ``tol`` (a number or one per sample; from
        ``_polar``, its escalation's target: ``escalation["refine"]`` × ``tol``, else × ``escalate``)
        in κ Σ|I7 - I5| / mass of the moments whitened by V's Cholesky factor, κ (``_amp``) from
        the running sums: that bounds the metric of
        (g_out, dg_out), and is the error estimate (without κ, on 48 state-evolution draws at
        q = diag(0, 0.999) the whitened estimate 1e-5 came with errors up to 7.0e-5, κ up to 249)."""
        n = len(omega)
        u = np.ascontiguousarray(self._u_model.reparametrise(y).u)
        const0 = -(2 * np.log(2 * np.pi) + logdetV)
        peaks, cov, logf, signs = self._pinned_peaks(u, omega, V, Vinv, const0)
        ridges = self._pinned_ridges(u, omega, Vinv, const0, peaks, logf, signs)
        tmax = (np.linalg.norm(omega[:, 0], axis=1) + self.PINNED["reach"] * np.sqrt(V[:, 0, 0])) ** 2
        boxes, start = self._pinned_boxes(peaks, cov, logf, tmax, ridges)
        found = np.isfinite(logf).any(axis=1)
        shift = np.where(found, logf.max(axis=1), const0)
        best = np.argmax(logf, axis=1)              # moments about Z at the highest peak
        ref = np.where(found[:, None], self._point(u, peaks[np.arange(n), best], signs[np.arange(n), best]),
                       omega.reshape(n, 4))
        return self._polar_adaptive(u, omega, V, Vinv, const0, ref, shift, boxes, start, tol,
                                    max_regions or self.PINNED["max_regions"], metric=True)

    def _polar_adaptive(self, u, omega, V, Vinv, const0, ref, shift, boxes, start, tol, max_regions,
                        capsule1=None, metric=False):
        """``_quadrature.integrate_polar_adaptive`` from the initial ``boxes`` (rows
        start[i]:start[i+1] per sample) to ``tol`` (a number or one per sample), moments about
        ``ref`` whitened by V's Cholesky factor (``metric``: times κ, see ``_pinned``).  Returns
        (log_z, E[Z], Cov[Z], the estimate)."""
        n, RT = len(omega), V.shape[1] * self.T
        log_z, mean, second = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        used, achieved = np.empty(n, dtype=np.int32), np.empty(n)
        _quadrature.integrate_polar_adaptive(self._node_kernel.capsule("columns"), self.model.params, u,
                                             np.ascontiguousarray(omega.reshape(n, RT)), np.ascontiguousarray(ref),
                                             Vinv, const0, np.ascontiguousarray(shift, dtype=float), boxes, start,
                                             _whitening(V, self.T), np.broadcast_to(np.asarray(tol, float), n).copy(),
                                             max_regions, log_z, mean, second, used, achieved, self.threads,
                                             capsule1=capsule1, V=np.ascontiguousarray(V) if metric else None,
                                             amp=_amp(V) if metric else None)
        return (*_about(ref, log_z, mean, second), achieved)

    # -- L = 3, T = 2 with ``tol``: four-dimensional adaptive cubature ------------------------
    # floor: below it the polar rule's stalled estimate beats what the adaptive rule reaches with
    # max_regions boxes (broad draws, q = 0, tol = 1e-7: polar 8.3e-7 … 1.2e-6, the adaptive rule
    # 3.4e-6 … 3.7e-6 after 25 s), so only samples above max(tol, floor) take it.
    PINNED3 = dict(grid=(6, 8), grade=12, reach=8.0, max_regions=500000, floor=1e-5)

    def _pinned3(self, y, omega, V, Vinv, logdetV, ref, shift):
        """Adaptive Genz–Malik cubature in (t_1, θ_1, t_2, θ_2): h_1 = √t_1 (cos θ_1, sin θ_1),
        u_2 = Φ⁽¹⁾h_2 = √t_2 (cos θ_2, sin θ_2), so that both layers' softmax cliffs are planes
        θ_ℓ = const (``_quadrature.integrate_polar_adaptive``); from the product of each layer's
        ``_cliff_grid`` (PINNED3["grid"]) over t_1 ≤ (|ω_1| + reach √V₁₁)², t_2 ≤ ((c + √2)(|ω_2|
        + reach √V₂₂))² (‖Φ⁽¹⁾‖ ≤ c + √2), to ``tol`` in Σ|I7 - I5| / mass of the moments
        whitened by V's Cholesky factor (that ratio is the error estimate; without κ: with it, on
        16 draws at q = diag(0, 0, 0.99), tol = 1e-3 took 2.9 s per sample instead of 1.0 s, at
        the same errors on 8 of them against tol = 1e-5, max 1.9e-4 / 2.2e-4, which the whitened
        estimate already bounds).  With the last layer
        pinned the posterior is a thin sheet in (h_1, h_2) that rings do not resolve; this rule
        refines about it.  ``ref``, ``shift``: the polar rule's mean and log Z (moments about
        ref, sums relative to e^shift)."""
        n, c, reach = len(omega), self.model.skip, self.PINNED3["reach"]
        u = np.ascontiguousarray(self._u_model.reparametrise(y).u)
        tmax1 = (np.linalg.norm(omega[:, 0], axis=1) + reach * np.sqrt(V[:, 0, 0])) ** 2
        tmax2 = ((c + np.sqrt(2)) * (np.linalg.norm(omega[:, 1], axis=1) + reach * np.sqrt(V[:, 1, 1]))) ** 2
        rows, start = [], [0]
        for i in range(n):
            b1, b2 = (_cliff_grid(*self.PINNED3["grid"], self.model.beta * t, self.PINNED3["grade"]) * [t, 1.0, t, 1.0]
                      for t in (tmax1[i], tmax2[i]))
            i1, i2 = (a.ravel() for a in np.meshgrid(np.arange(len(b1)), np.arange(len(b2)), indexing="ij"))
            rows.append(np.concatenate([b1[i1, :2], b2[i2, :2], b1[i1, 2:], b2[i2, 2:]], axis=1))
            start.append(start[-1] + len(rows[-1]))
        return self._polar_adaptive(u, omega, V, Vinv, -(3 * np.log(2 * np.pi) + logdetV), ref, shift,
                                    np.ascontiguousarray(np.concatenate(rows)), np.asarray(start, dtype=np.int64),
                                    self.tol, self.PINNED3["max_regions"], capsule1=self._phi1_kernel.capsule("columns"))

    def representable(self, y) -> np.ndarray:
        """(n,) mask: softmax outputs whose pre-image ±u_L float64 determines (not an entry
        that underflowed to 0, nor u₁ ≈ u₂ lost to rounding: ``has_preimage``)."""
        y = np.asarray(y, dtype=np.float64)
        return super().representable(y) & self._u_model.has_preimage(y)

    def _check_y(self, y, n):
        y, _ = validate.batch("y", y, (self.T, self.T))
        if len(y) != n:
            raise ValueError(f"y and omega must have the same number of samples, got {len(y)} and {n}")
        return y

    def _prepare(self, y, omega, V):
        u = self._u_model.reparametrise(y).u               # validates y, rejects inconsistent y
        if self.model.layers == 1:
            return u, None, None
        return self._prepare_starts(u, omega)

    def _prepare_starts(self, u, omega):
        """Gauss–Newton starts: ω_{<L} with every earlier layer reflected or not, for each sign
        of u_L."""
        L, T = self.model.layers, self.T
        patterns = np.array(list(product((1.0, -1.0), repeat=L)))       # (sign of u_L, reflections)
        x0 = omega[:, None, :L - 1, :] * patterns[None, :, 1:, None]
        signs = np.broadcast_to(patterns[None, :, 0], (len(u), len(patterns)))
        return u, np.ascontiguousarray(x0.reshape(len(u), len(patterns), (L - 1) * T)), signs

    def _prior(self, omega, V):
        """The prior of x = h_{<L}: N(ω_{<L}, V_{<L,<L} ⊗ I_T)."""
        L, T = self.model.layers, self.T
        return omega[:, :L - 1].reshape(len(V), -1), _per_token(np.linalg.inv(V[:, :L - 1, :L - 1]), T)

    def _points(self, u, omega, Vinv, logdetV):
        """L = 1: the posterior is the two points ±u_L."""
        n, T = u.shape
        Z = np.stack([u, -u], axis=1)                                     # (n, 2, T)
        r = Z - omega[:, None, 0, :]
        logw = -0.5 * Vinv[:, 0, 0, None] * (r ** 2).sum(axis=2) - 0.5 * T * (np.log(2 * np.pi) + logdetV[:, None])
        top = logw.max(axis=1)
        w = np.exp(logw - top[:, None])
        log_z = top + np.log(w.sum(axis=1))
        w /= w.sum(axis=1, keepdims=True)
        mean = np.einsum("nk,nkt->nt", w, Z)
        dev = Z - mean[:, None, :]
        cov = np.einsum("nk,nks,nkt->nst", w, dev, dev)
        return log_z, mean, cov

    def _point(self, u, x, sign):
        n, T = u.shape
        out = self._node_kernel(np.concatenate([u, x], axis=1), self.model.params)
        return np.concatenate([x, sign[:, None] * out[:, :T]], axis=1)
