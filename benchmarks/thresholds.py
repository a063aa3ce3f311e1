"""Weak-recovery thresholds and the phase diagram (issue 5): wall time and precision reached.

- α₂ (the last layer's threshold) of two-layer attention (T = 2, r = 1, c = 1, β = 1) at
  relative precision 1e-3 (standard error / α₂); target ≤ 10 s on 2 cores.
- The staircase (α₂ and α₁) at the default settings of ``staircase``.
- The full phase diagram: 16 skip strengths in [0.01, 4] (geometric), both thresholds at the
  phase-diagram defaults of ``smi phase-diagram`` (8192 draws, rtol 1e-2); target ≤ 10 minutes.

With ``channel={"nodes": 10}`` the reparametrised channel is about twice as fast at q = 0 and
moves α₂ by 4e-6 relative (measured on 2¹⁵ draws), far below the sampling error.

    python benchmarks/thresholds.py [--skip-diagram] [--plot DIR]
"""
import argparse
import time

import numpy as np

from smi_core import DeepAttention
from smi_core.thresholds import phase_diagram, staircase, weak_recovery_threshold


def timed(f, *args, **kwargs):
    start = time.perf_counter()
    out = f(*args, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-diagram", action="store_true", help="leave out the 16-skip phase diagram")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the phase-diagram figure to DIR")
    a = parser.parse_args()
    model = DeepAttention(layers=2, tokens=2)
    rows = []
    th, seconds = timed(weak_recovery_threshold, model, rtol=1e-3)
    rows.append(("α₂, rtol 1e-3", seconds, f"{th.alpha:.5f} ± {th.stderr:.5f}", th.stderr / th.alpha, th.samples))
    th, seconds = timed(weak_recovery_threshold, model, rtol=1e-3, channel={"nodes": 10})
    rows.append(("α₂, rtol 1e-3, channel nodes=10", seconds, f"{th.alpha:.5f} ± {th.stderr:.5f}",
                 th.stderr / th.alpha, th.samples))
    stair, seconds = timed(staircase, model)
    for k, s in enumerate(stair, 1):
        rows.append((f"staircase step {k} (layers {[i + 1 for i in s.indices]})", seconds if k == 1 else np.nan,
                     f"{s.alpha:.5f} ± {s.stderr:.5f}", s.stderr / s.alpha, s.samples))
    if not a.skip_diagram:
        skips = np.geomspace(0.01, 4, 16)
        diagram, seconds = timed(phase_diagram, model, skips, samples=8192, rtol=1e-2)
        rel = diagram.stderr / diagram.alpha
        ordered = bool((diagram.alpha[:, 0] < diagram.alpha[:, 1]).all())
        rows.append((f"phase diagram, 16 skips (α₂ < α₁ everywhere: {ordered})", seconds,
                     f"α₂ {np.nanmin(diagram.alpha[:, 0]):.3f}–{np.nanmax(diagram.alpha[:, 0]):.3f}, "
                     f"α₁ {np.nanmin(diagram.alpha[:, 1]):.3f}–{np.nanmax(diagram.alpha[:, 1]):.3f}",
                     float(np.nanmax(rel)), 8192))
        print("\n  skip c     α₂         ±          α₁         ±")
        for c, al, er in zip(skips, diagram.alpha, diagram.stderr):
            print(f"  {c:7.4f}  {al[0]:.5f}  {er[0]:.5f}  {al[1]:.5f}  {er[1]:.5f}")
        if a.plot:
            from smi_core.figures import plot_phase_diagram
            plot_phase_diagram(diagram, f"{a.plot}/phase_diagram_L2.png", title=f"{model!r}, skip varied")
    print(f"\n{'task':58s} {'seconds':>8s}  {'value':>36s}  {'rel. stderr':>11s}  samples")
    for task, seconds, value, rel, samples in rows:
        print(f"{task:58s} {seconds:8.1f}  {value:>36s}  {rel:11.2e}  {samples}")


if __name__ == "__main__":
    main()
