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


def mixing_layers(prog: Program, spec: AttentionSpec, Z: sp.Matrix, layers: int,
                  product: bool = True) -> tuple[sp.Matrix | None, list[sp.Matrix]]:
    """Φ⁽ˡᵃʸᵉʳˢ⁾ by the recursion Φ⁽ℓ⁾ = (c I + A_ℓ) Φ⁽ℓ⁻¹⁾, one block per layer, and the
    attention matrices [A_1, …].  With ``product=False`` the last product is not formed (None):
    the earlier Φ⁽ℓ⁾ are needed for the logits, Φ⁽ˡᵃʸᵉʳˢ⁾ only by a caller that outputs it."""
    Phi, attention = sp.eye(spec.tokens), []
    for layer in range(layers):
        A = _combine(spec, layer, [softmax(prog, M, BETA) for M in _layer_logits(prog, spec, Phi, Z, layer)])
        attention.append(A)
        if product or layer < layers - 1:
            Phi = _times(prog, SKIP * sp.eye(spec.tokens) + A, Phi, "Phi")
    return (Phi if product else None), attention


def mixing(prog: Program, spec: AttentionSpec, Z: sp.Matrix, layers: int) -> sp.Matrix:
    """Φ⁽ˡᵃʸᵉʳˢ⁾ by the recursion Φ⁽ℓ⁾ = (c I + A_ℓ) Φ⁽ℓ⁻¹⁾, one block per layer."""
    return mixing_layers(prog, spec, Z, layers)[0]


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
    Phi, attention = mixing_layers(prog, spec, Z, spec.layers - 1)
    prog.outputs["phi"] = Phi
    prog.outputs["logdet"] = sp.Matrix([[log_abs_det(prog, spec, attention)[1]]])
    return prog


# -- log|det Φ| and Φ⁻¹v, one layer factor at a time ----------------------------------------------

# A pivot below this is taken as zero when forming the multipliers (no 0/0 or overflow to NaN).
# For tied attention every pivot of c I + A is ≥ c/T (see log_abs_det), so this only ever acts
# when c < T·2⁻⁹⁶⁰ and the factor is singular to working precision.
TINY_PIVOT = sp.Float(2.0 ** -960)


def factorise(prog: Program, B: sp.Matrix) -> tuple[sp.Matrix, sp.Matrix]:
    """B = L U by Gaussian elimination without pivoting, unrolled: (L unit lower, U upper with
    the pivots on its diagonal); every multiplier and Schur-complement entry its own symbol."""
    T = B.shape[0]
    L, U = sp.eye(T), sp.Matrix(B)
    for k in range(T - 1):
        p = U[k, k] = prog.assign("piv", U[k, k])
        for i in range(k + 1, T):
            L[i, k] = l = prog.assign("mul", sp.Piecewise((U[i, k] / p, sp.Abs(p) > TINY_PIVOT), (0, True)))
            U[i, k] = 0
            for j in range(k + 1, T):
                U[i, j] = prog.assign("schur", U[i, j] - l * U[k, j])
    U[T - 1, T - 1] = prog.assign("piv", U[T - 1, T - 1])
    return L, U


def solve(prog: Program, L: sp.Matrix, U: sp.Matrix, b) -> list:
    """x with L U x = b: forward then back substitution (a zero pivot gives a non-finite x)."""
    T = L.shape[0]
    y = []
    for i in range(T):
        y.append(prog.assign("fwd", b[i] - sum((L[i, k] * y[k] for k in range(i)), sp.Integer(0))))
    x = [None] * T
    for i in reversed(range(T)):
        rest = sum((U[i, j] * x[j] for j in range(i + 1, T)), sp.Integer(0))
        x[i] = prog.assign("bwd", (y[i] - rest) / U[i, i])
    return x


def log_abs_det(prog: Program, spec: AttentionSpec, attention: list[sp.Matrix]):
    """log|det Φ| = Σ_ℓ log|det(c I + A_ℓ)| for Φ = Π_ℓ (c I + A_ℓ), one T×T factor at a time
    (never the determinant of the product, whose columns can range over many decades).
    Returns (the LU factors of each c I + A_ℓ, or None per layer, and log|det Φ|).

    Tied attention: Gaussian elimination without pivoting on B = c I + A, log|det B| =
    log|Π_k U_kk|.  This is stable in the sense the tests use, error O(T²·u·κ) with κ the
    condition number of det B under relative perturbations of its entries, because B is
    diagonally similar to a symmetric positive definite matrix.  With E_ts = exp(β(M_ts - m_t))
    (m_t the row maximum, as the softmax computes it), D_t = Σ_s E_ts, A = D⁻¹E, and
    G = diag(exp(βm_t/2)): E = G⁻¹ S G with S_ts = exp(β(M_ts - (m_t + m_s)/2)) symmetric, and
    S is congruent to exp∘(β u uᵀ) (entrywise exp of a Gram matrix: positive semidefinite by
    the Schur product theorem, any rank r).  So B = D⁻¹ G⁻¹ N G with N = c D + S symmetric
    positive definite for c > 0, and elimination without pivoting on B computes, up to these
    diagonal scalings (which change neither the rounding errors' relative size nor κ), the
    LDLᵀ (Cholesky) factorisation of N: backward error |ΔN_ij| ≤ γ·√(N_ii N_jj), hence an
    error in log|det| ≤ γ·Σ_ij |(N⁻¹)_ij| √(N_ii N_jj) ≤ γ·T·κ.  So no pivoting is needed, and
    every pivot is ≥ c/T (a pivot of N is ≥ λ_min(N) ≥ c·min D, divided by D_k ≤ T).  For
    small c and A nearly rank one, det B ≈ c^(T-1)(1+c) does cancel (the pivots after the
    first are differences of O(1) numbers, each ≈ c, so log|det B| is off by ≈ u/c), but
    the conditioning is the same, κ ≈ 2(T-1)/(T c) (A = 11ᵀ/T): a float64 B fixes det B only
    to that accuracy, whatever the formulation from B's entries.

    Untied and multi-head attention (A not similar to a symmetric matrix, and with readout
    weights of either sign not even positive): the Berkowitz determinant of each factor, which
    is normwise stable for that factor (entries O(1), so only its own column scales matter)."""
    logs, factors = [], []
    for A in attention:
        B = SKIP * sp.eye(spec.tokens) + A
        if spec.architecture == "tied":
            L, U = factorise(prog, B)
            factors.append((L, U))
            det = sp.Mul(*[U[k, k] for k in range(spec.tokens)])
        else:
            factors.append(None)
            det = prog.assign("det", prog.assign_matrix("B", B).det(method="berkowitz"))
        logs.append(prog.assign("ldet", sp.log(sp.Abs(det))))
    return factors, prog.assign("logdet", sp.Add(*logs)) if logs else sp.Integer(0)
