"""The noisy route for other links: microseconds per sample (best of three, CPU time with
threads=1 — run it with OPENBLAS_NUM_THREADS=1) and the accuracy reached against the two-index
mpmath reference of tests/channel_reference.py (``noisy_link``; max abs error over (g_out, dg_out)
/ max abs entry), for y = h_1 h_2 and y = tanh(2h_1) + h_2²/2 plus noise (R = 2, T = 1), and
for the shell y = h_1² + h_2² + h_3²/2 plus noise (R = 3) at q = 0 against the
characteristic-function reference (``quadratic_link``).

Draws are those of state evolution at overlap q·I: ω = √q ξ, V = (1-q) I, Z = ω + √(1-q) ζ,
y = g(Z) + √Δ η.  Below q ≈ 0.9 the posterior is a curved ridge across the prior, which the
Laplace rule alone (``error_estimate=False``) does not resolve; the default escalates such
samples to adaptive cubature from boxes refined onto the ridge.  "missed": draws off by more than
1e-6 and more than 3× their estimate.

    python benchmarks/links.py [--samples K] [--q Q ...] [--noise Δ ...] [--seed S]
"""
import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import sympy as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import channel_reference as ref  # noqa: E402

from smi_core import LinkModel, index_symbols, register_link  # noqa: E402

H = index_symbols(2, 1)
LINKS = {"product": H[0, 0] * H[1, 0], "tanh_square": sp.tanh(2 * H[0, 0]) + H[1, 0] ** 2 / 2}
SETTINGS = [{}, {"tol": 1e-6}, {"error_estimate": False}]
SHELL = (1.0, 1.0, 0.5)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=12, help="draws per cell (each gets an mpmath reference)")
    p.add_argument("--q", type=float, nargs="+", default=[0.0, 0.5, 0.9, 0.99])
    p.add_argument("--noise", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    p.add_argument("--seed", type=int, default=11)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    print(f"{'link':12s} {'q':>5s} {'Δ':>6s} {'setting':20s} {'us/sample':>10s} {'median err':>11s} "
          f"{'max err':>9s} {'missed':>6s}")
    for name, expr in LINKS.items():
        register_link(f"bench_{name}", expr)
        model = LinkModel(f"bench_{name}", threads=1)
        for q in a.q:
            for noise in a.noise:
                omega = np.sqrt(q) * rng.standard_normal((a.samples, 2, 1))
                Z = omega + np.sqrt(1 - q) * rng.standard_normal((a.samples, 2, 1))
                y = ref.LINKS[name][0](Z)[:, 0] + np.sqrt(noise) * rng.standard_normal(a.samples)
                V = (1 - q) * np.eye(2)
                refs = [ref.noisy_link(y[i:i + 1], omega[i], V, name, 2, 1, noise=noise) for i in range(a.samples)]
                for setting in SETTINGS:
                    row(model, name, q, noise, setting, y, omega, V, refs)
    register_link("bench_shell", sum(c * h ** 2 for c, h in zip(SHELL, index_symbols(3, 1)[:, 0])))
    model = LinkModel("bench_shell", threads=1)
    for noise in a.noise:
        y = rng.standard_normal((a.samples, 3)) ** 2 @ np.array(SHELL) + np.sqrt(noise) * rng.standard_normal(a.samples)
        refs = [SimpleNamespace(g_out=np.zeros((3, 1)), dg_out=np.diag(c)) for c in ref.quadratic_link(SHELL, noise, y)[1]]
        for setting in SETTINGS:
            row(model, "shell", 0.0, noise, setting, y, np.zeros((a.samples, 3, 1)), np.eye(3), refs)


def row(model, name, q, noise, setting, y, omega, V, refs):
    channel = model.channel(noise=noise, threads=1, **setting)
    times = []
    for _ in range(3):                   # best of three (a shared machine is noisy)
        start = time.process_time()
        m = channel.moments(y, omega, V)
        times.append(time.process_time() - start)
    err = np.array([ref.metric(m.g_out[i], m.dg_out[i], r.g_out, r.dg_out) for i, r in enumerate(refs)])
    missed = int(((err > 1e-6) & (err > 3 * m.error)).sum()) if np.isfinite(m.error).all() else "-"
    label = ",".join(f"{k}={v}" for k, v in setting.items()) or "default"
    print(f"{name:12s} {q:5.2f} {noise:6.0e} {label:20s} {min(times) / len(y) * 1e6:10.1f} "
          f"{np.median(err):11.1e} {err.max():9.1e} {missed:>6}", flush=True)


if __name__ == "__main__":
    main()
