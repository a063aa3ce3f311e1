"""State evolution learning curves (issue 4): wall time of the full curve, iterations, and the
standard errors reached.

Two-layer attention (T = 2, r = 1, c = 1, β = 1): 40 values of α from 0.05 to 2, each converged
to a distance < 1e-4 from its fixed point; target ≤ 2 minutes on 2 cores.  Three-layer
(``--three-layer``): target ≤ 20 minutes.  ``--tokens 3``: the two-layer curve with T = 3
(no target; the figure is se_L2_T3.png).

    python benchmarks/state_evolution.py [--samples N] [--nodes K] [--channel-tol TOL] [--tokens T]
                                         [--three-layer] [--three-layer-tol TOL] [--plot DIR]
"""
import argparse
import time

import numpy as np

from smi_core import DeepAttention
from smi_core.state_evolution import learning_curve


def run(layers: int, samples: int, nodes: int | None, tol: float | None, threads: int,
        plot: str | None, se_tol: float = 1e-4, stderr_tol: float | None = None,
        max_samples: int = 1 << 18, tokens: int = 2) -> dict:
    model = DeepAttention(layers=layers, tokens=tokens)
    alphas = np.linspace(0.05, 2, 40)
    channel = {"threads": threads} | ({"nodes": nodes} if nodes else {}) | ({"tol": tol} if tol else {})
    start = time.perf_counter()
    curve = learning_curve(model, alphas, samples=samples, channel=channel, tol=se_tol,
                           stderr_tol=stderr_tol, max_samples=max_samples)
    seconds = time.perf_counter() - start
    if plot:
        from smi_core.figures import plot_learning_curve
        name = f"se_L{layers}" + (f"_T{tokens}" if tokens != 2 else "")
        plot_learning_curve(curve, f"{plot}/{name}.png", title=repr(model))
    print(f"\n{model!r}: {len(alphas)} values of α in {seconds:.1f} s "
          f"(samples {samples}, stderr_tol {stderr_tol}, channel nodes {nodes or 'default'}, channel tol {tol}, SE tol {se_tol}, "
          f"threads {threads})")
    print(" alpha   " + "  ".join(f"q_{i + 1}   " for i in range(layers))
          + "pred.err  iters  samples  stderr(q̂)  stderr(q)")
    for r in curve:
        print(f"{r.alpha:6.3f}  " + "  ".join(f"{v:6.4f}" for v in np.diag(r.q))
              + f"  {r.prediction_error:8.4f}  {r.iterations:5d}  {r.samples:7d}  {r.stderr.max():9.2e}"
              f"  {r.q_stderr.max():9.2e}")
    return {"seconds": seconds, "iterations": sum(r.iterations for r in curve),
            "converged": all(r.converged for r in curve),
            "max_q_stderr": max(r.q_stderr.max() for r in curve),
            "met": sum(bool(r.q_stderr.max() <= stderr_tol) for r in curve) if stderr_tol else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--nodes", type=int, default=None, help="channel nodes per dimension")
    p.add_argument("--channel-tol", type=float, default=None, help="channel tolerance per sample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2, help="tokens of the two-layer curve (2 or 3)")
    p.add_argument("--three-layer", action="store_true", help="also the three-layer curve")
    p.add_argument("--three-layer-tol", type=float, default=1e-4,
                   help="SE tolerance of the three-layer curve (its channel is noisier)")
    p.add_argument("--stderr-tol", type=float, default=None,
                   help="grow the draws per α until the standard error of q is below this")
    p.add_argument("--max-samples", type=int, default=1 << 18, help="the draws' ceiling with --stderr-tol")
    p.add_argument("--plot", default=None, metavar="DIR", help="write the figures to DIR")
    a = p.parse_args()
    extra = dict(stderr_tol=a.stderr_tol, max_samples=a.max_samples)
    rows = [(2, "≤ 120 s" if a.tokens == 2 else "-",
             run(2, a.samples, a.nodes, a.channel_tol, a.threads, a.plot, tokens=a.tokens, **extra))]
    if a.three_layer:
        rows.append((3, "≤ 1200 s", run(3, a.samples, a.nodes, a.channel_tol, a.threads, a.plot,
                                        a.three_layer_tol, **extra)))
    print("\nlayers  seconds  target    iterations  all converged  max stderr(q)  stderr(q) ≤ tol")
    for layers, target, r in rows:
        met = "-" if r["met"] is None else f"{r['met']}/40"
        print(f"{layers:6d}  {r['seconds']:7.1f}  {target:8s}  {r['iterations']:10d}  "
              f"{str(r['converged']):13s}  {r['max_q_stderr']:.2e}       {met}")


if __name__ == "__main__":
    main()
