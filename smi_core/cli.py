"""The ``smi`` command line.  Every sub-command prints a table, takes ``--json``, and exits 2
with one line on bad input."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import cli_aim, cli_gamp, cli_thresholds
from .cliutil import alphas, build_model, model_args, table, write_csv
from .kernels import pregenerated


def cmd_forward(a) -> dict:
    """Forward map, Jacobian and channel reparametrisation of a deep-attention model on random
    indices Z ~ N(0, I): throughput, and the round trip y → ±h_L."""
    model = build_model(a)
    rng = np.random.default_rng(a.seed)
    Z = rng.standard_normal((a.samples, model.indices, model.tokens))
    rows = []
    for kind, call in (("forward", model.forward), ("forward_jacobian", model.forward_jacobian)):
        if kind == "forward_jacobian" and not model.spec.differentiable:
            continue
        call(Z[:10])                     # load (and if needed compile) before timing
        start = time.perf_counter()
        call(Z)
        seconds = time.perf_counter() - start
        rows.append({"kernel": kind, "samples": a.samples, "seconds": seconds,
                     "samples_per_s": a.samples / seconds})
    result = {"model": repr(model), "throughput": rows}
    if "reparam" in model._specs:
        y = model.forward(Z)
        inside = (y > 0).all(axis=(1, 2))       # a row with an exact 0 carries no pre-image
        rep = model.reparametrise(y[inside], Z[inside, :model.layers - 1])
        h_true = Z[inside, model.layers - 1]
        err = np.minimum(np.abs(rep.h - h_true).max(axis=1), np.abs(rep.h + h_true).max(axis=1))
        result["round_trip"] = {"samples": int(inside.sum()), "saturated": int((~inside).sum()),
                                "max_abs_error": float(err.max()), "median_abs_error": float(np.median(err))}
    if not a.json:
        print(result["model"])
        print(table(rows))
        if "round_trip" in result:
            rt = result["round_trip"]
            print(f"round trip y = g(Z) → ±h_L: max |error| {rt['max_abs_error']:.2e}, median "
                  f"{rt['median_abs_error']:.2e} over {rt['samples']} samples "
                  f"({rt['saturated']} with an entry of y underflowing to 0 left out)")
    return result


def cmd_kernels(a) -> dict:
    """The kernels committed under generated/ (name, module, inputs, outputs)."""
    rows = [{"kernel": k, "module": v["module"], "n_in": v["n_in"], "n_out": v["n_out"]}
            for k, v in sorted(pregenerated().items())]
    if not a.json:
        print(table(rows))
    return {"kernels": rows}


def cmd_se(a) -> dict:
    """State evolution over a grid of α (spec §5): overlaps per layer, errors, free entropy."""
    from .state_evolution import MAX_SAMPLES, learning_curve
    model = build_model(a)
    channel = ({"threads": a.threads} | ({"nodes": a.nodes} if a.nodes else {})
               | ({"tol": a.channel_tol} if a.channel_tol else {}))
    start = time.perf_counter()
    curve = learning_curve(model, alphas(a.alphas), start=a.start, samples=a.samples, seed=a.seed,
                           noise=a.noise, side_info=a.side_info, tol=a.tol, max_iter=a.max_iter,
                           damping=a.damping, channel=channel, progress=not a.quiet,
                           control_variate=a.control_variate, stderr_tol=a.stderr_tol,
                           max_samples=a.max_samples or MAX_SAMPLES)
    seconds = time.perf_counter() - start
    rows = [_se_row(r) for r in curve]
    result = {"model": repr(model), "noise": a.noise, "samples": a.samples, "seed": a.seed,
              "seconds": seconds, "points": [r.to_dict() for r in curve]}
    write_csv(a.csv, rows)
    if a.plot:
        from .figures import plot_learning_curve
        plot_learning_curve(curve, a.plot, title=repr(model))
    if not a.json:
        print(result["model"] + (f", noise Δ = {a.noise}" if a.noise else ""))
        print(table(rows))
        print(f"{len(curve)} values of α in {seconds:.1f} s; table written to {a.csv}"
              + (f", figure to {a.plot}" if a.plot else ""))
    return result


def _se_row(r) -> dict:
    row = {"alpha": r.alpha}
    row |= {f"q_{i + 1}": float(v) for i, v in enumerate(np.diag(r.q))}
    row |= {"prediction_error": r.prediction_error, "plugin_error": r.plugin_error,
            "free_entropy": r.free_entropy, "q_stderr": float(r.q_stderr.max()),
            "flagged": r.channel_flagged, "iterations": r.iterations, "samples": r.samples,
            "converged": r.converged, "start": r.start,
            "gap": r.alternative is not None}
    return row


def cmd_regenerate(a) -> int:
    from codegen.cli import main as regenerate
    return regenerate(a.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smi", description="Fundamental limits of learning deep "
                                     "attention networks and sequence multi-index models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_thresholds.add_commands(sub)
    fwd = sub.add_parser("forward", help="throughput of the forward map and Jacobian, and the "
                                         "reparametrisation's round trip y → ±h_L")
    model_args(fwd)
    fwd.add_argument("--samples", type=int, default=200_000, help="number of random samples")
    fwd.add_argument("--seed", type=int, default=0)
    fwd.set_defaults(func=cmd_forward)
    kern = sub.add_parser("kernels", help="list the pre-generated compiled kernels")
    kern.set_defaults(func=cmd_kernels)
    se = sub.add_parser("se", help="state evolution: learning curves over a grid of α")
    model_args(se)
    se.add_argument("--noise", type=float, default=None, help="output noise Δ > 0 (default: noiseless)")
    se.add_argument("--alphas", default="0.05:2:40", help="'start:stop:count' or a list (default 0.05:2:40)")
    se.add_argument("--samples", type=int, default=4096, help="draws of (ξ, ζ) per iteration (default 4096)")
    se.add_argument("--seed", type=int, default=0)
    se.add_argument("--start", default="uninformed", help="uninformed | informed | both (default uninformed)")
    se.add_argument("--side-info", type=float, default=0.0, help="side information λ ≥ 0 (default 0)")
    se.add_argument("--tol", type=float, default=1e-4, help="distance to the fixed point (default 1e-4)")
    se.add_argument("--max-iter", type=int, default=200)
    se.add_argument("--damping", type=float, default=0.0)
    se.add_argument("--control-variate", action="store_true",
                    help="estimate q̂ with the Nishimori control variate (a several times smaller "
                         "standard error where the channel's Jacobian is accurate)")
    se.add_argument("--stderr-tol", type=float, default=None,
                    help="per α, grow the draws until the standard error of q is below this "
                         "(default: off)")
    se.add_argument("--max-samples", type=int, default=None,
                    help="the draws' ceiling with --stderr-tol (default 262144)")
    se.add_argument("--nodes", type=int, default=None, help="channel quadrature nodes per dimension")
    se.add_argument("--channel-tol", type=float, default=None,
                    help="per-sample tolerance of the channel's quadrature (e.g. 1e-2; default: nodes only)")
    se.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: all cores)")
    se.add_argument("--csv", default="se.csv", help="where to write the table (default se.csv)")
    se.add_argument("--plot", default=None, metavar="FILE", help="draw overlaps and errors against α to FILE")
    se.add_argument("--quiet", action="store_true", help="no progress bar")
    se.set_defaults(func=cmd_se)
    cli_gamp.add_commands(sub)
    cli_aim.add_commands(sub)
    for p in sub.choices.values():            # every sub-command, here or from another module, has --json
        p.add_argument("--json", action="store_true", help="print the result as JSON")
    regen = sub.add_parser("regenerate-kernels", help="rewrite generated/ from derive/ (see --help)",
                           add_help=False)
    regen.add_argument("rest", nargs=argparse.REMAINDER)
    regen.set_defaults(func=cmd_regenerate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except ValueError as err:
        print(f"smi {args.command}: error: {err}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
