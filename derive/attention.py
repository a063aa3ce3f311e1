"""Deep attention with low-rank weights as an SMI link (spec §2).

    Φ⁽⁰⁾ = I_T,   u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ,   Φ⁽ℓ⁾ = (c I_T + σ_β(u_ℓ u_ℓᵀ)) Φ⁽ℓ⁻¹⁾,   y = s(u_L u_Lᵀ)

Architectures (rows of the index matrix H, R×T, layer by layer):
- ``tied``: h_ℓ, r rows per layer (R = L·r).
- ``untied``: keys k_ℓ then queries q_ℓ, 2r rows per layer; logits (Φ q_ℓᵀ)(Φ k_ℓᵀ)ᵀ.
- ``multihead``: per layer, ``heads`` tied heads of r rows each, attention matrices combined with
  fixed readout weights a_ℓk (runtime parameters): A_ℓ = Σ_k a_ℓk σ_β(u_ℓk u_ℓkᵀ).
- ``seq2seq``: tied; the output is Φ⁽ᴸ⁾ itself (X⁽ᴸ⁾ = X Φ⁽ᴸ⁾ᵀ).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .links import DIFFERENTIABLE, LINKS, softmax
from .program import Program

ARCHITECTURES = ("tied", "untied", "multihead", "seq2seq")
SKIP, BETA = sp.symbols("c beta", real=True)


@dataclass(frozen=True)
class AttentionSpec:
    """Structural choices of a deep-attention model (they choose a kernel)."""

    layers: int
    tokens: int
    rank: int = 1
    architecture: str = "tied"
    link: str = "softmax"
    heads: int = 1

    def __post_init__(self):
        for name in ("layers", "tokens", "rank", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {tuple(LINKS)}, got {self.link!r}")
        if self.architecture == "seq2seq" and self.link != "softmax":
            raise ValueError("link must be 'softmax' for architecture='seq2seq' (the output is Φ⁽ᴸ⁾)")
        if self.heads != 1 and self.architecture != "multihead":
            raise ValueError("heads > 1 needs architecture='multihead'")

    @property
    def rows_per_layer(self) -> int:
        return {"untied": 2 * self.rank, "multihead": self.heads * self.rank}.get(self.architecture, self.rank)

    @property
    def indices(self) -> int:
        """R, the number of index rows."""
        return self.layers * self.rows_per_layer

    @property
    def differentiable(self) -> bool:
        return DIFFERENTIABLE[self.link]

    @property
    def key(self) -> str:
        heads = f"_H{self.heads}" if self.architecture == "multihead" else ""
        return (f"attention_{self.architecture}_{self.link}_L{self.layers}_T{self.tokens}"
                f"_r{self.rank}{heads}")

    def readout(self) -> sp.Matrix:
        """Readout weights a_ℓk (multihead only), layers × heads."""
        return sp.Matrix(self.layers, self.heads, lambda l, k: sp.Symbol(f"a_{l}_{k}", real=True))

    def params(self) -> tuple[sp.Symbol, ...]:
        extra = tuple(self.readout()) if self.architecture == "multihead" else ()
        return (SKIP, BETA) + extra


def index_symbols(rows: int, tokens: int, name: str = "z") -> sp.Matrix:
    """The R×T matrix of index symbols ``z_a_t``."""
    return sp.Matrix(rows, tokens, lambda a, t: sp.Symbol(f"{name}_{a}_{t}", real=True))


def _times(prog: Program, A: sp.Matrix, B: sp.Matrix, prefix: str) -> sp.Matrix:
    return prog.assign_matrix(prefix, A * B)


def _logits(prog: Program, spec: AttentionSpec, Phi: sp.Matrix, h: sp.Matrix) -> sp.Matrix:
    """M = u uᵀ with u = Φ hᵀ (tied; symmetric, each entry assigned once) or (Φqᵀ)(Φkᵀ)ᵀ."""
    if spec.architecture == "untied":
        r = spec.rank
        uk, uq = _times(prog, Phi, h[:r, :].T, "uk"), _times(prog, Phi, h[r:, :].T, "uq")
        return _times(prog, uq, uk.T, "M")
    u = _times(prog, Phi, h.T, "u")
    T = spec.tokens
    M = sp.zeros(T, T)
    for t in range(T):
        for s in range(t, T):
            M[t, s] = M[s, t] = prog.assign("M", (u[t, :] * u[s, :].T)[0])
    return M


def _layer_logits(prog, spec, Phi, Z, layer) -> list[sp.Matrix]:
    """The logits of each head of ``layer`` (one head unless multihead)."""
    width, r = spec.rows_per_layer, spec.rank
    rows = Z[layer * width:(layer + 1) * width, :]
    if spec.architecture == "multihead":
        return [_logits(prog, spec, Phi, rows[k * r:(k + 1) * r, :]) for k in range(spec.heads)]
    return [_logits(prog, spec, Phi, rows)]


def _combine(spec, layer, mats) -> sp.Matrix:
    if spec.architecture != "multihead":
        return mats[0]
    a = spec.readout()
    return sum((a[layer, k] * m for k, m in enumerate(mats)), sp.zeros(spec.tokens, spec.tokens))


def mixing(prog: Program, spec: AttentionSpec, Z: sp.Matrix, layers: int) -> sp.Matrix:
    """Φ⁽ˡᵃʸᵉʳˢ⁾ by the recursion Φ⁽ℓ⁾ = (c I + A_ℓ) Φ⁽ℓ⁻¹⁾, one block per layer."""
    Phi = sp.eye(spec.tokens)
    for layer in range(layers):
        A = _combine(spec, layer, [softmax(prog, M, BETA) for M in _layer_logits(prog, spec, Phi, Z, layer)])
        Phi = _times(prog, SKIP * sp.eye(spec.tokens) + A, Phi, "Phi")
    return Phi


def forward_program(spec: AttentionSpec) -> Program:
    """y = g(Z) for the whole network; output ``y`` (T×T)."""
    Z = index_symbols(spec.indices, spec.tokens)
    prog = Program(spec.key + "_forward", {"z": Z}, spec.params(), source="derive.attention.forward_program")
    if spec.architecture == "seq2seq":
        prog.outputs["y"] = mixing(prog, spec, Z, spec.layers)
        return prog
    Phi = mixing(prog, spec, Z, spec.layers - 1)
    link = LINKS[spec.link]
    y = _combine(spec, spec.layers - 1, [link(prog, M, BETA) for M in _layer_logits(prog, spec, Phi, Z, spec.layers - 1)])
    prog.outputs["y"] = y
    return prog


def mixing_program(spec: AttentionSpec) -> Program:
    """Φ⁽ᴸ⁻¹⁾ and log|det Φ⁽ᴸ⁻¹⁾| from the earlier layers' indices h_{<L}."""
    Z = index_symbols((spec.layers - 1) * spec.rows_per_layer, spec.tokens)
    prog = Program(spec.key + "_mixing", {"z": Z}, spec.params(), source="derive.attention.mixing_program")
    Phi = mixing(prog, spec, Z, spec.layers - 1)
    prog.outputs["phi"] = Phi
    prog.outputs["logdet"] = sp.Matrix([[determinant(prog, Phi)[1]]])
    return prog


def determinant(prog: Program, Phi: sp.Matrix):
    """det Φ and log|det Φ| (Berkowitz determinant of the assigned entries)."""
    if Phi == sp.eye(Phi.shape[0]):
        return sp.Integer(1), sp.Integer(0)
    det = prog.assign("det", Phi.det(method="berkowitz"))
    return det, prog.assign("logdet", sp.log(sp.Abs(det)))
