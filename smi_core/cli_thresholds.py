"""``smi thresholds``, ``smi phase-diagram`` and ``smi demo`` (spec §6)."""
from __future__ import annotations

import argparse
import time

import numpy as np

from .cliutil import alphas, build_model, model_args, table, write_csv


def _options(p: argparse.ArgumentParser, samples: int, rtol: float) -> None:
    p.add_argument("--noise", type=float, default=None, help="output noise Δ > 0 (default: noiseless)")
    p.add_argument("--samples", type=int, default=samples,
                   help=f"draws per evaluation; the first step doubles them up to --max-samples (default {samples})")
    p.add_argument("--max-samples", type=int, default=1 << 18, help="draws at most for the first step")
    p.add_argument("--rtol", type=float, default=rtol, help=f"target relative standard error (default {rtol:g})")
    p.add_argument("--alpha-max", type=float, default=10.0, help="follow the branch up to this α")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _stair_options(a) -> dict:
    return dict(noise=a.noise, samples=a.samples, max_samples=a.max_samples, rtol=a.rtol,
                alpha_max=a.alpha_max, seed=a.seed)


def _layers(model) -> bool:
    """Name the indices by layer (deep attention with r = 1)."""
    return getattr(model, "rank", None) == 1


def _step_rows(stair, layers: bool) -> list[dict]:
    name = "layers" if layers else "indices"
    return [{"step": k + 1, "alpha": s.alpha, "stderr": s.stderr,
             name: " ".join(str(a + layers) for a in s.indices), "samples": s.samples}
            for k, s in enumerate(stair)]


def cmd_thresholds(a) -> dict:
    """The staircase of weak-recovery thresholds of one model (spec §6)."""
    from .thresholds import staircase
    model = build_model(a)
    start = time.perf_counter()
    stair = staircase(model, **_stair_options(a), progress=not a.quiet)
    seconds = time.perf_counter() - start
    rows = _step_rows(stair, _layers(model))
    write_csv(a.csv, rows)
    if a.plot:
        from .figures import plot_staircase
        plot_staircase(stair, a.plot, layers=_layers(model), title=repr(model))
    if not a.json:
        print(repr(model) + (f", noise Δ = {a.noise}" if a.noise else ""))
        print(table(rows))
        if not stair.complete:
            print(f"stopped: {stair.reason}")
        print(f"{seconds:.1f} s; table written to {a.csv}" + (f", figure to {a.plot}" if a.plot else ""))
    return {"model": repr(model), "noise": a.noise, "seconds": seconds} | stair.to_dict()


def _skips(text: str, spacing: str) -> np.ndarray:
    grid = alphas(text)
    if spacing == "log" and ":" in text:
        lo, hi, n = text.split(":")
        if float(lo) <= 0:
            raise ValueError("--skips must start above 0 with --spacing log")
        grid = np.geomspace(float(lo), float(hi), int(n))
    return grid


def cmd_phase_diagram(a) -> dict:
    """The staircase thresholds against the skip strength c: the phase diagram."""
    from .thresholds import phase_diagram
    if a.spacing not in ("log", "linear"):
        raise ValueError(f"--spacing must be log or linear, got {a.spacing!r}")
    model = build_model(a)
    skips = _skips(a.skips, a.spacing)
    start = time.perf_counter()
    diagram = phase_diagram(model, skips, progress=not a.quiet, **_stair_options(a))
    seconds = time.perf_counter() - start
    rows = []
    for c, alpha, err in zip(diagram.skips, diagram.alpha, diagram.stderr):
        row = {"skip": float(c)}
        for k in range(len(alpha)):
            row |= {f"alpha_{k + 1}": float(alpha[k]), f"stderr_{k + 1}": float(err[k])}
        rows.append(row)
    write_csv(a.csv, rows)
    if a.plot:
        from .figures import plot_phase_diagram
        plot_phase_diagram(diagram, a.plot, layers=_layers(model), title=f"{model!r}, skip varied")
    if not a.json:
        print(f"{model!r}, skip varied: thresholds against the skip strength c")
        print(table(rows))
        print(f"{len(skips)} skip values in {seconds:.1f} s; table written to {a.csv}"
              + (f", figure to {a.plot}" if a.plot else ""))
    return {"model": repr(model), "noise": a.noise, "seconds": seconds} | diagram.to_dict()


def cmd_demo(a) -> dict:
    """Two-layer attention at c = 1 (by default): the thresholds α₂ (last layer) and α₁ (first
    layer) with error bars, a short state-evolution curve that shows the staircase, a figure."""
    from .figures import plot_staircase
    from .state_evolution import learning_curve
    from .thresholds import staircase
    model = build_model(a)
    start = time.perf_counter()
    stair = staircase(model, samples=a.samples, rtol=a.rtol, seed=a.seed, progress=not a.quiet)
    curve = learning_curve(model, alphas(a.alphas), samples=a.curve_samples, seed=a.seed, progress=not a.quiet)
    seconds = time.perf_counter() - start
    plot_staircase(stair, a.plot, curve=curve, layers=_layers(model), title=repr(model))
    rows = [{"alpha": r.alpha} | {f"q_{i + 1}": float(v) for i, v in enumerate(np.diag(r.q))}
            | {"prediction_error": r.prediction_error} for r in curve]
    if not a.json:
        print(repr(model))
        print("weak-recovery thresholds (the staircase):")
        print(table(_step_rows(stair, _layers(model))))
        print("state evolution (uninformed start):")
        print(table(rows))
        print(f"{seconds:.1f} s; figure written to {a.plot}")
    return {"model": repr(model), "seconds": seconds, "staircase": stair.to_dict(),
            "curve": [r.to_dict() for r in curve]}


def add_commands(sub) -> None:
    demo = sub.add_parser("demo", help="two-layer attention: thresholds α₂, α₁, a state-evolution "
                                       "curve and the staircase figure (≈ 20 s on 2 cores)")
    model_args(demo)
    demo.add_argument("--samples", type=int, default=1 << 15, help="draws per threshold evaluation")
    demo.add_argument("--rtol", type=float, default=1e-3)
    demo.add_argument("--alphas", default="0.05:1.5:16", help="the state-evolution grid (default 0.05:1.5:16)")
    demo.add_argument("--curve-samples", type=int, default=2048, help="draws per state-evolution step")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default="demo.png", metavar="FILE", help="figure (default demo.png)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=cmd_demo)
    th = sub.add_parser("thresholds", help="weak-recovery thresholds: the staircase of learned layers")
    model_args(th)
    _options(th, 1 << 15, 1e-3)
    th.add_argument("--csv", default="thresholds.csv", help="where to write the table")
    th.add_argument("--plot", default=None, metavar="FILE", help="draw the staircase to FILE")
    th.set_defaults(func=cmd_thresholds)
    pd = sub.add_parser("phase-diagram", help="staircase thresholds against the skip strength c")
    model_args(pd)
    _options(pd, 8192, 1e-2)
    pd.add_argument("--skips", default="0.01:4:16", help="'start:stop:count' or a list (default 0.01:4:16)")
    pd.add_argument("--spacing", default="log", help="log | linear spacing of start:stop:count (default log)")
    pd.add_argument("--csv", default="phase_diagram.csv", help="where to write the table")
    pd.add_argument("--plot", default=None, metavar="FILE", help="draw the phase diagram to FILE")
    pd.set_defaults(func=cmd_phase_diagram)
