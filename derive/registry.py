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
from .reparam import reparam_program


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
    (tied softmax r = 1)."""
    module = module or f"attention_L{spec.layers}"
    kernels = {"forward": KernelSpec(spec.key + "_forward", module, lambda: forward_program(spec))}
    if spec.differentiable:
        kernels["jacobian"] = KernelSpec(spec.key + "_jacobian", module, lambda: _with_jacobian(spec))
    if spec.layers >= 2 and spec.architecture != "seq2seq":
        kernels["mixing"] = KernelSpec(spec.key + "_mixing", module, lambda: mixing_program(spec))
    if spec.architecture == "tied" and spec.link == "softmax" and spec.rank == 1:
        kernels["reparam"] = KernelSpec(spec.key + "_reparam", "reparam" if module.startswith("attention_L")
                                        else module, lambda: reparam_program(spec))
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
