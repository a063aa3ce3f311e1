"""Polar rules for T = 2 deep attention, and the spherical rule for T = 3 with two layers (the
channels' shared-node rules; see smi_core.channels).

The softmax of a layer switches across the lines a = 0, b = 0 and a = b of its index (a, b), on
a scale ≈ 1/(β r²) at radius r: all meet at the origin, so in polar coordinates about it the
cliffs only make the angular integrand vary fast, and a periodic trapezoid rule in θ times
Gauss–Legendre in r converges geometrically.  Each integrated layer gets such a rule and the
integral takes their product (``_polar_plan``).  The nodes depend on a sample only through V
and the |ω_ℓ|, so samples with the same V and close |ω_ℓ| share them, and every node's
sample-independent data (Φ⁻¹, log|det Φ|, …) is computed once for the whole group; each sample
runs only over the nodes within reach of its own prior (radii, and with two layers the arcs
about ±ω_ℓ: at q → 1 the prior concentrates on a few of a ring's angles).

``PolarRule`` is a mixin of the channels: a channel names the layers it integrates
(``_polar_layers``), the node data (``_polar_fill``) and what each sample contributes
(``_polar_input``); ``_quadrature.integrate_polar`` sums the 2^L reflected terms per node.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import _quadrature
from .quadrature import gauss_legendre


class Rings(NamedTuple):
    """One layer's polar rule for every group (``PolarRule._polar_rings``): the nodes ``x``
    (M, 2) and ``log_w``, ring after ring (groups in order, radii increasing); per group the
    ring radii, their angle counts and d(r)²/V_ℓℓ to the group's range of |ω_ℓ| (G × rings);
    per sample the |ω_ℓ| and V_ℓℓ the rings were built for; rings from the origin or not; for
    a layer by node (``_by_node``, each node a ring of its own) the nodes (G × rings × 2)."""
    x: np.ndarray
    log_w: np.ndarray
    radius: np.ndarray
    count: np.ndarray
    far: np.ndarray
    mu: np.ndarray
    var: np.ndarray
    origin: bool
    node: np.ndarray | None = None


class Plan(NamedTuple):
    """A polar rule for a chunk of groups (``PolarRule._polar_plan``): the layers' rules, the
    block shape (groups, rings per layer...), each block's node count as set up (``size``: its
    whole rings, 0 for blocks no sample runs over) and the nodes kept of them (``used``, a mask
    over the set-up nodes, None: all), each block's offset among the kept nodes (``bound``), and
    the samples' segments: sample, kept nodes seg_start:seg_stop (sorted by sample)."""
    layers: list
    shape: tuple
    size: np.ndarray
    used: np.ndarray | None
    bound: np.ndarray
    sample: np.ndarray
    seg_start: np.ndarray
    seg_stop: np.ndarray


class PolarRule:
    """Shared-node polar rules (mixin).  The channel provides ``model``, ``tol``,
    ``error_estimate``, ``threads``, ``_spread`` and: ``_polar_applies`` (whether the model has
    a polar rule at all), ``_ring_layers`` (how many layers have a ring rule: their |ω_ℓ| set
    the groups and their conditional prior sd chooses the rule), ``_polar_layers(group, mu, V, scale)`` (the rings
    of those layers, ``_polar_rings`` results), ``_polar_fill(nodes, m)`` (the node data: rows
    m + 1… of the nodes' columns from their coordinates, rows 0…m-1; ``_polar_data_rows`` of
    them), ``_polar_input(y)`` (each sample's row for integrate_polar: u_L or y) and
    ``_polar_scale()`` (the ring count multiplier at the chosen ``nodes``)."""

    POLAR = dict(radial=32, density=0.0, c0=6.0, c1=3.0, c2=3.0, k0=12.0, cap=80, reach=7.0, fade=20.0,
                 bin=0.25, pr=0.5, blend=0.0, capk=0.0)
    POLAR_BY_LAYERS = {}                # per depth L: changes to POLAR (``_polar_params``)
    POLAR_MIN_SD = 0.2
    _polar_stall = None                 # see ``_polar``
    POLAR_CHUNK = {2: 256, 4: 8}        # groups per pass by dimension (bounded memory: 4-D rules
                                        # have ≈ 10⁴–10⁵ nodes each)
    POLAR_NODE_CHUNK = 1 << 15          # nodes set up at a time (the temporaries stay in cache)
    POLAR_PIECE = 1 << 16               # nodes held at a time (≈ 7–9 MB: each sample's reads stay in
                                        # cache; 1 << 21 nodes, ≈ 200 MB of fresh pages per piece, took
                                        # three layers at q = 0.975·I 3.5 → 2.7 ms per sample, noisy two
                                        # layers Δ = 0.1, q = 0.5 9.2 → 5.8 ms, same moments to 1e-13)
    POLAR_DELTA = 0.0                   # Δ passed to integrate_polar (route 1: the output noise)

    def _polar_weight(self, omega, V):
        """The weight of the polar rule per sample: 1 where the prior of every ring layer ℓ
        conditioned on the other layers is broad, s = min_ℓ 1/√(V⁻¹)_ℓℓ ≥ (1 + blend)
        s_min; 0 (the Laplace-centred Gauss–Hermite rule: the softmax cliffs are then smooth on
        the posterior's scale) below s_min (``_polar_threshold``: POLAR_MIN_SD and the ring
        parameters' blend unless the channel says otherwise); linear in s between, where the
        channel returns the mixture of both rules' posteriors (``channels._blend``), so that the
        moments stay continuous in V where the two rules disagree (``blend`` of the ring
        parameters; 0: a hard switch)."""
        if not self._polar_applies:
            return np.zeros(len(omega))
        prec = np.diagonal(np.linalg.inv(V), axis1=1, axis2=2)
        s_min, blend = self._polar_threshold(prec)
        above = 1.0 / (s_min * np.sqrt(self._ring_prec(prec))) - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(blend > 0, np.clip(above / blend, 0.0, 1.0), (above >= 0).astype(float))

    def _ring_prec(self, prec):
        """Per sample, the largest conditional precision (V⁻¹)_ℓℓ of the ring layers (the
        narrowest one's sd is 1/√ of it), from each sample's diagonal of V⁻¹ (n, R)."""
        return prec[:, :self._ring_layers].max(axis=1)

    def _polar_threshold(self, prec):
        """(s_min, blend) per sample, given each sample's diagonal of V⁻¹ (n, R): POLAR_MIN_SD
        and the ring parameters' ``blend``."""
        return self.POLAR_MIN_SD, self._polar_params()["blend"]

    def _polar_params(self):
        """The ring parameters: POLAR with the channel's changes for the model's depth."""
        return self.POLAR | self.POLAR_BY_LAYERS.get(self.model.layers, {})

    def _polar_target(self):
        """Error tolerance of the escalation (None: no escalation)."""
        return self.tol

    def _polar_escalation(self, Vinv, error):
        """The escalation of ``_polar``: the target (None, a number or one per sample) and the
        number of rounds, given each sample's V⁻¹ and estimate."""
        return self._polar_target(), 3

    def _polar_groups(self, omega, V):
        """Samples that share the polar nodes: equal V and, for every ring layer ℓ, |ω_ℓ| in the
        same cell of width bin·√V_ℓℓ.  Returns the group of each sample (0 … G-1) and the |ω_ℓ|
        (n, _ring_layers)."""
        n, count = len(omega), self._ring_layers
        mu = np.linalg.norm(omega[:, :count], axis=2)
        cell = np.floor(mu / (self._polar_params()["bin"] * np.sqrt(np.diagonal(V, axis1=1, axis2=2)[:, :count])))
        if (V == V[0]).all():                   # one V (state evolution, GAMP): by cells only
            key = np.ravel_multi_index(cell.T.astype(np.int64), tuple(cell.max(axis=0).astype(np.int64) + 1))
            return np.unique(key, return_inverse=True)[1].ravel(), mu     # (1-D: 10× faster than rows)
        keys = np.concatenate([V.reshape(n, -1), cell], axis=1)
        return np.unique(keys, axis=0, return_inverse=True)[1].ravel(), mu

    def _polar_rings(self, group, mu, var, scale, amp, sharp=1.0, origin=False):
        """One layer's polar rule for every group: Gauss–Legendre radii (max(``radial``,
        ``density`` · the widest group's range / √V_ℓℓ)·scale·sharp^pr nodes) on
        [min |ω_ℓ| - reach·√V_ℓℓ, max |ω_ℓ| + reach·√V_ℓℓ] over the group (from 0 with
        ``origin``; the prior of h_ℓ below e^{-reach²/2} is left out); N(r) = min(cap·scale·sharp·
        max(1, k/k0)^{capk/2}, ⌈scale (c0 + (c1 amp sharp β r² + c2 k/√(1 + k/k0)) · max(0.1,
        1 - d(r)²/(2 fade V_ℓℓ)))⌉)
        angles, midpoint rule on [0, π) (T = 3: a shell of ``_sphere`` with N angles per half
        circle, radial measure r² dr): c1 for the cliffs (amp = (1 + c)^{2(ℓ-1)} bounds how much
        Φ⁽ℓ⁻¹⁾ stretches h_ℓ into the logits; sharp > 1 where a likelihood narrows them); k = κr
        with κ = |ω_ℓ|/V_ℓℓ for the largest |ω_ℓ| of the group within reach of r (≤ r +
        reach·√V_ℓℓ), the concentration of the prior on the ring, ∝ e^{k cos(θ - θ₀)}
        (a trapezoid rule needs ∝ k points for small k, ∝ √k for large); d(r) the distance of r
        to the group's |ω_ℓ| (fewer angles where the prior is small: the trapezoid error is
        relative to the ring's mass).  ``mu``, ``var``: each sample's |ω_ℓ| and V_ℓℓ.  ``scale``: one
        number, or (radial, angular) multipliers apart (``_polar_round_scales``)."""
        p = self._polar_params()
        radial_scale, scale = np.broadcast_to(scale, 2)
        G = group.max() + 1
        lo, hi = np.full(G, np.inf), np.full(G, -np.inf)
        np.minimum.at(lo, group, mu)
        np.maximum.at(hi, group, mu)
        if origin:
            lo[:] = 0.0
        v = np.empty(G)
        v[group] = var
        sd = np.sqrt(v)
        a, b = np.maximum(0.0, lo - p["reach"] * sd), hi + p["reach"] * sd
        radial = max(p["radial"], p["density"] * ((b - a) / sd).max())
        t, wt = gauss_legendre(max(4, int(round(radial * radial_scale * sharp ** p["pr"]))))
        r = a[:, None] + 0.5 * (b - a)[:, None] * (t + 1.0)
        dist = np.maximum(0.0, np.maximum(lo[:, None] - r, r - hi[:, None]))
        fade = np.maximum(0.1, 1.0 - dist ** 2 / (2 * p["fade"] * v[:, None]))
        kr = np.minimum(hi[:, None], r + p["reach"] * sd[:, None]) / v[:, None] * r  # prior ∝ e^{κr cos(θ - θ₀)}
        count = np.ceil(scale * (p["c0"] + (p["c1"] * amp * sharp * self.model.beta * r ** 2
                                            + p["c2"] * kr / np.sqrt(1 + kr / p["k0"])) * fade))
        cap = p["cap"] * scale * sharp * np.maximum(1.0, np.sqrt(kr / p["k0"])) ** p["capk"]
        count = np.clip(count, 2, np.floor(cap)).astype(np.int64)
        unit, log_u, count = (_circle if self.T == 2 else _sphere)(count)
        ring = np.repeat(np.arange(count.size), count.ravel())
        x = unit * r.ravel()[ring, None]
        log_w = np.log(0.5 * (b - a)[:, None] * wt * r ** (self.T - 1)).ravel()[ring] + log_u
        return Rings(x, log_w, r, count, dist ** 2 / v[:, None], mu, var, origin)

    def _polar_plan(self, omega, V, scale):
        """The polar rule of every group (``_polar_groups``): the product of the ring layers'
        rules (``_polar_layers``) by blocks (one per tuple of rings, the last layer's ring
        fastest; with two layers the first layer's nodes count as rings of one node each,
        ``_by_node``), and each sample's segments of it.  Like each layer's radial range, the
        product leaves out the nodes where the prior is below e^{-reach²/2}: a group keeps the
        blocks with Σ_ℓ d_ℓ(r_ℓ)²/V_ℓℓ ≤ reach² (d_ℓ the distance to the group's range of |ω_ℓ|:
        a ball, not a box), and each sample runs over those within its own ball (d_ℓ the
        distance to its |ω_ℓ|, or to [0, |ω_ℓ|] for rings from the origin), which for each
        tuple of the earlier layers' rings is a contiguous range of the last layer's.  With two
        layers a sample also leaves out the nodes away from ±ω_ℓ (``_arc``, ``_window``: the
        prior's concentration on a ring): the first layer's nodes with |x_1 ∓ ω_1|²/V_11 >
        reach², and, for a last layer not from the origin, the angles of each ring with d_2² +
        its arc > reach² (one or two node ranges per ring, ``_arc_plan``).  Blocks no sample
        runs over are not set up, and of those set up only the nodes in some sample's ranges
        go through the kernel.  Returns a ``Plan``."""
        group, mu = self._polar_groups(omega, V)
        G = group.max() + 1
        layers = self._polar_layers(group, mu, V, scale)
        if len(layers) == 2:
            layers[0] = _by_node(layers[0])
        reach = self._polar_params()["reach"]
        reach2 = reach ** 2
        shape = tuple(rl.count.shape[1] for rl in layers)
        size, far = np.ones((G,) + (1,) * len(layers), dtype=np.int64), 0.0
        for l, rl in enumerate(layers):         # block sizes and distances, by broadcasting
            axis = (slice(None),) + tuple(slice(None) if j == l else None for j in range(len(layers)))
            size = size * rl.count[axis]
            far = far + rl.far[axis]
        size = np.where(far <= reach2, size, 0).reshape(-1)              # (G · Π shape) blocks
        n = len(group)
        if len(layers) == 2:    # the pairs (sample, node of the first layer) within the sample's ball
            lo, hi = _ring_range(layers[0], group, np.full(n, reach), np.arange(n))
            sample = np.repeat(np.arange(n), hi - lo)
            col = lo[sample] + _rank(hi - lo)
            rest = reach2 - _far(layers[0], layers[0].radius[group[sample], col], sample)
            near = rest >= _arc(layers[0], group[sample], col, sample, omega[sample, 0])
        else:
            sample, col, rest, near = np.arange(n), np.zeros(n, dtype=np.int64), np.full(n, reach2), True
        first, last = _ring_range(layers[-1], group, np.sqrt(np.maximum(rest, 0.0)), sample)
        has = near & (rest >= 0) & (last > first)
        row = (group[sample] * (shape[0] if len(layers) == 2 else 1) + col) * shape[-1]   # (group, col)'s first block
        seg_b0, seg_b1, sample = (row + first)[has], (row + last)[has], sample[has]  # the segments of blocks
        cover = np.bincount(seg_b0, minlength=size.size + 1) - np.bincount(seg_b1, minlength=size.size + 1)
        size = np.where(np.cumsum(cover[:-1]) > 0, size, 0)     # only the blocks some sample runs over
        start = np.concatenate([[0], np.cumsum(size)])
        if len(layers) == 2 and not layers[-1].origin:          # only the samples' arcs
            far = _far(layers[-1], layers[-1].radius[group], np.arange(n)[:, None])
            window = _window(layers[-1], group, omega[:, 1], reach2 - far)
            return _arc_plan(layers, (G,) + shape, size, start, sample, seg_b0, seg_b1, first[has], window)
        return Plan(layers, (G,) + shape, size, None, start, sample, start[seg_b0], start[seg_b1])

    def _polar_parts(self, plan):
        """The plan's non-empty blocks split into pieces of about POLAR_PIECE kept nodes (bounded
        memory, and each sample's reads stay in cache; at least one block each): the blocks of
        each piece, and the pieces' edges in the kept nodes' numbering (pieces + 1)."""
        bound = plan.bound
        blocks = np.flatnonzero(np.diff(bound))
        if not blocks.size:
            return [], np.zeros(1, dtype=np.int64)
        parts = np.split(blocks, np.flatnonzero(np.diff(bound[blocks] // self.POLAR_PIECE)) + 1)
        return parts, np.array([bound[part[0]] for part in parts] + [bound[blocks[-1] + 1]])

    def _polar_pieces(self, plan, parts):
        """The kept nodes of each piece (``_polar_parts``), one node per column [x, log weight,
        node data], set up in cache-sized parts of POLAR_NODE_CHUNK (``_quadrature.polar_product``,
        then ``_polar_fill``).  Yields (first node, nodes)."""
        bound = plan.bound
        set_up = np.concatenate([[0], np.cumsum(plan.size)])
        layers = plan.layers
        m = layers[0].x.shape[1] * len(layers)
        rings = [(rl.x, rl.log_w, np.cumsum(rl.count.ravel()) - rl.count.ravel(), rl.count.ravel())
                 for rl in (layers[0], layers[-1])]          # one layer: the second is ignored
        for part in parts:
            n0, n1 = bound[part[0]], bound[part[-1] + 1]
            nodes = np.empty((m + 1 + self._polar_data_rows, n1 - n0))
            chunk = set_up[part] // self.POLAR_NODE_CHUNK
            for sub in np.split(part, np.flatnonzero(np.diff(chunk)) + 1):
                keep = (np.empty(0, dtype=np.uint8) if plan.used is None
                        else plan.used[set_up[sub[0]]:set_up[sub[-1] + 1]].view(np.uint8))
                _quadrature.polar_product(sub, set_up[sub] - set_up[sub[0]], bound[sub] - n0, plan.shape[1],
                                          plan.shape[2] if len(layers) == 2 else 0, *rings[0], *rings[1], keep,
                                          nodes, self.threads)
                self._polar_fill(nodes[:, bound[sub[0]] - n0:bound[sub[-1] + 1] - n0], m)
            yield n0, nodes

    def _polar_round_scales(self, scale, rounds):
        """The escalation's rounds: the counts × 1.5 per round in every direction."""
        return _growing(scale, 1.5, rounds)

    def _polar_run(self, u, omega, V, Vinv, logdetV, scale):
        """One pass of the polar rule, POLAR_CHUNK groups of samples at a time (bounded memory
        when few samples share a V) and each group's nodes by pieces (``_polar_pieces``): every
        sample's segments cut at the pieces' edges (``_by_piece``), the pieces' moments merged by
        mass."""
        n, RT = len(omega), self.R * self.T
        log_z, mean, second = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
        group = self._polar_groups(omega, V)[0]
        chunk = self.POLAR_CHUNK[2 * self._ring_layers]
        for first in range(0, group.max() + 1, chunk):
            idx = np.flatnonzero((group >= first) & (group < first + chunk))
            plan = self._polar_plan(omega[idx], V[idx], scale)
            parts, edges = self._polar_parts(plan)
            who, start, stop, ptr = _by_piece(plan, edges)
            for p, (n0, nodes) in enumerate(self._polar_pieces(plan, parts)):
                w = who[ptr[p]:ptr[p + 1]]
                if not w.size:
                    continue
                head = np.flatnonzero(np.concatenate([[True], w[1:] != w[:-1]]))
                seg_ptr = np.append(head, w.size)
                out = np.empty(head.size), np.empty((head.size, RT)), np.empty((head.size, RT, RT))
                s = idx[w[head]]
                _quadrature.integrate_polar(u[s], omega[s].reshape(-1, RT), Vinv[s], logdetV[s], seg_ptr,
                                            start[ptr[p]:ptr[p + 1]] - n0, stop[ptr[p]:ptr[p + 1]] - n0, nodes,
                                            *out, self.threads, self.POLAR_DELTA)
                _merge((log_z, mean, second), s, out)
        return log_z, mean, second

    def _polar_shortcut(self, u, omega, V, Vinv, logdetV, fine, error, target):
        """Before the finer rounds: another rule for some of the samples above ``target``, its
        result (``fine``) and estimate (``error``) written in place where that is below it, and
        returned for the others as (samples, (log Z, E[Z], Cov[Z], estimate)) for the caller to
        keep where it beats the rounds (none here: None; two layers pinned: ``ReparamChannel``)."""

    def _polar(self, y, omega, V, Vinv, logdetV):
        """``_polar_refined`` without the target: (log_z, E[Z], Cov[Z], error)."""
        return self._polar_refined(y, omega, V, Vinv, logdetV)[:4]

    def _polar_refined(self, y, omega, V, Vinv, logdetV):
        """The polar rule at ``nodes`` (scaled by ``_polar_scale``).  Error: the difference to
        the rule with counts / 1.5; with a target (``tol``; ``_polar_escalation``), counts grow by
        1.5 (the previous rule as the coarse one) up to three times (or the rounds it gives) while
        the estimate is above it (and, where
        ``_polar_stall`` is set, fell in the last round below that fraction of its previous value).  Returns
        (log_z, E[Z], Cov[Z], error, the target: None, a number or one per sample, and what
        ``_polar_shortcut`` left to the caller)."""
        n, RT = len(omega), self.R * self.T
        u = np.ascontiguousarray(self._polar_input(y))
        ref = np.ascontiguousarray(omega.reshape(n, RT))
        scale = self._polar_scale()
        fine = self._polar_run(u, omega, V, Vinv, logdetV, scale)
        error = np.full(n, np.nan)
        if self.error_estimate:
            coarse = self._polar_run(u, omega, V, Vinv, logdetV, scale / 1.5)
            error = self._spread([fine, coarse], omega, V, Vinv, ref)
        target, rounds = self._polar_escalation(Vinv, error)
        spare = None
        if target is not None:      # _polar_stall: samples not converging are left to the caller
            spare = self._polar_shortcut(u, omega, V, Vinv, logdetV, fine, error, target)
            scales = self._polar_round_scales(scale, rounds)
            refine(fine, error, target, rounds, lambda i, k: self._polar_run(
                u[i], omega[i], V[i], Vinv[i], logdetV[i], scales[k]),
                lambda i, runs: self._spread(runs, omega[i], V[i], Vinv[i], ref[i]), self._polar_stall)
        return (*_about(ref, *fine), error, target, spare)


def refine(fine, error, target, rounds, finer, spread, stall=None):
    """Up to ``rounds`` rounds of finer rules, in place: the samples i whose ``error`` is not
    below ``target`` (a number or one per sample) get round k's rule ``finer(i, k)`` (their
    (log Z, E[Z − ω], E[(Z − ω)(Z − ω)ᵀ])), which replaces theirs in ``fine``, and the error
    ``spread(i, [finer, previous])``.  With ``stall``, a sample whose error fell by less than
    that factor in a round takes no more rounds."""
    going = np.ones(len(error), dtype=bool)
    for k in range(rounds):
        redo = np.flatnonzero(~(error <= target) & going)
        if not redo.size:
            break
        finer_k = finer(redo, k)
        before = error[redo]
        error[redo] = spread(redo, [finer_k, tuple(a[redo] for a in fine)])
        if stall is not None:
            going[redo] = ~(error[redo] > stall * before)
        for a, b in zip(fine, finer_k):
            a[redo] = b


def _growing(x, factor, rounds):
    """x·factor, (x·factor)·factor, … (``rounds`` values, each from the previous one)."""
    out = []
    for _ in range(rounds):
        x = x * factor
        out.append(x)
    return out


def _rank(sizes):
    """For consecutive runs of the given sizes, each element's position within its run."""
    return np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def _half_circles(sizes):
    """The midpoint rule θ_k = (k + ½)π/N on [0, π) of consecutive circles of N = sizes points:
    the angles and each node's log weight log(π/N)."""
    N = np.repeat(sizes, sizes)
    return (_rank(sizes) + 0.5) * np.pi / N, np.log(np.pi / N)


def _circle(count):
    """The half circle of every ring (count: angles per ring, ``_circle_rule``): the unit
    vectors (M, 2) and log weights, ring after ring, and the node counts (= count)."""
    return _shells(count, _circle_rule)


def _sphere(count):
    """T = 3: the half sphere of every shell (count: angles per half circle, ``_sphere_rule``):
    the unit vectors (M, 3), log weights and the node counts per shell (count's shape)."""
    return _shells(count, _sphere_rule)


def _shells(count, rule):
    """Every ring's or shell's rule ``rule(N)`` (N = count, one rule per distinct N, cached),
    one after the other: the unit vectors, log weights and node counts (count's shape)."""
    values, inverse = np.unique(count.ravel(), return_inverse=True)
    rules = [rule(int(N)) for N in values]
    sizes = np.array([len(u) for u, _ in rules])[inverse]
    unit = np.concatenate([rules[i][0] for i in inverse])
    log_w = np.concatenate([rules[i][1] for i in inverse])
    return unit, log_w, sizes.reshape(count.shape)


@lru_cache(maxsize=None)
def _circle_rule(N):
    """The midpoint rule θ_k = (k + ½)π/N on [0, π) (``_half_circles``): unit vectors, log weights."""
    theta, log_w = _half_circles(np.array([N]))
    return np.stack([np.cos(theta), np.sin(theta)], axis=1), log_w


@lru_cache(maxsize=None)
def _sphere_rule(N):
    """The half sphere with N angles per half circle: z = cos φ at N Gauss–Legendre nodes and,
    on the circle at z_j, the midpoint rule θ_k = (k + ½)π/N_j on [0, π) with N_j = max(2, ⌈N
    √(1 - z_j²)⌉) (the same spacing on every circle); node (z_j, θ_k) stands for its antipode
    (-z_j, θ_k + π) too (the integrand is folded over h_1 → -h_1), so dΩ = dz dθ is integrated
    over the whole sphere; log weights log(w_j π/N_j)."""
    z, wz = np.polynomial.legendre.leggauss(N)
    rho = np.sqrt(1.0 - z * z)
    Nj = np.maximum(2, np.ceil(N * rho - 1e-9)).astype(np.int64)
    j = np.repeat(np.arange(N), Nj)
    theta, log_w = _half_circles(Nj)
    unit = np.stack([rho[j] * np.cos(theta), rho[j] * np.sin(theta), z[j]], axis=1)
    return unit, np.log(wz[j]) + log_w


def _about(ref, log_z, mean, second):
    """(log Z, E[Z], Cov[Z]) from a pass's sums about ``ref``: mean = E[Z − ref], second =
    E[(Z − ref)(Z − ref)ᵀ]."""
    return log_z, ref + mean, second - mean[:, :, None] * mean[:, None, :]


def _by_piece(plan, edges):
    """The plan's segments cut at the pieces' edges (kept nodes edges[p]:edges[p + 1] make piece
    p): (sample, start, stop) of the cut segments sorted by piece and, within one, by sample,
    and each piece's first cut segment (pieces + 1; ``_quadrature.piece_counts``,
    ``piece_segments``)."""
    ptr = np.zeros(len(edges), dtype=np.int64)
    _quadrature.piece_counts(plan.seg_start, plan.seg_stop, edges, ptr)
    who, start, stop = (np.empty(ptr[-1], dtype=np.int64) for _ in range(3))
    _quadrature.piece_segments(plan.sample, plan.seg_start, plan.seg_stop, edges, ptr, who, start, stop)
    return who, start, stop, ptr


def _merge(total, idx, part):
    """Adds a piece's (log Z, E[Z − ω], E[(Z − ω)(Z − ω)ᵀ]) of samples idx to the running
    ``total`` (the moments of the union of the pieces' nodes, weighted by their masses)."""
    log_z = np.logaddexp(total[0][idx], part[0])
    with np.errstate(invalid="ignore"):
        old, new = np.exp(total[0][idx] - log_z), np.exp(part[0] - log_z)
    old, new = np.nan_to_num(old), np.nan_to_num(new)
    total[0][idx] = log_z
    for t, p in zip(total[1:], part[1:]):
        shape = (-1,) + (1,) * (p.ndim - 1)
        t[idx] = old.reshape(shape) * t[idx] + np.where(new.reshape(shape) > 0, new.reshape(shape) * p, 0.0)


def _by_node(rings):
    """The layer's rule with each node a ring of its own (groups padded to the same count with
    empty rings at radius inf), so that a sample can leave out the nodes of a ring outside its
    ball (its arcs away from ±ω_ℓ)."""
    G = len(rings.count)
    flat = rings.count.ravel()
    ring = np.repeat(np.arange(flat.size), flat)
    per = rings.count.sum(axis=1)
    pos = _rank(per)
    g = ring // rings.count.shape[1]
    radius, far = np.full((G, per.max()), np.inf), np.full((G, per.max()), np.inf)
    count, node = np.zeros((G, per.max()), dtype=np.int64), np.zeros((G, per.max(), 2))
    radius[g, pos], far[g, pos], count[g, pos] = rings.radius.ravel()[ring], rings.far.ravel()[ring], 1
    node[g, pos] = rings.x
    return rings._replace(radius=radius, count=count, far=far, node=node)


def _far(rings, r, sample):
    """d(r)²/V_ℓℓ of radii r, d the distance to the sample's |ω_ℓ| (to [0, |ω_ℓ|] for rings from
    the origin); ``sample`` indexes the rings' samples, broadcast against r."""
    mu = rings.mu[sample]
    lo = np.zeros_like(mu) if rings.origin else mu
    d = np.maximum(0.0, np.maximum(lo - r, r - mu))
    return d ** 2 / rings.var[sample]


def _arc(rings, group, col, sample, omega):
    """|x - ω|²/V_ℓℓ − d(r)²/V_ℓℓ = 2(r|ω| − |x·ω|)/V_ℓℓ of nodes ``col`` of a layer by node
    (``_by_node``) in the groups ``group`` and the samples' ω (folded: min over ±ω), per pair."""
    arc = rings.radius[group, col] * rings.mu[sample] - np.abs((rings.node[group, col] * omega).sum(axis=1))
    return 2 * np.maximum(arc, 0.0) / rings.var[sample]


def _arc_plan(layers, shape, size, start, sample, seg_b0, seg_b1, seg_ring, window):
    """The ``Plan`` of two ring layers where each sample runs over its arcs of the last layer's
    rings (``_window``): its segments of blocks seg_b0:seg_b1 (consecutive rings from seg_ring;
    blocks from ``start`` among the set-up nodes, ``size`` each) become one or two node ranges
    per block (``_quadrature.polar_arcs``), and only the nodes some range covers are kept (a
    block's pairs are all walked by ``polar_product``, but only its kept nodes are written and go
    through the kernel)."""
    used = np.empty(start[-1], dtype=np.uint8)
    pairs = 2 * int((seg_b1 - seg_b0).sum())
    who, lo, hi = (np.empty(pairs, dtype=np.int64) for _ in range(3))
    kept = np.zeros(start[-1] + 1, dtype=np.intc)                  # the kept nodes before each set-up node
    m = _quadrature.polar_arcs(sample, seg_b0, seg_b1, seg_ring, window, start, used, kept, who, lo, hi)
    used, bound = used.view(bool), kept[start].astype(np.int64)
    live = np.diff(bound)                                         # kept nodes per block
    set_up = np.where(live > 0, size, 0)
    return Plan(layers, shape, set_up, used[np.repeat(live > 0, size)], bound, who[:m], lo[:m], hi[:m])


def _window(rings, group, omega, rest):
    """Per sample and ring of its group (n, rings, 5): [count, lo, hi, lo', hi'], the angles
    k ∈ [lo, hi) ∪ [lo', hi') of the ring whose nodes x are within reach of ±ω_ℓ given the rest
    of the reach (``rest`` = reach² − d(r)²/V_ℓℓ): 2(r|ω| − |x·ω|)/V_ℓℓ ≤ rest, i.e. θ within
    δ = arccos(1 − rest V_ℓℓ / (2r|ω|)) of the direction of ω modulo π (the rings' midpoint
    angles θ_k = (k + ½)π/N)."""
    N = rings.count[group]
    r = rings.radius[group]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = 1.0 - np.maximum(rest, 0.0) * rings.var[:, None] / (2 * r * rings.mu[:, None])
    delta = np.where(c > -1.0, np.arccos(np.clip(c, -1.0, 1.0)), np.pi) + 1e-9
    theta = np.arctan2(omega[:, 1], omega[:, 0])[:, None]
    lo = np.ceil((theta - delta) * N / np.pi - 0.5).astype(np.int64)
    size = np.clip(np.floor((theta + delta) * N / np.pi - 0.5).astype(np.int64) + 1 - lo, 0, N)
    size = np.where(rest >= 0, size, 0)
    lo = np.where(size < N, lo % N, 0)
    hi = lo + size
    return np.ascontiguousarray(np.stack([N, lo, np.minimum(hi, N), np.zeros_like(lo), np.maximum(hi - N, 0)],
                                         axis=2))


def _ring_range(rings, group, reach, sample):
    """Per pair (sample[i], reach[i]): the rings of the sample's group with d(r)²/V_ℓℓ ≤
    reach², d the distance to the sample's |ω_ℓ| (to [0, |ω_ℓ|] from the origin): first and last
    + 1 (the radii increase within a group; a layer by node pads them with inf)."""
    sd = np.sqrt(rings.var[sample]) * reach
    mu = rings.mu[sample]
    lo = np.zeros_like(mu) if rings.origin else mu
    span = rings.radius[np.isfinite(rings.radius)].max() + 2.0 * sd.max() + 2.0
    key = (np.minimum(rings.radius, span - 0.5) + span * np.arange(len(rings.radius))[:, None]).ravel()
    base = span * group[sample]
    first = np.searchsorted(key, base + np.clip(lo - sd, -1.0, span - 1.0), side="left")
    last = np.searchsorted(key, base + np.clip(mu + sd, -1.0, span - 1.0), side="right")
    offset = group[sample] * rings.radius.shape[1]
    return first - offset, last - offset
