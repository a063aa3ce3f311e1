"""Figures: learning curves, the staircase of thresholds and the phase diagram."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_learning_curve(curve, path: str, title: str = "") -> None:
    """Two panels against α: the overlaps q_aa per index (per layer for r = 1 attention) and the
    Bayes-optimal and plug-in prediction errors, with ±2 standard errors; a fixed point of the
    other start, where it differs, is drawn dashed."""
    plt, fig, (left, right) = _axes(2, width=10)
    alpha = np.array([r.alpha for r in curve])
    q = np.array([np.diag(r.q) for r in curve])
    q_err = np.array([np.diag(r.q_stderr) for r in curve])
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
    _save(plt, fig, path)


def _wrap(title: str) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(title, 90))


def _save(plt, fig, path: str) -> None:
    """Write the figure (creating its folder: a long run must not fail at its last step)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _axes(ncols: int = 1, width: float = 6):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, ncols, figsize=(width, 4), constrained_layout=True)
    return plt, fig, ax


def _learned(indices: list[list[int]], layers: bool) -> list[str]:
    """Labels of the regions between steps: what is learned after each step."""
    seen, labels = [], ["nothing learned"]
    for step in indices:
        seen = sorted(set(seen) | set(step))
        labels.append(("layers " if layers else "indices ") + ", ".join(str(a + layers) for a in seen))
    return labels


def plot_staircase(staircase, path: str, curve=None, layers: bool = True, title: str = "") -> None:
    """The grand staircase: the number of learned directions against α, a step at each
    threshold (±2 standard errors shaded); with a state-evolution ``curve``, its overlaps per
    index are drawn on the same α axis."""
    plt, fig, ax = _axes()
    steps = list(staircase)
    top = max([s.alpha for s in steps] + ([r.alpha for r in curve] if curve else [])) * 1.2
    alphas = [0.0] + [s.alpha for s in steps] + [top]
    learned = np.cumsum([0] + [len(s.indices) for s in steps])
    ax.step(alphas, np.append(learned, learned[-1]) / learned[-1], where="post", color="k", lw=1.5,
            label="learned fraction (staircase)")
    for s, label in zip(steps, _learned([s.indices for s in steps], layers)[1:]):
        ax.axvspan(s.alpha - 2 * s.stderr, s.alpha + 2 * s.stderr, color="k", alpha=0.15)
        ax.annotate(rf"$\alpha={s.alpha:.4g}$" + "\n" + label, (s.alpha, 1.0), xytext=(4, -28),
                    textcoords="offset points", fontsize=8)
    if curve:
        alpha = np.array([r.alpha for r in curve])
        q = np.array([np.diag(r.q) for r in curve])
        for i in range(q.shape[1]):
            ax.plot(alpha, q[:, i], marker="o", ms=3, label=(f"layer {i + 1}" if layers else f"$q_{{{i + 1}{i + 1}}}$")
                    + " overlap (SE)")
    ax.set(xlabel=r"$\alpha$", ylabel="overlap / learned fraction", xlim=(0, top), ylim=(-0.02, 1.08))
    ax.legend(fontsize=8, loc="center right")
    ax.set_title(_wrap(title), fontsize=8)
    _save(plt, fig, path)


def plot_phase_diagram(diagram, path: str, layers: bool = True, title: str = "") -> None:
    """Thresholds against the skip strength c (log axis), ±2 standard errors, and the regions
    between them labelled by what is learned (from the first skip value's staircase)."""
    plt, fig, ax = _axes()
    c, alpha, err = diagram.skips, diagram.alpha, diagram.stderr
    top = np.nanmax(alpha) * 1.3
    bounds = np.column_stack([np.zeros(len(c)), alpha, np.full(len(c), top)])
    labels = _learned(diagram.indices[0], layers)
    colors = plt.cm.Blues(np.linspace(0.08, 0.5, len(labels)))
    for k, label in enumerate(labels):
        ax.fill_between(c, bounds[:, k], bounds[:, k + 1], color=colors[k], label=label)
    for k in range(alpha.shape[1]):
        ax.errorbar(c, alpha[:, k], yerr=2 * err[:, k], color="k", marker="o", ms=3, capsize=2, lw=1)
    ax.set(xscale="log" if c.min() > 0 and c.max() / c.min() > 20 else "linear", xlabel="skip strength $c$",
           ylabel=r"$\alpha$", ylim=(0, top))
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(_wrap(title), fontsize=8)
    _save(plt, fig, path)
