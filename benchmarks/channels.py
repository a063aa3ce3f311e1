"""Channel moments (log Z_out, g_out and the full Jacobian ∂_ω g_out): microseconds per sample
on one core (best of three, CPU time of this process with threads=1 and one BLAS thread:
OPENBLAS_NUM_THREADS=1 unless set — so a busy shared machine inflates it less than wall time), and the accuracy reached against the independent reference of
tests/channel_reference.py (max abs error over (g_out, dg_out) / max abs entry); for three
layers, and noisy two layers below Δ = 1e-3 (one row for the preimage rule's samples, one for
the chart rule's, with their shares), with --self-reference K, against the same rule at twice the node counts on K draws
(with --self-reference-tol TOL instead against the channel at tol=TOL, for every case: three
layers pinned, where the polar rule at twice its counts does not converge, and two layers
pinned, on more draws than the mpmath reference affords); noisy two layers with
--adaptive-reference K against the noisy route's adaptive cubature in Z alone at tol=1e-8 with
2·10⁵ boxes on K draws (≈ 2 s per draw; independent of its rings and of the conditional rule that
takes the pinned samples, and far more accurate there than the 4-D reference); two layers,
T = 2 (V diagonal), with --nested-reference K against tests/nested_reference.py's nested (d, m)
rule on K draws (numpy, ≈ 0.3 s per draw: independent of smi_core like the mpmath reference, and
fast enough for hundreds of draws); three layers with --pinned, with --theta3-reference K against
tests/theta3_reference.py's nested θ rule at (57, 33) nodes per layer on K draws (≈ 8 s per draw),
on the draws where it is within 1e-5 of its (45, 33) level and its truncated weights (their count
in the first column).

Draws are those of state evolution at overlap q·I: ω = √q ξ, V = (1-q) I, Z = ω + √(1-q) ζ;
with --pinned at q = diag(0, …, 0, q) (the last layer learned, the earlier ones not).
The noisy rows use each Δ of --noise (noisy L = 2: the 4-D reference is ≈ 1e-3 accurate); the
three-layer reference runs at n = 7 (bound ≤ 3e-5 on the draws checked; n = 5 left up to 1e-3),
the two-layer T = 3 one (3-D, float64) at n = 11 (--t3-reference-n: with the last layer
pinned it needs ≈ 20; its T = 3 rows include three spherical rounds, state evolution's setting,
against the channel's six).
Targets (issue 3): two-layer T = 2 route "reparam" ≤ 50 µs per sample at ≤ 1e-6; three-layer
T = 2 ≤ 2 ms per sample at ≤ 1e-4.

    python benchmarks/channels.py [--timing-samples N] [--reference-samples K] [--q Q ...] [--layers L ...]
                                  [--l3-reference-samples K3] [--l3-timing-samples N3] [--pinned]
                                  [--routes reparam noisy] [--tokens T ...] [--noise Δ ...] [--self-reference K]
                                  [--self-reference-tol TOL] [--adaptive-reference K] [--t3-reference-n N]
                                  [--nested-reference K] [--theta3-reference K]
"""
import argparse
import os
import sys
import time
from pathlib import Path

# one core: numpy's BLAS threads (batched inverses) spin on the other one after each call and
# count in the process time (the first setting of a run measured up to 2× the same setting later)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import channel_reference as ref  # noqa: E402
import nested_reference as nested  # noqa: E402
import theta3_reference as theta3  # noqa: E402

from smi_core import DeepAttention  # noqa: E402
from smi_core.channels import DEFAULT_NODES, Channel  # noqa: E402
from smi_core.noisy_channel import NoisyChannel  # noqa: E402

CASES = [  # (route, layers, tokens, noise, reference function, settings)
    ("reparam", 1, 2, None, lambda y, o, V: ref.reparam_l1(y, o, V, 1.0), [{}]),
    ("reparam", 2, 2, None, ref.reparam_l2, [{}, {"escalation": {"theta": False}}, {"error_estimate": False},
                                             {"tol": 1e-6}]),
    ("reparam", 2, 3, None, ref.reparam_l2_t3,
     [{}, {"escalation": {"rounds": 3}}, {"error_estimate": False}, {"tol": 1e-6}]),
    ("reparam", 3, 2, None, lambda y, o, V: ref.reparam_l3(y, o, V, n=7),
     [{}, {"escalation": {"theta": False}}, {"error_estimate": False}, {"tol": 1e-3}, {"tol": 1e-4}]),
    ("noisy", 1, 2, "Δ", lambda y, o, V, d: ref.noisy_l1(y, o, V, noise=d), [{}, {"error_estimate": False}]),
    ("noisy", 2, 2, "Δ", lambda y, o, V, d: ref.noisy_l2(y, o, V, noise=d), [{}, {"error_estimate": False}]),
]


def draws(model, q, n, rng, noise, pinned=False):
    L, T = model.layers, model.tokens
    qv = np.array([0.0] * (L - 1) + [q] if pinned else [q] * L)[:, None]
    omega = np.sqrt(qv) * rng.standard_normal((n, L, T))
    Z = omega + np.sqrt(1 - qv) * rng.standard_normal((n, L, T))
    y = model.forward(Z)
    if noise:
        y = y + np.sqrt(noise) * rng.standard_normal(y.shape)
    keep = (y > 0).all(axis=(1, 2)) if not noise else np.ones(n, bool)
    return y[keep], omega[keep], np.diag(1 - qv[:, 0])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timing-samples", type=int, default=4096,
                   help="a state-evolution batch: samples with the same V share the L = 2 nodes")
    p.add_argument("--reference-samples", type=int, default=6)
    p.add_argument("--l3-reference-samples", type=int, default=3,
                   help="4-D cases (L = 3, noisy L = 2): references take 10 s to 3 min each")
    p.add_argument("--l3-timing-samples", type=int, default=40,
                   help="4-D cases (L = 3, noisy L = 2) take ≈ 5-30 ms per sample")
    p.add_argument("--self-reference", type=int, default=0, metavar="K",
                   help="three layers, and noisy two layers below Δ = 1e-3 (rows for the preimage and the "
                        "chart rule's samples, their shares in the first column): measure the error on K draws against "
                        "the same rule at twice the node counts per dimension (the mpmath reference "
                        "takes minutes per draw)")
    p.add_argument("--self-reference-tol", type=float, default=None, metavar="TOL",
                   help="with --self-reference: the reference is the channel at tol=TOL instead, "
                        "for every case (e.g. two layers pinned on K draws, beyond the few mpmath ones)")
    p.add_argument("--adaptive-reference", type=int, default=0, metavar="K",
                   help="noisy two layers: measure the error on K draws against the route's adaptive "
                        "cubature in Z alone (tol=1e-8, 2e5 boxes; ≈ 2 s per draw)")
    p.add_argument("--nested-reference", type=int, default=0, metavar="K",
                   help="two layers, T = 2: measure the error on K draws against the nested (d, m) rule of "
                        "tests/nested_reference.py (≈ 0.3 s per draw)")
    p.add_argument("--theta3-reference", type=int, default=0, metavar="K",
                   help="three layers with --pinned: measure the error on K draws against the nested θ rule of "
                        "tests/theta3_reference.py (≈ 8 s per draw), where it is within 1e-5 of its coarser level")
    p.add_argument("--t3-reference-n", type=int, default=11, metavar="N",
                   help="nodes per panel of the two-layer T = 3 reference (≈ 20 with the last layer pinned)")
    p.add_argument("--q", type=float, nargs="+", default=[0.0, 0.3, 0.9])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3], help="the cases to run")
    p.add_argument("--tokens", type=int, nargs="+", default=[2, 3], help="the cases to run (T = 3: two layers)")
    p.add_argument("--noise", type=float, nargs="+", default=[0.1], help="Δ of the noisy rows")
    p.add_argument("--routes", nargs="+", default=["reparam", "noisy"], help="the routes to run")
    p.add_argument("--pinned", action="store_true",
                   help="q = diag(0, …, 0, q): the last layer pinned, the earlier ones broad")
    a = p.parse_args()
    if a.self_reference_tol is not None and not a.self_reference:
        p.error("--self-reference-tol needs --self-reference K (the draws it is measured on)")
    rng = np.random.default_rng(0)
    print(f"{'route':22s} {'L':>2s} {'T':>2s} {'q':>6s} {'setting':20s} {'us/sample':>10s} "
          f"{'median err':>11s} {'max err':>9s} {'est. err (median)':>18s}")
    for route, L, T, noise, reference, settings in CASES:
        if L not in a.layers or T not in a.tokens or route not in a.routes:
            continue
        if noise:                                   # one row per Δ of --noise
            for delta in a.noise:
                run(a, rng, route, L, T, delta, lambda y, o, V, d=delta, f=reference: f(y, o, V, d), settings)
        elif L == 2 and T == 3:
            run(a, rng, route, L, T, None, lambda y, o, V, f=reference: f(y, o, V, n=a.t3_reference_n), settings)
        else:
            run(a, rng, route, L, T, None, reference, settings)


def run(a, rng, route, L, T, noise, reference, settings):
    """The rows of one case: per q, the timing batch, the references, every setting."""
    model = DeepAttention(L, T, threads=1)
    name = f"{route} Δ={noise:g}" if noise else route
    four_d = L == 3 or (noise and L == 2)                   # 4-D integrals: the L = 3 sample counts
    preimage = route == "noisy" and L == 2 and noise < NoisyChannel.POLAR_MIN_NOISE[2]
    for q in a.q:
        y, omega, V = draws(model, q, a.l3_timing_samples if four_d else a.timing_samples, rng, noise,
                            a.pinned)
        if not preimage:
            rows(a, model, noise, reference, settings, name, four_d, preimage, q, y, omega, V)
            continue
        keep = model.channel(noise=noise)._preimage_applies(y.reshape(len(y), -1))
        for rule, mask in (("pre", keep), ("chart", ~keep)):   # the preimage rule's samples, the others
            rows(a, model, noise, reference, settings, f"{name} {rule} {mask.mean():.0%}", four_d, preimage, q,
                 y[mask], omega[mask], V)


def rows(a, model, noise, reference, settings, case, four_d, preimage, q, y, omega, V):
    """One row per setting for the draws (y, omega, V)."""
    L, T = model.layers, model.tokens
    k = a.l3_reference_samples if four_d else a.reference_samples
    if a.self_reference and (L == 3 or preimage or a.self_reference_tol is not None):
        options = (dict(tol=a.self_reference_tol) if a.self_reference_tol is not None else
                   dict(error_estimate=False, nodes=2 * DEFAULT_NODES[4 if L == 3 else 2]))
        fine = model.channel(noise=noise, threads=1, **options).moments(
            y[:a.self_reference], omega[:a.self_reference], V)
        refs = [Fine(g, dg) for g, dg in zip(fine.g_out, fine.dg_out)]
    elif a.nested_reference and L == 2 and T == 2 and not noise:
        refs = [nested.reparam_l2_nested(y[i], omega[i], V) for i in range(min(a.nested_reference, len(y)))]
    elif a.theta3_reference and L == 3 and a.pinned:
        k = min(a.theta3_reference, len(y))
        u = model.channel(threads=1)._polar_input(y[:k])
        g, dg, error = theta3.reference(u, omega[:k], V, levels=((45, 33), (57, 33)))
        keep = np.flatnonzero(error <= 1e-5)
        order = np.concatenate([keep, np.flatnonzero(error > 1e-5), np.arange(k, len(y))])   # all timed
        y, omega = y[order], omega[order]
        refs = [Fine(g[i], dg[i]) for i in keep]
        case = f"{case} {len(keep)}/{k}"
    elif a.adaptive_reference and noise and L == 2:
        refs = adaptive_reference(model, noise, y[:a.adaptive_reference], omega[:a.adaptive_reference], V)
    else:
        refs = [reference(y[i], omega[i], V) for i in range(min(k, len(y)))]
    for setting in settings:
        channel = model.channel(noise=noise, threads=1, **setting)
        channel.moments(y[:4], omega[:4], V)
        times = []
        for _ in range(3):                   # best of three (a shared machine is noisy)
            start = time.process_time()
            m = channel.moments(y, omega, V)
            times.append(time.process_time() - start)
        us = min(times) / len(y) * 1e6
        errs = [ref.metric(m.g_out[i], m.dg_out[i], r.g_out, r.dg_out) for i, r in enumerate(refs)]
        label = ",".join(f"{k}={v}" for k, v in setting.items()) or "default"
        med, top = (f"{np.median(errs):.1e}", f"{np.max(errs):.1e}") if errs else ("-", "-")   # no references
        print(f"{case:22s} {L:2d} {T:2d} {q:6.{4 if a.pinned else 3}f} {label:20s} {us:10.1f} "
              f"{med:>11s} {top:>9s} {_median(m.error):>18s}", flush=True)


def adaptive_reference(model, noise, y, omega, V):
    """The noisy route's Laplace path (Channel._laplace: modes, then adaptive Genz–Malik cubature
    in Z) at tol=1e-8 with 2·10⁵ boxes, without the conditional rule the channel adds to it."""
    n = len(y)
    V = np.broadcast_to(V, (n,) + V.shape[-2:]).copy()
    Vinv = np.linalg.inv(V)
    channel = model.channel(noise=noise, tol=1e-8, max_regions=200_000, threads=1,
                            conditional=dict(sd=0.0))       # the adaptive rule, not the conditional, escalates
    m = channel._assemble(omega, V, Vinv, *Channel._laplace(channel, y.reshape(n, -1), omega, V, Vinv,
                                                            np.linalg.slogdet(V)[1]))
    return [Fine(g, dg) for g, dg in zip(m.g_out, m.dg_out)]


class Fine:
    """A reference computed by the channel itself (a finer or another of its rules)."""
    def __init__(self, g_out, dg_out):
        self.g_out, self.dg_out = g_out, dg_out


def _median(error):
    return f"{np.median(error):.1e}" if np.isfinite(error).any() else "-"


if __name__ == "__main__":
    main()
