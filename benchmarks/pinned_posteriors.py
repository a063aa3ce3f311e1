"""Pictures of the two-layer posterior over h_1 with the last layer pinned (T = 2, r = 1, c = 1,
β = 1): log of the integrand over (θ, |h_1|) on state-evolution draws at q = diag(0, q₂₂), for
the draws the polar rule alone (``error_estimate=False``) gets most wrong, against the channel
at ``tol=1e-9``.  Both signs of u_2 and both reflections ±h_1 are summed; the integrand comes
from the model's generated kernels, the measure |h_1| d|h_1| dθ.
With ``--logits``, over the attention logits a = (h_11(h_11 − h_12), h_12(h_12 − h_11)) instead
(p_t = σ(βa_t); the likelihood is a function of a alone), the measure da: each a with
a_1 + a_2 > 0 has the pre-images ±(a_1, −a_2)/√(a_1 + a_2), dh_1 = da / (2(a_1 + a_2)).

    python benchmarks/pinned_posteriors.py [--q22 0.999] [--draws 64] [--logits] [--out FILE]
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


def polar_grid(radius, theta):
    """h_1 on the grid radius × theta, and log of the measure r (dh_1 = r dr dθ)."""
    R, TH = np.meshgrid(radius, theta, indexing="ij")
    return np.stack([R * np.cos(TH), R * np.sin(TH)], axis=-1), np.log(R)


def logit_grid(a1, a2):
    """One pre-image h_1 of each logit pair on the grid a2 × a1 (rows a2, as ``polar_grid``'s rows
    are radii; NaN where a_1 + a_2 ≤ 0: none), and log of the measure 1/(2(a_1 + a_2)) (-inf there)."""
    A1, A2 = np.meshgrid(a1, a2)
    S = np.where(A1 + A2 > 0, A1 + A2, np.nan)
    return np.stack([A1, -A2], axis=-1) / np.sqrt(S)[..., None], np.nan_to_num(-np.log(2 * S), nan=-np.inf)


def log_posterior(model, u, omega, V, grid):
    """log f on the ``grid`` (h_1 and log measure; -inf where h_1 is NaN), summed over the
    signs of u_2 and the reflections ±h_1, relative to its maximum: f = N(Z; ω, V)/|det Φ⁽¹⁾|
    with Z = [±h_1; Φ⁽¹⁾⁻¹(±u_2)] (spec §4; Φ⁽¹⁾⁻¹ and log|det Φ⁽¹⁾| from the model's
    generated ``inverse`` kernel)."""
    h1, log_measure = grid
    valid = np.isfinite(log_measure.ravel())
    x = np.ascontiguousarray(h1.reshape(-1, 2)[valid])
    out = model.kernel("inverse")(x, model.params)
    inv, log_det = out[:, :4].reshape(-1, 2, 2), out[:, 4]
    Vinv = np.linalg.inv(V)
    const = -(2 * np.log(2 * np.pi) + np.linalg.slogdet(V)[1])
    terms = []
    for reflection in (1.0, -1.0):
        for sign in (1.0, -1.0):
            Z = np.stack([reflection * x, inv @ (sign * u)], axis=1) - omega      # (K, layer, token)
            terms.append(const - 0.5 * np.einsum("kat,ab,kbt->k", Z, Vinv, Z) - log_det)
    lf = np.full(valid.size, -np.inf)
    lf[valid] = np.logaddexp.reduce(terms, axis=0) + log_measure.ravel()[valid]
    return (lf - lf.max()).reshape(log_measure.shape)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--q22", type=float, default=0.999)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--logits", action="store_true", help="over the attention logits a, not (θ, |h_1|)")
    p.add_argument("--out", help="default: benchmarks/figures/pinned_posteriors[_logits].png")
    a = p.parse_args()
    out = a.out or str(Path(__file__).resolve().parent / "figures"
                       / f"pinned_posteriors{'_logits' if a.logits else ''}.png")
    model = DeepAttention(2, 2, threads=1)
    y, omega, V = draws(model, a.q22, a.draws, np.random.default_rng(0), None, pinned=True)
    bare = model.channel(error_estimate=False).moments(y, omega, V)
    fine = model.channel(tol=1e-9).moments(y, omega, V)
    err = np.array([metric(bare.g_out[i], bare.dg_out[i], fine.g_out[i], fine.dg_out[i]) for i in range(len(y))])
    channel = model.channel()
    u = channel._u_model.reparametrise(y).u
    if a.logits:
        xs = ys = np.linspace(-12.0, 12.0, 480)
        grid = logit_grid(xs, ys)
        labels = ("a_1 (cliff a_1 = 0 dotted)", "a_2")
    else:
        xs, ys = np.linspace(0.0, np.pi, 640), np.linspace(1e-3, 5.0, 400)
        grid = polar_grid(ys, xs)
        labels = ("θ (cliffs dotted: 0, π/4, π/2)", "|h_1|")
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True, constrained_layout=True)
    for ax, i in zip(axes.ravel(), np.argsort(err)[::-1]):
        lf = np.maximum(log_posterior(model, u[i], omega[i], V, grid), -40.0)
        im = ax.pcolormesh(xs, ys, lf, shading="auto", cmap="viridis")
        for cliff in ((0.0,) if a.logits else (0.0, np.pi / 4, np.pi / 2)):
            ax.axvline(cliff, color="w", lw=0.5, ls=":")
        if a.logits:
            ax.axhline(0.0, color="w", lw=0.5, ls=":")
        ax.set_title(f"draw {i}: polar rule alone {err[i]:.1e} off", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel(labels[0])
    for ax in axes[:, 0]:
        ax.set_ylabel(labels[1])
    fig.colorbar(im, ax=axes, label="log posterior − max (floored at −40)")
    fig.suptitle(f"Two layers, T = 2, the last layer pinned: q = diag(0, {a.q22:g})")
    fig.savefig(out, dpi=80)
    print(f"wrote {out}; errors of the polar rule alone (largest six): "
          + ", ".join(f"{err[i]:.1e}" for i in np.argsort(err)[::-1][:6]))


if __name__ == "__main__":
    main()
