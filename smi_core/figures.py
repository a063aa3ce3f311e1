"""Figures: learning curves from state evolution."""
from __future__ import annotations

import numpy as np


def plot_learning_curve(curve, path: str, title: str = "") -> None:
    """Two panels against α: the overlaps q_aa per index (per layer for r = 1 attention) and the
    Bayes-optimal and plug-in prediction errors, with ±2 standard errors; a fixed point of the
    other start, where it differs, is drawn dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alpha = np.array([r.alpha for r in curve])
    q = np.array([np.diag(r.q) for r in curve])
    q_err = np.array([np.diag(r.q_stderr) for r in curve])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for i in range(q.shape[1]):
        line, = left.plot(alpha, q[:, i], marker="o", ms=3, label=f"$q_{{{i + 1}{i + 1}}}$")
        left.fill_between(alpha, q[:, i] - 2 * q_err[:, i], q[:, i] + 2 * q_err[:, i],
                          color=line.get_color(), alpha=0.2)
        alt = [(r.alpha, np.diag(r.alternative.q)[i]) for r in curve if r.alternative is not None]
        if alt:
            left.plot(*np.array(alt).T, ls="--", color=line.get_color())
    left.set(xlabel=r"$\alpha$", ylabel="overlap", ylim=(-0.02, 1.02), title="overlaps per layer")
    left.legend()
    for key, label in (("prediction_error", "Bayes-optimal"), ("plugin_error", "plug-in")):
        value = np.array([getattr(r, key) for r in curve])
        err = np.array([getattr(r, key + "_stderr") for r in curve])
        right.errorbar(alpha, value, yerr=2 * err, marker="o", ms=3, capsize=2, label=label)
    right.set(xlabel=r"$\alpha$", ylabel="prediction error", title="prediction error")
    right.legend()
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
