"""Print a :class:`derive.Program` as one C function (no file I/O here: ``doprint`` returns text).

The body and outputs go through ``sympy.cse`` in canonical order, so the text is deterministic.
Every kernel has the signature

    static inline void NAME_at(const double *in, long si, const double *par, double *out, long so)

with in[k·si] the flattened inputs of one sample (input matrices in order, row-major), ``par``
the runtime parameters and out[k·so] the flattened outputs (in the order of
``program.outputs``): si = so = 1 for one sample's row (the template's ``NAME``), the block's
length for a block of samples stored by columns (its ``NAME_rows``, where the loop over the
samples vectorises).
"""
from __future__ import annotations

import sympy as sp
from sympy.printing.c import C99CodePrinter

from derive.program import Program


class KernelPrinter(C99CodePrinter):
    """C99 with small integer powers as products, reciprocal square roots spelled out, and max
    as ``smi_fmax`` (the template's fmax with a select the vectoriser takes)."""

    def _print_Max(self, expr):
        args = [self._print(a) for a in expr.args]
        text = args[0]
        for a in args[1:]:
            text = f"smi_fmax({text}, {a})"
        return text

    def _print_Pow(self, expr):
        base, exp = expr.args
        if exp == -1:
            return f"(1.0/({self._print(base)}))"
        if exp.is_Integer and 2 <= exp <= 4:
            b = self.parenthesize(base, 100)
            return "(" + "*".join([b] * int(exp)) + ")"
        if exp.is_Integer and -4 <= exp <= -2:
            return f"(1.0/{self._print(sp.Pow(base, -exp, evaluate=False))})"
        if exp == sp.Rational(-1, 2):
            return f"(1.0/sqrt({self._print(base)}))"
        return super()._print_Pow(expr)


def _cse(prog: Program):
    exprs = [e for _, e in prog.body] + prog.output_exprs()
    tmps = sp.numbered_symbols("x", real=True)
    replacements, reduced = sp.cse(exprs, symbols=tmps, order="canonical")
    n = len(prog.body)
    body = [(s, e) for (s, _), e in zip(prog.body, reduced[:n])]
    return replacements, body, reduced[n:]


def doprint(prog: Program, name: str) -> str:
    """The C function ``NAME_at`` of ``prog`` (``name`` is the C identifier of the kernel)."""
    printer = KernelPrinter()
    lines = [f"static inline SMI_INLINE void {name}_at(const double *in, long si, const double *par, double *out, long so)",
             "{"]
    lines += [f"    const double {s} = in[{i}*si];" for i, s in enumerate(prog.input_symbols())]
    lines += [f"    const double {s} = par[{i}];" for i, s in enumerate(prog.params)]
    replacements, body, outs = _cse(prog)
    # cse temporaries and body assignments interleave in dependency order: emit each temporary
    # just before the first statement that needs it.
    pending = list(replacements)
    emitted: set = set(prog.input_symbols()) | set(prog.params)

    def emit(sym, expr):
        lines.append(f"    const double {sym} = {printer.doprint(expr)};")
        emitted.add(sym)

    def flush(expr):
        need = expr.free_symbols - emitted
        while need and pending:
            sym, e = pending.pop(0)
            emit(sym, e)
            need = expr.free_symbols - emitted

    for sym, expr in body:
        flush(expr)
        emit(sym, expr)
    for i, expr in enumerate(outs):
        flush(expr)
        lines.append(f"    out[{i}*so] = {printer.doprint(expr)};")
    lines.append("}")
    return "\n".join(lines)
