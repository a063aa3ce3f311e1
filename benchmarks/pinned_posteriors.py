"""Pictures of the two-layer posterior over h_1 with the last layer pinned (T = 2, r = 1, c = 1,
β = 1): log of the integrand over (θ, |h_1|) on state-evolution draws at q = diag(0, q₂₂), for
the draws the polar rule alone (``error_estimate=False``) gets most wrong, against the channel
at ``tol=1e-9``.  Both signs of u_2 and both reflections ±h_1 are summed; the integrand comes
from the channel's generated kernels (``ReparamChannel._log_f``), the measure |h_1| d|h_1| dθ.

    python benchmarks/pinned_posteriors.py [--q22 0.999] [--draws 64] [--out FILE]
"""
import argparse
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from channel_reference import metric  # noqa: E402
from channels import draws  # noqa: E402  (benchmarks/channels.py: state-evolution draws)

from smi_core import DeepAttention  # noqa: E402


def log_posterior(channel, u, omega, V, radius, theta):
    """log f on the grid radius × theta (the measure r dr dθ), summed over the signs of u_2 and
    the reflections ±h_1, relative to its maximum."""
    R, TH = np.meshgrid(radius, theta, indexing="ij")
    x = np.stack([R * np.cos(TH), R * np.sin(TH)], axis=-1).reshape(1, -1, 2)
    Vinv = np.linalg.inv(V)[None]
    const0 = -(2 * np.log(2 * np.pi) + np.linalg.slogdet(V)[1])
    terms = []
    for reflection in (1.0, -1.0):
        for sign in (1.0, -1.0):
            pts = np.ascontiguousarray(reflection * x)
            signs = np.full(pts.shape[:2], sign)
            terms.append(channel._log_f(u[None], omega[None], Vinv, np.array([const0]), pts, signs,
                                        iterations=0)[0][0])
    lf = np.logaddexp.reduce(terms, axis=0) + np.log(R.ravel())
    return (lf - lf.max()).reshape(R.shape)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--q22", type=float, default=0.999)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "figures" / "pinned_posteriors.png"))
    a = p.parse_args()
    model = DeepAttention(2, 2, threads=1)
    y, omega, V = draws(model, a.q22, a.draws, np.random.default_rng(0), None, pinned=True)
    bare = model.channel(error_estimate=False).moments(y, omega, V)
    fine = model.channel(tol=1e-9).moments(y, omega, V)
    err = np.array([metric(bare.g_out[i], bare.dg_out[i], fine.g_out[i], fine.dg_out[i]) for i in range(len(y))])
    channel = model.channel()
    u = channel._u_model.reparametrise(y).u
    radius, theta = np.linspace(1e-3, 5.0, 400), np.linspace(0.0, np.pi, 640)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True, constrained_layout=True)
    for ax, i in zip(axes.ravel(), np.argsort(err)[::-1]):
        lf = log_posterior(channel, u[i], omega[i], V, radius, theta)
        im = ax.pcolormesh(theta, radius, np.maximum(lf, -40.0), shading="auto", cmap="viridis")
        for cliff in (0.0, np.pi / 4, np.pi / 2):
            ax.axvline(cliff, color="w", lw=0.5, ls=":")
        ax.set_title(f"draw {i}: polar rule alone {err[i]:.1e} off", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("θ (cliffs dotted: 0, π/4, π/2)")
    for ax in axes[:, 0]:
        ax.set_ylabel("|h_1|")
    fig.colorbar(im, ax=axes, label="log posterior − max (floored at −40)")
    fig.suptitle(f"Two layers, T = 2, the last layer pinned: q = diag(0, {a.q22:g})")
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}; errors of the polar rule alone (largest six): "
          + ", ".join(f"{err[i]:.1e}" for i in np.argsort(err)[::-1][:6]))


if __name__ == "__main__":
    main()
