"""The ``smi`` command line.  Every sub-command prints a table, takes ``--json``, and exits 2
with one line on bad input."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .kernels import pregenerated
from .models import DeepAttention


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="depth L (default 2)")
    p.add_argument("--tokens", type=int, default=2, help="sequence length T (default 2)")
    p.add_argument("--rank", type=int, default=1, help="rank r per layer (default 1)")
    p.add_argument("--skip", type=float, default=1.0, help="skip strength c (default 1)")
    p.add_argument("--beta", type=float, default=1.0, help="inverse temperature β (default 1)")
    p.add_argument("--architecture", default="tied", help="tied | untied | multihead | seq2seq")
    p.add_argument("--link", default="softmax", help="last-layer activation: softmax | hardmax | linear")


def _model(a) -> DeepAttention:
    return DeepAttention(layers=a.layers, tokens=a.tokens, rank=a.rank, skip=a.skip, beta=a.beta,
                         architecture=a.architecture, link=a.link)


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    width = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, width))
    return "\n".join([line(keys), line(["-" * w for w in width])] + [line(c) for c in cells])


def cmd_demo(a) -> dict:
    """Forward map, Jacobian and channel reparametrisation of a deep-attention model on random
    indices Z ~ N(0, I): throughput, and the round trip y → ±h_L."""
    model = _model(a)
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
        print(_table(rows))
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
        print(_table(rows))
    return {"kernels": rows}


def cmd_regenerate(a) -> int:
    from codegen.cli import main as regenerate
    return regenerate(a.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smi", description="Fundamental limits of learning deep "
                                     "attention networks and sequence multi-index models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = sub.add_parser("demo", help="forward map, Jacobian and reparametrisation of a deep-attention model")
    _model_args(demo)
    demo.add_argument("--samples", type=int, default=200_000, help="number of random samples")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    kern = sub.add_parser("kernels", help="list the pre-generated compiled kernels")
    kern.set_defaults(func=cmd_kernels)
    for p in (demo, kern):
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
