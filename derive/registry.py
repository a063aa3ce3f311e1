"""The registry: every model names the kernels it needs and the SymPy programs they come from.

A :class:`KernelSpec` is the unit of code generation: one C function, in one extension module.
``PREGENERATED`` lists the kernels committed under generated/; any other kernel is generated and
compiled on demand (smi_core.kernels).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import sympy as sp

from .attention import AttentionSpec, forward_program, mixing_program
from .program import Program, jacobian
from .reparam import channel_node_program, chart_program, inverse_program, reparam_program


@dataclass(frozen=True)
class KernelSpec:
    name: str                                   # C function and lookup name
    module: str                                 # extension module that holds it
    build: Callable[[], Program] = field(compare=False, repr=False)

    @functools.cached_property
    def program(self) -> Program:
        return self.build()


def _with_jacobian(spec):
    return jacobian(forward_program(spec), of="y", wrt="z", name="dy")


def attention_kernels(spec: AttentionSpec, module: str | None = None) -> dict[str, KernelSpec]:
    """Kernels of a deep-attention model: ``forward`` (y), ``jacobian`` (y and ∂y/∂Z, when the
    link is differentiable), ``mixing`` (Φ⁽ᴸ⁻¹⁾, log|det Φ⁽ᴸ⁻¹⁾|, L ≥ 2) and ``reparam``
    (tied softmax r = 1; with L = 1, T = 2 also ``chart``, derive.reparam.chart_program), and for the route-1 channel ``node`` ([h_L; log|det Φ|] from
    (u_L, h_{<L})), ``node_jacobian`` (its Jacobian in h_{<L}) and ``inverse`` ((Φ⁽ᴸ⁻¹⁾)⁻¹, log|det
    Φ⁽ᴸ⁻¹⁾|, the polar rules' node data), L ≥ 2."""
    module = module or f"attention_L{spec.layers}"
    kernels = {"forward": KernelSpec(spec.key + "_forward", module, lambda: forward_program(spec))}
    if spec.differentiable:
        kernels["jacobian"] = KernelSpec(spec.key + "_jacobian", module, lambda: _with_jacobian(spec))
    if spec.layers >= 2 and spec.architecture != "seq2seq":
        kernels["mixing"] = KernelSpec(spec.key + "_mixing", module, lambda: mixing_program(spec))
    if spec.architecture == "tied" and spec.link == "softmax" and spec.rank == 1:
        channel = "reparam" if module.startswith("attention_L") else module
        kernels["reparam"] = KernelSpec(spec.key + "_reparam", channel, lambda: reparam_program(spec))
        if spec.layers == 1 and spec.tokens == 2:
            kernels["chart"] = KernelSpec(spec.key + "_chart", channel, lambda: chart_program(spec))
        if spec.layers >= 2:
            node = lambda: channel_node_program(spec)
            kernels["node"] = KernelSpec(spec.key + "_node", channel, node)
            kernels["inverse"] = KernelSpec(spec.key + "_inverse", channel, lambda: inverse_program(spec))
            kernels["node_jacobian"] = KernelSpec(spec.key + "_node_jacobian", channel,
                                                  lambda: jacobian(node(), of="hl", wrt="z", name="dhl"))
    return kernels


# -- user-defined links -------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkSpec:
    """A user link y = g(H): ``expr`` is a SymPy matrix in the symbols ``index_symbols(R, T)``
    and the runtime parameters ``params``."""

    name: str
    indices: int
    tokens: int
    expr: sp.Matrix = field(compare=False)
    params: tuple[sp.Symbol, ...] = ()

    @property
    def key(self) -> str:
        return f"link_{self.name}_R{self.indices}_T{self.tokens}"


def link_program(link: LinkSpec) -> Program:
    from .attention import index_symbols
    Z = index_symbols(link.indices, link.tokens)
    prog = Program(link.key + "_forward", {"z": Z}, link.params, source="derive.registry.link_program")
    prog.outputs["y"] = prog.assign_matrix("g", link.expr)
    return prog


def link_kernels(link: LinkSpec) -> dict[str, KernelSpec]:
    forward = lambda: link_program(link)
    return {"forward": KernelSpec(link.key + "_forward", link.key, forward),
            "jacobian": KernelSpec(link.key + "_jacobian", link.key,
                                   lambda: jacobian(forward(), of="y", wrt="z", name="dy"))}


# -- the committed set --------------------------------------------------------------------------

PREGENERATED_SPECS = tuple(AttentionSpec(L, T, r) for L in (1, 2, 3) for T in (2, 3, 4) for r in (1, 2))


def pregenerated() -> list[KernelSpec]:
    """All kernels committed under generated/, in a fixed order."""
    return [k for spec in PREGENERATED_SPECS for k in attention_kernels(spec).values()]


def make_link(name: str, expr, *, indices=None, tokens=None, params=()) -> LinkSpec:
    """A LinkSpec from a SymPy expression or a function ``f(H, *params)``.  ``indices`` and
    ``tokens`` default to the largest index symbol ``z_a_t`` the expression uses."""
    from .attention import index_symbols
    if not name.isidentifier():
        raise ValueError(f"link name must be an identifier, got {name!r}")
    given = [sp.Symbol(p) if isinstance(p, str) else p for p in params]
    params = tuple(sp.Symbol(p.name, real=True) for p in given)
    if callable(expr) and not isinstance(expr, sp.Basic):
        if indices is None or tokens is None:
            raise ValueError("indices and tokens are required when the link is a function")
        expr = expr(index_symbols(indices, tokens), *params)
    expr = sp.Matrix(expr) if isinstance(expr, (list, sp.MatrixBase)) else sp.Matrix([[sp.sympify(expr)]])
    expr = expr.subs(dict(zip(given, params)))
    used = [s for s in expr.free_symbols if s.name.startswith("z_")]
    if indices is None or tokens is None:
        found = [tuple(map(int, s.name.split("_")[1:])) for s in used]
        indices = indices or 1 + max((a for a, _ in found), default=0)
        tokens = tokens or 1 + max((t for _, t in found), default=0)
    allowed = set(index_symbols(indices, tokens)) | set(params)
    stray = sorted(str(s) for s in expr.free_symbols if s not in allowed)
    if stray:
        raise ValueError(f"link {name!r} uses symbols {stray} that are neither index symbols "
                         f"z_a_t (a < {indices}, t < {tokens}) nor declared params")
    return LinkSpec(name, indices, tokens, expr, params)
