"""Straight-line programs: the symbolic form of every kernel.

A :class:`Program` is a list of assignments ``symbol = expression`` (each expression uses only the
inputs, the runtime parameters and earlier symbols), plus named outputs.  Deep models stay small
this way: each mixing step is one block of assignments, never one nested expression.  Jacobians
are derived by the forward-mode chain rule through those assignments (:func:`jacobian`), so their
size grows linearly with depth.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import sympy as sp


@dataclass
class Program:
    """``body`` is the ordered list of ``(symbol, expression)``; ``outputs`` maps a name to a
    matrix of expressions; ``inputs`` maps a name to a matrix of input symbols; ``params`` are the
    runtime scalars (skip c, inverse temperature β, readout weights, …)."""

    name: str
    inputs: dict[str, sp.Matrix]
    params: tuple[sp.Symbol, ...]
    body: list[tuple[sp.Symbol, sp.Expr]] = field(default_factory=list)
    outputs: dict[str, sp.Matrix] = field(default_factory=dict)
    source: str = ""          # the derive/ function that built it (for the DO-NOT-EDIT header)
    constants: set = field(default_factory=set)   # symbols the chain rule holds fixed
    partials: dict = field(default_factory=dict)  # symbol → {dependency: ∂symbol/∂dependency}
    _count: int = 0

    # -- building -----------------------------------------------------------------------------
    def assign(self, prefix: str, expr, constant: bool = False, partials: dict | None = None) -> sp.Expr:
        """Append ``prefix_k = expr`` and return the new symbol; atoms are returned as they are.
        ``constant=True`` marks a value the chain rule holds fixed (a softmax row maximum: the
        softmax is shift-invariant, so the terms through it cancel exactly).  ``partials``
        replaces the chain rule through ``expr`` by given partial derivatives with respect to
        earlier symbols (a form without cancellation, e.g. the saturated softmax)."""
        expr = sp.sympify(expr)
        if expr.is_Atom:
            return expr
        sym = sp.Symbol(f"{prefix}_{self._count}", real=True)
        self._count += 1
        self.body.append((sym, expr))
        if constant:
            self.constants.add(sym)
        if partials is not None:
            self.partials[sym] = dict(partials)
        return sym

    def assign_matrix(self, prefix: str, mat: sp.Matrix) -> sp.Matrix:
        return mat.applyfunc(lambda e: self.assign(prefix, e))

    # -- views ---------------------------------------------------------------------------------
    def input_symbols(self) -> list[sp.Symbol]:
        return [s for m in self.inputs.values() for s in m]

    def output_exprs(self) -> list[sp.Expr]:
        return [e for m in self.outputs.values() for e in m]

    @property
    def n_in(self) -> int:
        return sum(len(m) for m in self.inputs.values())

    @property
    def n_out(self) -> int:
        return sum(len(m) for m in self.outputs.values())

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Output name → shape, in the order the outputs are packed per sample."""
        return {k: m.shape for k, m in self.outputs.items()}

    def source_text(self) -> str:
        """Canonical text of the symbolic source (hashed into MANIFEST.json)."""
        lines = [f"program {self.name}",
                 "inputs " + " ".join(f"{k}{m.shape}:{list(m)}" for k, m in self.inputs.items()),
                 f"params {list(self.params)}"]
        lines += [f"{s} = {sp.srepr(e)}" for s, e in self.body]
        lines += [f"out {k}{m.shape} = {sp.srepr(list(m))}" for k, m in self.outputs.items()]
        return "\n".join(lines)

    def digest(self) -> str:
        return hashlib.sha256(self.source_text().encode()).hexdigest()


def jacobian(prog: Program, of: str, wrt: str, name: str) -> Program:
    """A copy of ``prog`` with the extra output ``name`` = ∂ outputs[of] / ∂ inputs[wrt],
    shape (len(of), len(wrt)), flattened row-major on both sides.

    Forward mode: for each assignment s = f(x, s_<), ds/dx_k = Σ_j ∂f/∂s_j · ds_j/dx_k + ∂f/∂x_k,
    each nonzero partial and each nonzero directional derivative becoming its own assignment.
    Symbols in ``prog.constants`` get no derivative record, so they are held fixed.
    """
    x = list(prog.inputs[wrt])
    tangents: dict[sp.Symbol, dict[int, sp.Expr]] = {s: {k: sp.Integer(1)} for k, s in enumerate(x)}
    out = Program(prog.name + "_" + name, dict(prog.inputs), prog.params, [], {},
                  prog.source, set(prog.constants), dict(prog.partials), prog._count)

    def grad(expr, own=None):
        """Sparse gradient {k: d expr / d x_k} by the chain rule, partials named once."""
        g: dict[int, sp.Expr] = {}
        given = prog.partials.get(own[0]) if own is not None else None
        deps = given.keys() if given is not None else expr.free_symbols
        for dep in sorted(set(deps) & tangents.keys(), key=str):
            if given is not None:
                partial = given[dep]
            else:
                partial = sp.diff(expr, dep)
            if own is not None and given is None:
                partial = partial.subs(own[1], own[0])     # e.g. d exp(a)/da -> the symbol itself
            partial = out.assign("p", partial)
            for k, dk in tangents[dep].items():
                g[k] = g.get(k, 0) + partial * dk
        return g

    for s, e in prog.body:
        out.body.append((s, e))
        if s in prog.constants:
            continue
        if s not in prog.partials and not (e.free_symbols & tangents.keys()):
            continue
        g = grad(e, own=(s, e))
        tangents[s] = {k: out.assign("d", v) for k, v in sorted(g.items()) if v != 0}
    out.outputs = dict(prog.outputs)
    rows = []
    for e in prog.outputs[of]:
        g = grad(e)
        rows.append([out.assign("d", g[k]) if k in g else sp.Integer(0) for k in range(len(x))])
    out.outputs[name] = sp.Matrix(rows)
    return out
