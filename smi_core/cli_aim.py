"""``smi aim se|gamp|gd``: attention-indexed models in the extensive-width regime (AIM.md)."""
from __future__ import annotations

import time

import numpy as np

from .cliutil import alphas, table, write_csv


def _progress(total, quiet, desc):
    if quiet:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False)


def _plot(curves, thresholds, path, title):
    """MMSE against α per curve, the perfect-recovery threshold of each as a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for label, (a, m) in curves.items():
        line, = ax.plot(a, m, marker="o", ms=3, label=label)
        if thresholds.get(label) is not None:
            ax.axvline(thresholds[label], ls=":", color=line.get_color())
    ax.set(xlabel=r"$\alpha = n/d^2$", ylabel="MMSE", title=title, ylim=(-0.02, 1.02))
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_se(a) -> dict:
    """State evolution for every (ρ, T) given, over a grid of α."""
    from .aim import aim_perfect_recovery, aim_state_evolution
    grid = alphas(a.alphas)
    rhos = [float(v) for v in a.rho.split(",")]
    tokens = [int(v) for v in a.tokens.split(",")]
    bar = _progress(grid.size * len(rhos) * len(tokens), a.quiet, "aim se")
    start = time.perf_counter()
    rows, curves, thresholds, results = [], {}, {}, []
    for T in tokens:
        for rho in rhos:
            r = aim_state_evolution(a.channel, T, rho, grid, beta=a.beta, damping=a.damping,
                                    tol=a.tol, max_iter=a.max_iter, progress=bar)
            pr = aim_perfect_recovery(a.channel, T, rho) if a.channel != "hardmax" else None
            label = f"T={T}, ρ={rho:g}"
            curves[label], thresholds[label] = (r.alpha, r.mmse), pr
            results.append(r.to_dict() | {"alpha_pr": pr})
            rows += [{"tokens": T, "rho": rho, "alpha": float(al), "mmse": float(m), "q": float(q),
                      "q_hat": float(qh), "iterations": int(it), "converged": bool(c)}
                     for al, m, q, qh, it, c in zip(r.alpha, r.mmse, r.q, r.q_hat, r.iterations, r.converged)]
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    write_csv(a.csv, rows)
    if a.plot:
        _plot(curves, thresholds, a.plot, f"{a.channel} attention, state evolution")
    if not a.json:
        print(table(rows))
        for label, pr in thresholds.items():
            if pr is not None:
                print(f"{label}: perfect recovery at α_PR = {pr:.6g}")
        print(f"{len(rows)} points in {seconds:.1f} s; table written to {a.csv}"
              + (f", figure to {a.plot}" if a.plot else ""))
    return {"channel": a.channel, "seconds": seconds, "curves": results}


def _data_runs(a, run, name):
    """Runs `run(data, progress)` for every α and seed; rows with the SE prediction."""
    from .aim import aim_state_evolution
    from .aim.data import aim_data
    grid = alphas(a.alphas)
    se = aim_state_evolution(a.channel, a.tokens, a.rho, grid, beta=a.beta)
    rows = []
    for al, m_se in zip(grid, se.mmse):
        for seed in range(a.seed, a.seed + a.seeds):
            data = aim_data(a.d, float(al), a.rho, a.tokens, a.channel, a.beta, seed=seed)
            rows.append({"alpha": float(al), "seed": seed, "mmse_se": float(m_se)} | run(data, seed))
    write_csv(a.csv, rows)
    if a.plot:
        pts = {f"{name}, d={a.d}": (np.array([r["alpha"] for r in rows]), np.array([r["mmse"] for r in rows])),
               "state evolution": (se.alpha, se.mmse)}
        _plot(pts, {}, a.plot, f"{a.channel} attention, T={a.tokens}, ρ={a.rho:g}")
    if not a.json:
        print(table(rows))
        print(f"table written to {a.csv}" + (f", figure to {a.plot}" if a.plot else ""))
    return {"channel": a.channel, "d": a.d, "rho": a.rho, "tokens": a.tokens, "runs": rows}


def cmd_gamp(a) -> dict:
    """GAMP-RIE on data against state evolution."""
    from .aim import aim_gamp

    def run(data, seed):
        bar = _progress(a.max_iter, a.quiet, f"gamp seed {seed}")
        start = time.perf_counter()
        r = aim_gamp(data, max_iter=a.max_iter, damping=a.damping, progress=bar)
        if bar is not None:
            bar.close()
        return {"mmse": float(r.mmse[-1]), "iterations": r.iterations,
                "s_per_iteration": (time.perf_counter() - start) / r.iterations}
    return _data_runs(a, run, "GAMP-RIE")


def cmd_gd(a) -> dict:
    """Gradient descent (Adam) students, their average, against state evolution."""
    from .aim import aim_gd

    def run(data, seed):
        bar = _progress(a.students * a.steps, a.quiet, f"gd seed {seed}")
        r = aim_gd(data, students=a.students, steps=a.steps, lr=a.lr, seed=seed + 10_000, progress=bar)
        if bar is not None:
            bar.close()
        return {"mmse": r.average_error, "student_mean": float(r.errors.mean()),
                "train_loss": float(r.train_loss.mean())}
    return _data_runs(a, run, "GD (average of students)")


def _common(p, tokens_default="2"):
    p.add_argument("--channel", default="softmax", help="softmax | hardmax | linear (default softmax)")
    p.add_argument("--beta", type=float, default=1.0, help="softmax inverse temperature β (default 1)")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw MMSE against α to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def add_commands(sub) -> None:
    aim = sub.add_parser("aim", help="attention-indexed models, extensive width: se | gamp | gd")
    aim_sub = aim.add_subparsers(dest="aim_command", metavar="AIM_COMMAND", required=True)
    se = aim_sub.add_parser("se", help="state evolution: MMSE against α for several ρ or T")
    _common(se)
    se.add_argument("--tokens", default="2", help="T, or a comma-separated list (default 2)")
    se.add_argument("--rho", default="0.5", help="ρ = r/d, or a comma-separated list (default 0.5)")
    se.add_argument("--alphas", default="0.005:0.4:40", help="'start:stop:count' or a list")
    se.add_argument("--damping", type=float, default=0.0)
    se.add_argument("--tol", type=float, default=1e-10, help="relative change of V that stops (default 1e-10)")
    se.add_argument("--max-iter", type=int, default=2000)
    se.add_argument("--csv", default="aim_se.csv", help="where to write the table (default aim_se.csv)")
    se.set_defaults(func=cmd_se)
    for name, func, help_ in (("gamp", cmd_gamp, "GAMP-RIE on data against state evolution"),
                              ("gd", cmd_gd, "gradient-descent students on data against state evolution")):
        p = aim_sub.add_parser(name, help=help_)
        _common(p)
        p.add_argument("--tokens", type=int, default=2)
        p.add_argument("--rho", type=float, default=0.5)
        p.add_argument("--d", type=int, default=100, help="dimension d (default 100)")
        p.add_argument("--alphas", default="0.08,0.15", help="'start:stop:count' or a list")
        p.add_argument("--seeds", type=int, default=2, help="data sets per α (default 2)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--csv", default=f"aim_{name}.csv")
        p.set_defaults(func=func)
    gamp = aim_sub.choices["gamp"]
    gamp.add_argument("--max-iter", type=int, default=60)
    gamp.add_argument("--damping", type=float, default=0.3)
    gd = aim_sub.choices["gd"]
    gd.add_argument("--students", type=int, default=4)
    gd.add_argument("--steps", type=int, default=2000)
    gd.add_argument("--lr", type=float, default=0.01)
