"""``smi gamp`` and ``smi sgd``: learning on synthetic teacher data, per-layer cosine similarity
against iterations (GAMP, spec §7) or epochs (SGD), averaged over seeds."""
from __future__ import annotations

import textwrap
import time

import numpy as np

from . import validate
from .cliutil import build_model, model_args, table, write_csv


def _common(p, dim: int, alpha: float, csv: str) -> None:
    model_args(p)
    p.add_argument("--dim", type=int, default=dim, help=f"input dimension D (default {dim})")
    p.add_argument("--alpha", type=float, default=alpha, help=f"sample ratio α = n/D > 0 (default {alpha})")
    p.add_argument("--seeds", type=int, default=4, help="number of teachers/datasets (default 4)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--noise", type=float, default=None, help="output noise Δ > 0 (default: noiseless)")
    p.add_argument("--test-samples", type=int, default=1000, help="fresh samples for the test error")
    p.add_argument("--csv", default=csv, help=f"where to write the table (default {csv})")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw per-layer cosine similarity to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_commands(sub) -> None:
    g = sub.add_parser("gamp", help="GAMP on teacher data: per-layer overlaps against iterations")
    _common(g, 1000, 1.2, "gamp.csv")
    g.add_argument("--iterations", type=int, default=50, help="maximum number of iterations (default 50)")
    g.add_argument("--tol", type=float, default=1e-5, help="stop when Ŵ's RMS change is below (default 1e-5)")
    g.add_argument("--damping", type=float, default=0.0)
    g.add_argument("--side-info", type=float, default=0.0, help="side information λ ≥ 0 (default 0)")
    g.add_argument("--threads", type=int, default=0, help="channel OpenMP threads (default: all cores)")
    g.add_argument("--se", action="store_true", help="compare the final overlaps with state evolution")
    g.add_argument("--se-samples", type=int, default=2048, help="draws for --se (default 2048)")
    g.set_defaults(func=cmd_gamp)
    s = sub.add_parser("sgd", help="SGD baseline on teacher data: per-layer cosine against epochs")
    _common(s, 200, 10.0, "sgd.csv")
    s.add_argument("--epochs", type=int, default=40, help="passes over the data (default 40)")
    s.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--batch-size", type=int, default=100)
    s.add_argument("--reuse", type=int, default=2, help="steps per batch (default 2)")
    s.set_defaults(func=cmd_sgd)


def _runs(a, train, step: str) -> tuple[dict, list]:
    """Teacher, data and ``train(model, teacher, X, y, rng)`` per seed; the averaged table."""
    from tqdm import tqdm
    from .data import check_count, make_teacher, sample
    validate.positive("alpha", a.alpha)
    check_count("seeds", a.seeds)
    check_count("dim", a.dim)
    model = build_model(a)
    n = int(round(a.alpha * a.dim))
    if n < 1:
        raise ValueError(f"alpha · dim must give at least one sample, got α = {a.alpha}, D = {a.dim}")
    runs, start = [], time.perf_counter()
    for seed in tqdm(range(a.seed, a.seed + a.seeds), disable=a.quiet, unit="seed", leave=False):
        rng = np.random.default_rng(seed)
        teacher = make_teacher(model, a.dim, rng, noise=a.noise)
        X, y = sample(teacher, n, rng)
        runs.append(train(model, teacher, X, y, rng))
        del X, y
    result = {"model": repr(model), "dim": a.dim, "alpha": a.alpha, "n": n, "noise": a.noise,
              "seeds": list(range(a.seed, a.seed + a.seeds)), "seconds": time.perf_counter() - start,
              "runs": [r.to_dict() for r in runs]}
    return result, _average(runs, step)


def _stack(runs, key: str) -> np.ndarray:
    """(seeds, steps, …) with a run that stopped early holding its last value."""
    arrays = [getattr(r, key) for r in runs]
    steps = max(len(v) for v in arrays)
    return np.array([np.concatenate([v, np.repeat(v[-1:], steps - len(v), axis=0)]) for v in arrays])


def _average(runs, step: str) -> list[dict]:
    """Per step: mean and standard deviation over seeds of each layer's cosine, the mean of
    |M_ℓℓ|, and the mean errors."""
    cos = _stack(runs, "cosine")
    M = np.abs(np.diagonal(_stack(runs, "overlap"), axis1=2, axis2=3))
    errors = [k for k in ("test_error", "plugin_error", "train_loss") if getattr(runs[0], k, None) is not None]
    err = {k: _stack(runs, k).mean(axis=0) for k in errors}
    rows = []
    for i in range(cos.shape[1]):
        row = {step: i}
        for l in range(cos.shape[2]):
            row |= {f"cos_{l + 1}": float(cos[:, i, l].mean()), f"cos_{l + 1}_sd": float(cos[:, i, l].std())}
        row |= {f"M_{a + 1}{a + 1}": float(M[:, i, a].mean()) for a in range(M.shape[2])}
        row |= {k: float(v[i]) for k, v in err.items()}
        rows.append(row)
    return rows


def _report(a, result: dict, rows: list[dict], step: str, lines=(), levels=None) -> dict:
    result["table"] = rows
    write_csv(a.csv, rows)
    if a.plot:
        _plot(rows, step, a.plot, result["model"] + f", D = {a.dim}, α = {a.alpha}", levels)
    if not a.json:
        every = -(-len(rows) // 25)             # at most ≈ 25 rows on screen; the CSV has all
        print(f"{result['model']}, D = {a.dim}, α = {a.alpha} (n = {result['n']}), {a.seeds} seed(s)"
              + (f", noise Δ = {a.noise}" if a.noise else ""))
        print(table([r for i, r in enumerate(rows) if i % every == 0 or i == len(rows) - 1]))
        for line in lines:
            print(line)
        print(f"{result['seconds']:.1f} s; table written to {a.csv}" + (f", figure to {a.plot}" if a.plot else ""))
    return result


def cmd_gamp(a) -> dict:
    """GAMP (spec §7) on teacher data for each seed; optionally state evolution at the same α."""
    from .gamp import gamp
    options = {"threads": a.threads}

    def train(model, teacher, X, y, rng):
        return gamp(model, X, y, teacher=teacher, noise=a.noise, side_info=a.side_info, damping=a.damping,
                    max_iter=a.iterations, tol=a.tol, rng=rng, test_samples=a.test_samples,
                    channel=options, progress=not a.quiet)

    result, rows = _runs(a, train, "iteration")
    lines, levels = [], None
    if a.se:
        from .state_evolution import state_evolution
        se = state_evolution(build_model(a), a.alpha, noise=a.noise, side_info=a.side_info,
                             samples=a.se_samples, seed=a.seed, channel=options)
        result["se"] = se.to_dict()
        final = np.array([[abs(r["overlap"][-1][i][i]) for i in range(len(se.q))] for r in result["runs"]])
        lines = [f"final |M_{i + 1}{i + 1}| = {final[:, i].mean():.4f} ± {final[:, i].std():.4f} (sd over seeds), "
                 f"state evolution q_{i + 1}{i + 1} = {se.q[i, i]:.4f} ± {se.q_stderr[i, i]:.4f}"
                 for i in range(len(se.q))]
        levels = np.sqrt(np.clip(np.diag(se.q), 0, None))
    return _report(a, result, rows, "iteration", lines, levels)


def cmd_sgd(a) -> dict:
    """Mini-batch SGD of a student of the same architecture, for each seed."""
    from .sgd import sgd

    def train(model, teacher, X, y, rng):
        return sgd(model, X, y, teacher=teacher, lr=a.lr, weight_decay=a.weight_decay,
                   batch_size=a.batch_size, reuse=a.reuse, epochs=a.epochs, rng=rng,
                   test_samples=a.test_samples, progress=not a.quiet)

    result, rows = _runs(a, train, "epoch")
    return _report(a, result, rows, "epoch")


def _plot(rows: list[dict], step: str, path: str, title: str, levels=None) -> None:
    """Per-layer cosine similarity against ``step``: mean over seeds, ±1 standard deviation
    shaded (clipped to [0, 1]); with ``levels`` (√q_ℓℓ of state evolution, the cosine it predicts) dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.array([r[step] for r in rows])
    layers = sum(1 for k in rows[0] if k.startswith("cos_") and not k.endswith("_sd"))
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for l in range(1, layers + 1):
        mean = np.array([r[f"cos_{l}"] for r in rows])
        sd = np.array([r[f"cos_{l}_sd"] for r in rows])
        line, = ax.plot(x, mean, label=f"layer {l}")
        ax.fill_between(x, np.clip(mean - sd, 0, 1), np.clip(mean + sd, 0, 1), color=line.get_color(), alpha=0.2)
        if levels is not None:
            ax.axhline(levels[l - 1], ls="--", lw=1, color=line.get_color())
    ax.set(xlabel=step, ylabel="cosine similarity with the teacher", ylim=(-0.02, 1.02))
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=8)
    if levels is not None:
        ax.plot([], [], ls="--", color="grey", label="state evolution √q")
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
