# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Model-independent quadrature over nodes placed on the posterior (the channel moment pass).

For every sample, ∫ f(x) dx is split by a partition of unity over the Laplace modes m,
π_m(x) = q_m(x) / Σ_j q_j(x) with q_j(x) = exp(logh_j - ½ (x - c_j)ᵀ H_j (x - c_j)), and each
piece is integrated by the rule x = c_m + A_m ξ_k (A_m lower triangular):

    ∫ f ≈ Σ_m |det A_m| Σ_k exp(lw_k) π_m(x_mk) f(x_mk),     lw_k = log(w_k / φ(ξ_k)).

From the same pass come the posterior mass, the mean E[Z - ref] and the second moment
E[(Z - ref)(Z - ref)ᵀ] of the R×T index matrix Z (flattened a*T + t), accumulated with a running
maximum of the log weights so nothing overflows.  The integrand comes from a generated kernel:

- route 0 (reparametrised deep attention): x = h_{<L}; kernel (u_L, x) → [h_L; log|det Φ|];
  f(x) = Σ_± N([x; ±h_L]; ω, V) / |det Φ|.
- route 1 (Gaussian output noise Δ): x = Z; kernel x → g(x); f(x) = N(x; ω, V) N(y; g(x), Δ I).

Both kinds of rule evaluate the integrand by columns of nodes, in loops the compiler vectorises
and one kernel call per block (the kernel's columns entry point): the fixed rule by tiles of
nodes (``smi_laplace_tile``), the adaptive rule by the 17 (d = 2) or 57 (d = 4) points of each
Genz–Malik box (``_region``, ``_values``); both share the terms' log weights
(``smi_term_logs``), their weights (``smi_weights``) and the moment sums (``smi_expand``,
``smi_sums``).  Drivers: ``integrate`` (a fixed rule on every partition piece),
``integrate_adaptive`` (Genz–Malik on every piece, to a tolerance; route 1 also on the prior's
piece alone from boxes refined onto the likelihood's ridge, ``_ridge_boxes``), ``integrate_polar``
(route 0, T = 2, x = h_{<L}: polar coordinates about the meeting point of the softmax cliffs,
nodes shared by groups of samples), ``integrate_nodes`` (a product rule given by its rows and
Gauss–Hermite nodes, by the fixed rule's tiles: the noisy route's conditional rule) and
``integrate_polar_adaptive`` (route 0, T = 2, L = 2 or 3: Genz–Malik in (t = |h_1|², θ), and
for L = 3 also (t_2, θ_2) of u_2 = Φ⁽¹⁾h_2, from boxes the caller chose; the same ``_region``,
in polar mode).
"""
from cpython.pycapsule cimport PyCapsule_GetPointer
from cython.parallel cimport prange
from libc.math cimport cos, exp, fabs, fmax, fmin, log, sin, sqrt, INFINITY, M_PI, M_LN2, isfinite
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from openmp cimport omp_get_max_threads

cdef enum:
    POLAR_MAX_LAYERS = 3     # integrate_polar: T = 2, up to two integrated layers
    POLAR_IN_PLACE = 128     # integrate_polar: node ranges this long are tiles of their own, shorter ones gathered

ctypedef void (*kernel_t)(const double*, const double*, double*) noexcept nogil
ctypedef void (*cols_t)(const double*, long, const double*, double*, long, long) noexcept nogil

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #if defined(SMI_MVEC) && defined(__x86_64__) && defined(__GLIBC__)
    /* glibc's vector cos and sin (libmvec, linked where the build defines SMI_MVEC:
       codegen/flags.py): the polar points of the adaptive rule vectorise */
    #pragma omp declare simd notinbranch
    double cos(double);
    #pragma omp declare simd notinbranch
    double sin(double);
    #endif
    /* e^x for -500 < x <= 0 (0 below: SMI_EXP_FLUSH), inlined and vectorisable with AVX2 as with AVX-512
       (no double -> int64 conversion, no table gather): x = k ln2 + r with |r| <= ln2/2
       (Cody-Waite, k ln2_hi exact for |k| < 2^21), k = round(x/ln2) read from the low bits of
       x/ln2 + 1.5*2^52, e^x = 2^k e^r with e^r by its Taylor polynomial of degree 13
       (truncation < 2e-16; Estrin's scheme, short dependency chains).  Relative error
       <= 4.4e-16 against libm on [-700, 0]; the weights of the moment sums are all e^(lw - max)
       with lw - max in [-45, 0], so this replaces a libm call per term.  The clamp is a select
       only under -fno-trapping-math (setup.py), which the vectoriser needs.  smi_exp_neg9: the
       polynomial of degree 9 (truncation (ln2/2)^10/10! < 8e-12 relative), for the three-layer
       moments (relative 1e-4 targets).  Below e^-500 the result is 0, not e^-700: a term that
       small beside the largest adds nothing to the sums, but e^-700 times a rule's weight or a
       moment is subnormal, and every operation on a subnormal takes a microcode assist (the
       negligible reflections of each adaptive box made the Genz-Malik rule 6-7x slower: 21.5
       against 3 us per box, two layers at q = diag(0, 0.9999); the moments are the same bit for
       bit).  Always inlined: called as a function (gcc's choice once the polar kernels had two
       copies each) it keeps the loops that call it scalar, 2.5x slower. */
    #define SMI_EXP_FLUSH -500.0
    static inline __attribute__((always_inline)) double smi_exp_poly(double x, int full) {
        x = x > -700.0 ? x : -700.0;                       /* e^-700 ~ 1e-304 */
        const double shift = 6755399441055744.0;           /* 1.5 * 2^52: round to nearest */
        double kd = x * 1.4426950408889634 + shift;
        double k = kd - shift;
        double r = (x - k * 0.6931471803691238) - k * 1.9082149292705877e-10;
        double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
        double tail = 2.4801587301587302e-05 + r * 2.7557319223985893e-06;    /* r^8, r^9 */
        if (full)
            tail += r2 * (2.7557319223985888e-07 + r * 2.5052108385441720e-08)
                  + r4 * (2.0876756987868100e-09 + r * 1.6059043836821613e-10);
        double p = ((1.0 + r) + r2 * (0.5 + r * 1.6666666666666666e-01))
                 + r4 * ((4.1666666666666664e-02 + r * 8.3333333333333332e-03)
                         + r2 * (1.3888888888888889e-03 + r * 1.9841269841269841e-04))
                 + r8 * tail;
        uint64_t bits;                                      /* low 12 bits: k mod 2^12 */
        memcpy(&bits, &kd, sizeof bits);
        bits = (bits + 1023) << 52;                         /* the exponent field k + 1023 */
        double two_k;
        memcpy(&two_k, &bits, sizeof two_k);
        return x > SMI_EXP_FLUSH ? p * two_k : 0.0;
    }
    static inline double smi_exp_neg(double x) { return smi_exp_poly(x, 1); }
    static inline double smi_exp_neg9(double x) { return smi_exp_poly(x, 0); }

    /* The polar node loops (integrate_polar, L = 2 and 3, T = 2) for one sample over K of its
       shared nodes, stored by columns (column j of node k at nodes[j * stride + k]: every
       loop below reads contiguous memory and vectorises), in two passes: (1) h_L = Phi^-1 u_L
       and the log weights of the 2^L terms Z = [s_1 x_1; ...; s_L x_L] (x_l = h_l, each layer
       reflected or not, s_l = +-1; term p has s_l = -1 when bit l - 1 of p is set), kept in
       the columns of buf (SMI_TILE rows), and their maximum mx; (2) the weights e^(lw - mx),
       their signed sums (``smi_signed2``, ``smi_signed3``: factored where V is diagonal) and the
       moment sums, out = [s0, s1, the upper triangle of s2 row by row] about omega and
       relative to e^mx; returns mx.  Pass (2) is skipped, out left as it is, when mx < floor
       (the caller's running maximum - SMI_SKIP: the tile's weights are all below e^-SMI_SKIP
       of a node already summed).  Nodes with a non-finite h or log constant (det Phi = 0)
       weigh 0.

       The reflections only flip signs.  With P = V^-1 (per layer, tokens alike) and v = P omega,
           (Z - omega)' P (Z - omega) = sum_l P_ll |x_l|^2 + omega' P omega - 2 sum_l s_l v_l.x_l
                                        + 2 sum_{l<l'} s_l s_l' P_ll' x_l.x_l',
       and about 0 the moment sums need only the signed sums D_A = sum_p (prod_{l in A} s_l) w_p
       (a Walsh-Hadamard transform of the 2^L weights): s0 = D_{}, s1_l = D_l x_l,
       s2_ll = D_{} x_l x_l', s2_ll' = D_ll' x_l x_l''.  At the end of the tile they move to
       omega (``smi_about``; the polar rules run where the posterior is broad, so little
       cancels). */
    #define SMI_TILE 256
    #define SMI_SKIP 45.0       /* 256 e^-45 = 7e-18: thousands of skipped tiles stay below 1e-14 */
    #define SMI_FINITE(x) (fabs(x) <= 1.7976931348623157e308)
    #define SMI_MAX(a, b) ((a) > (b) ? (a) : (b))

    /* The signed sums D_A of a node's 2^L weights e^(w_p - mx) (W: the tile's rows, SMI_TILE
       apart).  In general by the Walsh-Hadamard transform of the weights (W rows w_p, bit l - 1 of
       p: s_l = -1).  With V diagonal (``diag``: P_ll' = 0 for l != l') a term's log weight is
       c + sum_l s_l a_l and the sums factor, D_A = e^c prod_{l in A} 2 sinh a_l prod_{l not in A}
       2 cosh a_l: from W rows [top = c + sum_l |a_l|, a_1, .., a_L], D_A = e^(top - mx) prod_{l in
       A} S_l prod_{l not in A} C_l with C_l = 1 + e^(-2|a_l|), S_l = sign(a_l) (1 - e^(-2|a_l|)):
       1 + L exponentials instead of 2^L.  ``full``: the exponentials' degree (``smi_exp_poly``). */
    static inline __attribute__((always_inline)) void smi_factor(double a, int full, double* c, double* s) {
        double t = smi_exp_poly(-2.0 * fabs(a), full);
        *c = 1.0 + t;
        *s = a < 0 ? t - 1.0 : 1.0 - t;
    }

    /* Two layers: W rows [w_00, w_10, w_01, w_11] (or, with diag, [top, a_1, a_2]) become
       [D, D_1, D_2, D_12], in place. */
    static inline __attribute__((always_inline)) void smi_signed2(int diag, long K, double mx, double* restrict W) {
        if (diag) {
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                double c1, s1, c2, s2, E = smi_exp_neg(W[k] - mx);
                smi_factor(W[SMI_TILE + k], 1, &c1, &s1);
                smi_factor(W[2 * SMI_TILE + k], 1, &c2, &s2);
                W[k] = E * c1 * c2; W[SMI_TILE + k] = E * s1 * c2;
                W[2 * SMI_TILE + k] = E * c1 * s2; W[3 * SMI_TILE + k] = E * s1 * s2;
            }
            return;
        }
        #pragma omp simd
        for (long k = 0; k < K; k++) {
            double w0 = smi_exp_neg(W[k] - mx), w1 = smi_exp_neg(W[SMI_TILE + k] - mx);
            double w2 = smi_exp_neg(W[2 * SMI_TILE + k] - mx), w3 = smi_exp_neg(W[3 * SMI_TILE + k] - mx);
            double a0 = w0 + w1, a1 = w0 - w1, a2 = w2 + w3, a3 = w2 - w3;
            W[k] = a0 + a2; W[SMI_TILE + k] = a1 + a3; W[2 * SMI_TILE + k] = a0 - a2; W[3 * SMI_TILE + k] = a1 - a3;
        }
    }

    /* Three layers: W rows w_p (or, with diag, [top, a_1, a_2, a_3]) become [D, D_1, D_2, D_12,
       D_3, D_13, D_23], in place; exponentials of degree 9 (``smi_exp_neg9``). */
    static inline __attribute__((always_inline)) void smi_signed3(int diag, long K, double mx, double* restrict W) {
        if (diag) {
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                double c1, s1, c2, s2, c3, s3, E = smi_exp_neg9(W[k] - mx);
                smi_factor(W[SMI_TILE + k], 0, &c1, &s1);
                smi_factor(W[2 * SMI_TILE + k], 0, &c2, &s2);
                smi_factor(W[3 * SMI_TILE + k], 0, &c3, &s3);
                double e1 = E * c1, f1 = E * s1;
                W[k] = e1 * c2 * c3; W[SMI_TILE + k] = f1 * c2 * c3; W[2 * SMI_TILE + k] = e1 * s2 * c3;
                W[3 * SMI_TILE + k] = f1 * s2 * c3; W[4 * SMI_TILE + k] = e1 * c2 * s3;
                W[5 * SMI_TILE + k] = f1 * c2 * s3; W[6 * SMI_TILE + k] = e1 * s2 * s3;
            }
            return;
        }
        #pragma omp simd
        for (long k = 0; k < K; k++) {
            double w0 = smi_exp_neg9(W[k] - mx), w1 = smi_exp_neg9(W[SMI_TILE + k] - mx);
            double w2 = smi_exp_neg9(W[2 * SMI_TILE + k] - mx), w3 = smi_exp_neg9(W[3 * SMI_TILE + k] - mx);
            double w4 = smi_exp_neg9(W[4 * SMI_TILE + k] - mx), w5 = smi_exp_neg9(W[5 * SMI_TILE + k] - mx);
            double w6 = smi_exp_neg9(W[6 * SMI_TILE + k] - mx), w7 = smi_exp_neg9(W[7 * SMI_TILE + k] - mx);
            double a0 = w0 + w1, a1 = w0 - w1, a2 = w2 + w3, a3 = w2 - w3;
            double a4 = w4 + w5, a5 = w4 - w5, a6 = w6 + w7, a7 = w6 - w7;
            double b0 = a0 + a2, b1 = a1 + a3, b2 = a0 - a2, b3 = a1 - a3;
            double b4 = a4 + a6, b5 = a5 + a7, b6 = a4 - a6, b7 = a5 - a7;
            W[k] = b0 + b4; W[SMI_TILE + k] = b1 + b5; W[2 * SMI_TILE + k] = b2 + b6; W[3 * SMI_TILE + k] = b3 + b7;
            W[4 * SMI_TILE + k] = b0 - b4; W[5 * SMI_TILE + k] = b1 - b5; W[6 * SMI_TILE + k] = b2 - b6;
        }
    }

    /* The polar kernels' bodies (``smi_polar2_by`` ...), inlined into their entry points twice,
       once with diag = 1 and once with 0, so that each copy's loops vectorise without the branch. */
    #define SMI_INLINE static inline __attribute__((always_inline))

    /* v = P omega and omega' P omega for L layers of 2 tokens (P: L x L, row-major). */
    static double smi_form(const double* P, const double* om, int L, double* v) {
        double quad = 0.0;
        for (int l = 0; l < L; l++)
            for (int t = 0; t < 2; t++) {
                v[2 * l + t] = 0.0;
                for (int j = 0; j < L; j++)
                    v[2 * l + t] += P[L * l + j] * om[2 * j + t];
                quad += om[2 * l + t] * v[2 * l + t];
            }
        return quad;
    }

    /* out = [s0, s1 (d), the upper triangle of s2 (row by row)] about omega from sums about 0. */
    static void smi_about(double s0, const double* m, const double* q, const double* om, int d,
                          double* out) {
        out[0] = s0;
        for (int i = 0, r = 0; i < d; i++)
            for (int j = i; j < d; j++, r++)
                out[1 + d + r] = q[r] - m[i] * om[j] - om[i] * m[j] + s0 * om[i] * om[j];
        for (int i = 0; i < d; i++)
            out[1 + i] = m[i] - s0 * om[i];
    }

    /* L = 2: node columns [x (2), log weight, Phi^-1 (row-major), log|det Phi|] at m = 2, and
       with output noise delta > 0 [h_1 (2), u_2 (2), log weight, Phi^-1, log|det Phi|, g (4)]
       at m = 4 (u is then the sample's y: lc -= |y - g|^2 / 2 delta, h_2 = Phi^-1 u_2 of the
       node); buf columns h_2 (2), lc, the log weights (4). */
    SMI_INLINE double smi_polar2_by(const double* restrict u, const double* restrict om,
                                    const double* restrict P, double const0, double delta,
                                    const double* restrict nodes, long stride, long K, int m,
                                    double floor, double* restrict buf, double* restrict out, int diag) {
        const double p11 = P[0], p12 = P[1], p22 = P[3];
        double v[4];
        const double base0 = const0 - 0.5 * smi_form(P, om, 2, v);
        const double* restrict X0 = nodes;
        const double* restrict X1 = nodes + stride;
        const double* restrict LW = nodes + m * stride;
        const double* restrict F00 = LW + stride;
        const double* restrict F01 = LW + 2 * stride;
        const double* restrict F10 = LW + 3 * stride;
        const double* restrict F11 = LW + 4 * stride;
        const double* restrict LD = LW + 5 * stride;
        double* restrict H0 = buf;
        double* restrict H1 = buf + SMI_TILE;
        double* restrict LC = buf + 2 * SMI_TILE;
        double* restrict W = buf + 3 * SMI_TILE;
        if (delta > 0) {
            const double* restrict U0 = nodes + 2 * stride;
            const double* restrict U1 = nodes + 3 * stride;
            const double* restrict G = LW + 6 * stride;
            const double y0 = u[0], y1 = u[1], y2 = u[2], y3 = u[3], c = 0.5 / delta;
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                double e0 = y0 - G[k], e1 = y1 - G[stride + k], e2 = y2 - G[2 * stride + k], e3 = y3 - G[3 * stride + k];
                LC[k] = base0 + LW[k] - LD[k] - c * (e0 * e0 + e1 * e1 + e2 * e2 + e3 * e3);
                H0[k] = F00[k] * U0[k] + F01[k] * U1[k];
                H1[k] = F10[k] * U0[k] + F11[k] * U1[k];
            }
        } else {
            const double u0 = u[0], u1 = u[1];
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                LC[k] = base0 + LW[k] - LD[k];
                H0[k] = F00[k] * u0 + F01[k] * u1;
                H1[k] = F10[k] * u0 + F11[k] * u1;
            }
        }
        double mx = -INFINITY;
        #pragma omp simd reduction(max: mx)
        for (long k = 0; k < K; k++) {
            int ok = SMI_FINITE(H0[k]) && SMI_FINITE(H1[k]) && SMI_FINITE(LC[k]);
            double h0 = ok ? H0[k] : 0.0, h1 = ok ? H1[k] : 0.0, lc = ok ? LC[k] : -INFINITY;
            H0[k] = h0; H1[k] = h1;
            double x0 = X0[k], x1 = X1[k];
            /* log weight = c + s_1 a_1 + s_2 a_2 - s_1 s_2 b */
            double c = lc - 0.5 * (p11 * (x0 * x0 + x1 * x1) + p22 * (h0 * h0 + h1 * h1));
            double a1 = v[0] * x0 + v[1] * x1, a2 = v[2] * h0 + v[3] * h1, b = p12 * (x0 * h0 + x1 * h1);
            double w00 = c + a1 + a2 - b, w01 = c + a1 - a2 + b;
            double w10 = c - a1 + a2 + b, w11 = c - a1 - a2 - b;
            double t = SMI_MAX(SMI_MAX(w00, w01), SMI_MAX(w10, w11));
            W[k] = diag ? t : w00; W[SMI_TILE + k] = diag ? a1 : w10;      /* diag: top, a_1, a_2 */
            W[2 * SMI_TILE + k] = diag ? a2 : w01;
            if (!diag)                  /* diag: row 3 is the signed sums' only */
                W[3 * SMI_TILE + k] = w11;
            mx = t > mx ? t : mx;
        }
        if (mx < floor)                 /* the whole tile is negligible: no second pass */
            return mx;
        smi_signed2(diag, K, mx, W);
        double s0 = 0, m0 = 0, m1 = 0, m2 = 0, m3 = 0;
        double q00 = 0, q01 = 0, q11 = 0, q22 = 0, q23 = 0, q33 = 0, q02 = 0, q03 = 0, q12 = 0, q13 = 0;
        #pragma omp simd reduction(+: s0, m0, m1, m2, m3, q00, q01, q11, q22, q23, q33, q02, q03, q12, q13)
        for (long k = 0; k < K; k++) {
            double x0 = X0[k], x1 = X1[k], x2 = H0[k], x3 = H1[k];
            double D = W[k], D1 = W[SMI_TILE + k], D2 = W[2 * SMI_TILE + k], D12 = W[3 * SMI_TILE + k];
            double Sx0 = D * x0, Sx1 = D * x1, Sx2 = D * x2, Sx3 = D * x3, A0 = D12 * x0, A1 = D12 * x1;
            s0 += D;
            m0 += D1 * x0; m1 += D1 * x1; m2 += D2 * x2; m3 += D2 * x3;
            q00 += Sx0 * x0; q01 += Sx0 * x1; q11 += Sx1 * x1;
            q22 += Sx2 * x2; q23 += Sx2 * x3; q33 += Sx3 * x3;
            q02 += A0 * x2; q03 += A0 * x3; q12 += A1 * x2; q13 += A1 * x3;
        }
        double sm[4] = {m0, m1, m2, m3}, sq[10] = {q00, q01, q02, q03, q11, q12, q13, q22, q23, q33};
        smi_about(s0, sm, sq, om, 4, out);
        return mx;
    }

    /* L = 2, T = 3, route 0 (the spherical rule): node columns [x = h_1 (3), log weight,
       Phi^-1 (3 x 3, row-major), log|det Phi|]; buf columns h_2 (3) and the log weights (4);
       the terms and the Walsh-Hadamard sums as in smi_polar2. */
    SMI_INLINE double smi_sphere2_by(const double* restrict u, const double* restrict om,
                                     const double* restrict P, double const0,
                                     const double* restrict nodes, long stride, long K, double floor,
                                     double* restrict buf, double* restrict out, int diag) {
        const double p11 = P[0], p12 = P[1], p22 = P[3];
        const double u0 = u[0], u1 = u[1], u2 = u[2];
        double v[6], quad = 0.0;
        for (int t = 0; t < 3; t++) {
            v[t] = p11 * om[t] + p12 * om[3 + t];
            v[3 + t] = p12 * om[t] + p22 * om[3 + t];
            quad += om[t] * v[t] + om[3 + t] * v[3 + t];
        }
        const double base0 = const0 - 0.5 * quad;
        const double* restrict X0 = nodes;
        const double* restrict X1 = nodes + stride;
        const double* restrict X2 = nodes + 2 * stride;
        const double* restrict LW = nodes + 3 * stride;
        const double* restrict F = LW + stride;              /* F[(3 i + j) stride + k] */
        const double* restrict LD = LW + 10 * stride;
        double* restrict H0 = buf;
        double* restrict H1 = buf + SMI_TILE;
        double* restrict H2 = buf + 2 * SMI_TILE;
        double* restrict W = buf + 3 * SMI_TILE;
        double mx = -INFINITY;
        #pragma omp simd reduction(max: mx)
        for (long k = 0; k < K; k++) {
            double lc = base0 + LW[k] - LD[k];
            double h0 = F[k] * u0 + F[stride + k] * u1 + F[2 * stride + k] * u2;
            double h1 = F[3 * stride + k] * u0 + F[4 * stride + k] * u1 + F[5 * stride + k] * u2;
            double h2 = F[6 * stride + k] * u0 + F[7 * stride + k] * u1 + F[8 * stride + k] * u2;
            int ok = SMI_FINITE(h0) & SMI_FINITE(h1) & SMI_FINITE(h2) & SMI_FINITE(lc);
            h0 = ok ? h0 : 0.0; h1 = ok ? h1 : 0.0; h2 = ok ? h2 : 0.0; lc = ok ? lc : -INFINITY;
            H0[k] = h0; H1[k] = h1; H2[k] = h2;
            double x0 = X0[k], x1 = X1[k], x2 = X2[k];
            double c = lc - 0.5 * (p11 * (x0 * x0 + x1 * x1 + x2 * x2) + p22 * (h0 * h0 + h1 * h1 + h2 * h2));
            double a1 = v[0] * x0 + v[1] * x1 + v[2] * x2, a2 = v[3] * h0 + v[4] * h1 + v[5] * h2;
            double b = p12 * (x0 * h0 + x1 * h1 + x2 * h2);
            double w00 = c + a1 + a2 - b, w01 = c + a1 - a2 + b;
            double w10 = c - a1 + a2 + b, w11 = c - a1 - a2 - b;
            double t = SMI_MAX(SMI_MAX(w00, w01), SMI_MAX(w10, w11));
            W[k] = diag ? t : w00; W[SMI_TILE + k] = diag ? a1 : w10;      /* diag: top, a_1, a_2 */
            W[2 * SMI_TILE + k] = diag ? a2 : w01;
            if (!diag)                  /* diag: row 3 is the signed sums' only */
                W[3 * SMI_TILE + k] = w11;
            mx = t > mx ? t : mx;
        }
        if (mx < floor)
            return mx;
        smi_signed2(diag, K, mx, W);
        double s0 = 0, m0 = 0, m1 = 0, m2 = 0, m3 = 0, m4 = 0, m5 = 0;
        double q00 = 0, q01 = 0, q02 = 0, q11 = 0, q12 = 0, q22 = 0;       /* x xᵀ */
        double q33 = 0, q34 = 0, q35 = 0, q44 = 0, q45 = 0, q55 = 0;       /* h hᵀ */
        double q03 = 0, q04 = 0, q05 = 0, q13 = 0, q14 = 0, q15 = 0, q23 = 0, q24 = 0, q25 = 0;
        #pragma omp simd reduction(+: s0, m0, m1, m2, m3, m4, m5, q00, q01, q02, q11, q12, q22, q33, q34, q35, q44, q45, q55, q03, q04, q05, q13, q14, q15, q23, q24, q25)
        for (long k = 0; k < K; k++) {
            double x0 = X0[k], x1 = X1[k], x2 = X2[k], x3 = H0[k], x4 = H1[k], x5 = H2[k];
            double D = W[k], D1 = W[SMI_TILE + k], D2 = W[2 * SMI_TILE + k], D12 = W[3 * SMI_TILE + k];
            double Sx0 = D * x0, Sx1 = D * x1, Sx2 = D * x2, Sx3 = D * x3, Sx4 = D * x4, Sx5 = D * x5;
            double A0 = D12 * x0, A1 = D12 * x1, A2 = D12 * x2;
            s0 += D;
            m0 += D1 * x0; m1 += D1 * x1; m2 += D1 * x2; m3 += D2 * x3; m4 += D2 * x4; m5 += D2 * x5;
            q00 += Sx0 * x0; q01 += Sx0 * x1; q02 += Sx0 * x2; q11 += Sx1 * x1; q12 += Sx1 * x2; q22 += Sx2 * x2;
            q33 += Sx3 * x3; q34 += Sx3 * x4; q35 += Sx3 * x5; q44 += Sx4 * x4; q45 += Sx4 * x5; q55 += Sx5 * x5;
            q03 += A0 * x3; q04 += A0 * x4; q05 += A0 * x5; q13 += A1 * x3; q14 += A1 * x4; q15 += A1 * x5;
            q23 += A2 * x3; q24 += A2 * x4; q25 += A2 * x5;
        }
        double sm[6] = {m0, m1, m2, m3, m4, m5};
        double sq[21] = {q00, q01, q02, q03, q04, q05, q11, q12, q13, q14, q15, q22, q23, q24, q25,
                         q33, q34, q35, q44, q45, q55};
        smi_about(s0, sm, sq, om, 6, out);
        return mx;
    }

    /* L = 3, route 0: node columns [x = (h_1, h_2) (4), log weight, Phi^-1 (row-major),
       log|det Phi|]; buf columns h_3 (2) and the log weights (8). */
    SMI_INLINE double smi_polar3_by(const double* restrict u, const double* restrict om,
                                    const double* restrict P, double const0,
                                    const double* restrict nodes, long stride, long K, double floor,
                                    double* restrict buf, double* restrict out, int diag) {
        const double u0 = u[0], u1 = u[1];
        const double* restrict X0 = nodes;
        const double* restrict X1 = nodes + stride;
        const double* restrict X2 = nodes + 2 * stride;
        const double* restrict X3 = nodes + 3 * stride;
        const double* restrict LW = nodes + 4 * stride;
        const double* restrict F00 = nodes + 5 * stride;
        const double* restrict F01 = nodes + 6 * stride;
        const double* restrict F10 = nodes + 7 * stride;
        const double* restrict F11 = nodes + 8 * stride;
        const double* restrict LD = nodes + 9 * stride;
        double* restrict H0 = buf;
        double* restrict H1 = buf + SMI_TILE;
        double* restrict W = buf + 2 * SMI_TILE;
        const double p00 = P[0], p11 = P[4], p22 = P[8], p01 = P[1], p02 = P[2], p12 = P[5];
        double v[6];
        const double base0 = const0 - 0.5 * smi_form(P, om, 3, v);
        double mx = -INFINITY;
        #pragma omp simd reduction(max: mx)
        for (long k = 0; k < K; k++) {
            double lc = base0 + LW[k] - LD[k];
            double h0 = F00[k] * u0 + F01[k] * u1, h1 = F10[k] * u0 + F11[k] * u1;
            int ok = SMI_FINITE(h0) & SMI_FINITE(h1) & SMI_FINITE(lc);   /* else the node weighs 0 */
            h0 = ok ? h0 : 0.0; h1 = ok ? h1 : 0.0; lc = ok ? lc : -INFINITY;
            H0[k] = h0; H1[k] = h1;
            double x0 = X0[k], x1 = X1[k], x2 = X2[k], x3 = X3[k];
            double c = lc - 0.5 * (p00 * (x0 * x0 + x1 * x1) + p11 * (x2 * x2 + x3 * x3) + p22 * (h0 * h0 + h1 * h1));
            /* log weight = c + sum_l s_l a_l - sum_{l<l'} s_l s_l' b_ll' */
            double a1 = v[0] * x0 + v[1] * x1, a2 = v[2] * x2 + v[3] * x3, a3 = v[4] * h0 + v[5] * h1;
            double b12 = p01 * (x0 * x2 + x1 * x3), b13 = p02 * (x0 * h0 + x1 * h1), b23 = p12 * (x2 * h0 + x3 * h1);
            double g00 = c + a1 + a2 - b12, g10 = c - a1 + a2 + b12;      /* g{s1}{s2}: layers 1, 2 */
            double g01 = c + a1 - a2 + b12, g11 = c - a1 - a2 - b12;
            double e00 = a3 - b13 - b23, e10 = a3 + b13 - b23;            /* e{s1}{s2}: s3 a3 - ... */
            double e01 = a3 - b13 + b23, e11 = a3 + b13 + b23;
            double w0 = g00 + e00, w1 = g10 + e10, w2 = g01 + e01, w3 = g11 + e11;
            double w4 = g00 - e00, w5 = g10 - e10, w6 = g01 - e01, w7 = g11 - e11;
            double t = SMI_MAX(SMI_MAX(SMI_MAX(w0, w1), SMI_MAX(w2, w3)), SMI_MAX(SMI_MAX(w4, w5), SMI_MAX(w6, w7)));
            W[k] = diag ? t : w0; W[SMI_TILE + k] = diag ? a1 : w1;        /* diag: top, a_1 .. a_3 */
            W[2 * SMI_TILE + k] = diag ? a2 : w2; W[3 * SMI_TILE + k] = diag ? a3 : w3;
            if (!diag) {                /* diag: rows 4 .. 6 are the signed sums' only */
                W[4 * SMI_TILE + k] = w4; W[5 * SMI_TILE + k] = w5; W[6 * SMI_TILE + k] = w6; W[7 * SMI_TILE + k] = w7;
            }
            mx = t > mx ? t : mx;
        }
        if (mx < floor)                 /* the whole tile is negligible: no second pass */
            return mx;
        smi_signed3(diag, K, mx, W);
        double s0 = 0, m0 = 0, m1 = 0, m2 = 0, m3 = 0, m4 = 0, m5 = 0, q00 = 0, q01 = 0, q02 = 0, q03 = 0, q04 = 0, q05 = 0, q11 = 0, q12 = 0, q13 = 0, q14 = 0, q15 = 0, q22 = 0, q23 = 0, q24 = 0, q25 = 0, q33 = 0, q34 = 0, q35 = 0, q44 = 0, q45 = 0, q55 = 0;
        #pragma omp simd reduction(+: s0, m0, m1, m2, m3, m4, m5, q00, q01, q02, q03, q04, q05, q11, q12, q13, q14, q15, q22, q23, q24, q25, q33, q34, q35, q44, q45, q55)
        for (long k = 0; k < K; k++) {
            double x0 = X0[k], x1 = X1[k], x2 = X2[k], x3 = X3[k], x4 = H0[k], x5 = H1[k];
            double D = W[k], D1 = W[SMI_TILE + k], D2 = W[2 * SMI_TILE + k], D12 = W[3 * SMI_TILE + k];
            double D3 = W[4 * SMI_TILE + k], D13 = W[5 * SMI_TILE + k], D23 = W[6 * SMI_TILE + k];
            double Sx0 = D * x0, Sx1 = D * x1, Sx2 = D * x2, Sx3 = D * x3, Sx4 = D * x4, Sx5 = D * x5;
            double A0 = D12 * x0, A1 = D12 * x1, B0 = D13 * x0, B1 = D13 * x1, C2 = D23 * x2, C3 = D23 * x3;
            s0 += D;
            m0 += D1 * x0; m1 += D1 * x1; m2 += D2 * x2; m3 += D2 * x3; m4 += D3 * x4; m5 += D3 * x5;
            q00 += Sx0 * x0; q01 += Sx0 * x1; q11 += Sx1 * x1;
            q22 += Sx2 * x2; q23 += Sx2 * x3; q33 += Sx3 * x3;
            q44 += Sx4 * x4; q45 += Sx4 * x5; q55 += Sx5 * x5;
            q02 += A0 * x2; q03 += A0 * x3; q12 += A1 * x2; q13 += A1 * x3;
            q04 += B0 * x4; q05 += B0 * x5; q14 += B1 * x4; q15 += B1 * x5;
            q24 += C2 * x4; q25 += C2 * x5; q34 += C3 * x4; q35 += C3 * x5;
        }
        double sm[6] = {m0, m1, m2, m3, m4, m5};
        double sq[21] = {q00, q01, q02, q03, q04, q05, q11, q12, q13, q14, q15, q22, q23, q24, q25, q33, q34, q35, q44, q45, q55};
        smi_about(s0, sm, sq, om, 6, out);
        return mx;
    }

    /* The entry points: each kernel with diag = 1 where P has no off-diagonal entries
       (``smi_signed2``, ``smi_signed3``), else 0 — two copies, each with its loops vectorised. */
    static double smi_polar2(const double* u, const double* om, const double* P, double const0,
                             double delta, const double* nodes, long stride, long K, int m,
                             double floor, double* buf, double* out) {
        return P[1] == 0.0 ? smi_polar2_by(u, om, P, const0, delta, nodes, stride, K, m, floor, buf, out, 1)
                           : smi_polar2_by(u, om, P, const0, delta, nodes, stride, K, m, floor, buf, out, 0);
    }

    static double smi_sphere2(const double* u, const double* om, const double* P, double const0,
                              const double* nodes, long stride, long K, double floor, double* buf,
                              double* out) {
        return P[1] == 0.0 ? smi_sphere2_by(u, om, P, const0, nodes, stride, K, floor, buf, out, 1)
                           : smi_sphere2_by(u, om, P, const0, nodes, stride, K, floor, buf, out, 0);
    }

    static double smi_polar3(const double* u, const double* om, const double* P, double const0,
                             const double* nodes, long stride, long K, double floor, double* buf,
                             double* out) {
        return P[1] == 0.0 && P[2] == 0.0 && P[5] == 0.0
            ? smi_polar3_by(u, om, P, const0, nodes, stride, K, floor, buf, out, 1)
            : smi_polar3_by(u, om, P, const0, nodes, stride, K, floor, buf, out, 0);
    }

    /* Helpers of the node loops by columns (``smi_laplace_tile``, ``_region``): row r of a block is
       at r * st, its K nodes contiguous.  The index matrices Z_s of term s are the rows of X (RT
       rows: x = h_{<L} in rows < d, h_L in rows d .. RT - 1) with the rows of a layer negated where
       s says so: h_L where bit 0 of s is set, layer l < L (row i < d, l = i / T) where bit l + 1
       is (the polar rules' reflections; route 1 has one term, Z = x).  So nt = 2 flips h_L only. */
    static inline double smi_sign(int s, int i, int d, int T) {
        return ((i >= d ? s : s >> (1 + i / T)) & 1) ? -1.0 : 1.0;
    }

    /* After the kernel: route 0, its outputs KO = [h_L (T rows), log|det Phi|] into X's rows
       d .. d + T - 1, and OK = 1 where they are all finite (else 0, and h_L = 0 there); route 1
       (Z = x), OK = 1. */
    static void smi_last_layer(int route, int T, int d, long K, long st, const double* KO, double* X,
                               double* OK) {
        if (route != 0) {
            for (long k = 0; k < K; k++)
                OK[k] = 1.0;
            return;
        }
        for (long k = 0; k < K; k++)
            OK[k] = SMI_FINITE(KO[T * st + k]) ? 1.0 : 0.0;
        for (int t = 0; t < T; t++)
            for (long k = 0; k < K; k++)
                OK[k] = SMI_FINITE(KO[t * st + k]) ? OK[k] : 0.0;
        for (int t = 0; t < T; t++) {
            double* restrict Xh = X + (d + t) * st;
            const double* restrict Ht = KO + t * st;
            #pragma omp simd
            for (long k = 0; k < K; k++)
                Xh[k] = OK[k] > 0 ? Ht[k] : 0.0;
        }
    }

    /* The terms' log weights, LF row s = LB + lf_s for s < nt, with lf_s = const0 - Q(Z_s)/2 -
       (route 0) log|det Phi| or (route 1) |data - g|^2 / (2 delta), Q(Z) = sum_t (Z_t - omega_t)'
       P (Z_t - omega_t); -inf where OK = 0 or not finite.  Returns their maximum. */
    static double smi_term_logs(int route, int nt, int R, int T, int d, long K, long st,
                                const double* X, const double* KO, const double* OK,
                                const double* omega, const double* P, double const0, int n_out,
                                const double* data, double delta, const double* LB, double* LF) {
        double mx = -INFINITY;
        for (int s = 0; s < nt; s++) {
            double* restrict Ls = LF + s * st;
            for (long k = 0; k < K; k++)
                Ls[k] = 0.0;
            for (int t = 0; t < T; t++)
                for (int a = 0; a < R; a++)
                    for (int b = a; b < R; b++) {               /* P symmetric */
                        const double p = (a == b ? 1.0 : 2.0) * P[a * R + b];
                        const double oa = omega[a * T + t], ob = omega[b * T + t];
                        const double sa = smi_sign(s, a * T + t, d, T), sb = smi_sign(s, b * T + t, d, T);
                        const double* restrict Xa = X + (a * T + t) * st;
                        const double* restrict Xb = X + (b * T + t) * st;
                        #pragma omp simd
                        for (long k = 0; k < K; k++)
                            Ls[k] += p * (sa * Xa[k] - oa) * (sb * Xb[k] - ob);
                    }
            if (route == 0) {
                const double* restrict LD = KO + T * st;
                #pragma omp simd
                for (long k = 0; k < K; k++)
                    Ls[k] = const0 - 0.5 * Ls[k] - (OK[k] > 0 ? LD[k] : 0.0);
            } else {
                const double c2 = 0.5 / delta;
                for (long k = 0; k < K; k++)
                    Ls[k] = const0 - 0.5 * Ls[k];
                for (int o = 0; o < n_out; o++) {
                    const double y = data[o];
                    const double* restrict G = KO + o * st;
                    #pragma omp simd
                    for (long k = 0; k < K; k++)
                        Ls[k] -= c2 * (y - G[k]) * (y - G[k]);
                }
            }
            #pragma omp simd reduction(max: mx)
            for (long k = 0; k < K; k++) {
                double v = LB[k] + Ls[k];
                int ok = OK[k] > 0 && SMI_FINITE(v);
                Ls[k] = ok ? v : -INFINITY;
                mx = ok && v > mx ? v : mx;
            }
        }
        return mx;
    }

    /* The terms' weights end to end (column s K + k: term s at node k), Wc = e^(LF - mx) times
       INV (1 where INV is NULL), from their logs LF (nt rows of stride st). */
    static void smi_weights(int nt, long K, long st, double mx, const double* INV, const double* LF,
                            double* Wc) {
        for (int s = 0; s < nt; s++) {
            const double* restrict Ls = LF + s * st;
            double* restrict Ws = Wc + s * K;
            if (INV) {
                #pragma omp simd
                for (long k = 0; k < K; k++)
                    Ws[k] = Ls[k] > -INFINITY ? smi_exp_neg(Ls[k] - mx) * INV[k] : 0.0;
            } else {
                #pragma omp simd
                for (long k = 0; k < K; k++)
                    Ws[k] = Ls[k] > -INFINITY ? smi_exp_neg(Ls[k] - mx) : 0.0;
            }
        }
    }

    /* The nt terms' index matrices end to end, as their weights (``smi_weights``): Zc (RT rows of
       nt K) = Z_s - ref. */
    static void smi_expand(int nt, int RT, int T, int d, long K, long st, const double* X,
                           const double* ref, double* Zc) {
        const long N = nt * K;
        for (int s = 0; s < nt; s++) {
            for (int i = 0; i < RT; i++) {
                const double si = smi_sign(s, i, d, T), ri = ref[i];
                const double* restrict Xi = X + i * st;
                double* restrict Zi = Zc + i * N + s * K;
                #pragma omp simd
                for (long k = 0; k < K; k++)
                    Zi[k] = si * Xi[k] - ri;
            }
        }
    }

    /* The adaptive rule (``_region``): W = the weights Wc (nt K, ``smi_weights``) times the
       degree-7 rule's weights w7 of their points, then (row 2, nt K more) times the degree-5
       rule's w5; mass = the sum of the terms per point. */
    static void smi_rule_weights(int nt, long K, const double* Wc, const double* w7, const double* w5,
                                 double* W, double* mass) {
        for (long k = 0; k < K; k++)
            mass[k] = 0.0;
        for (int s = 0; s < nt; s++) {
            const double* restrict Ws = Wc + s * K;
            double* restrict W7 = W + s * K;
            double* restrict W5 = W + (nt + s) * K;
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                W7[k] = Ws[k] * w7[k];
                W5[k] = Ws[k] * w5[k];
                mass[k] += Ws[k];
            }
        }
    }

    /* out = [s0, s1, the upper triangle of s2 row by row] = sum_k W[k] [1, Zc_k, Zc_k Zc_k'] over
       the N columns of Zc (RT rows), for each of the nw = 1 or 2 rows of W (stride N; the sums of
       row 1 at out + 1 + RT + RT (RT + 1) / 2), in one pass over Zc. */
    static inline __attribute__((always_inline)) void smi_sums_n(long N, int RT, const int nw,
                                                                 const double* W, const double* Zc,
                                                                 double* out) {
        const double* restrict Wa = W;
        const double* restrict Wb = W + (nw - 1) * N;
        double* outb = out + (nw - 1) * (1 + RT + RT * (RT + 1) / 2);
        double a0 = 0.0, b0 = 0.0;
        #pragma omp simd reduction(+: a0, b0)
        for (long k = 0; k < N; k++) {
            a0 += Wa[k];
            b0 += Wb[k];
        }
        out[0] = a0;
        outb[0] = b0;
        for (int i = 0, r = 1 + RT; i < RT; i++) {
            const double* restrict Zi = Zc + i * N;
            double a1 = 0.0, b1 = 0.0;
            #pragma omp simd reduction(+: a1, b1)
            for (long k = 0; k < N; k++) {
                a1 += Wa[k] * Zi[k];
                b1 += Wb[k] * Zi[k];
            }
            out[1 + i] = a1;
            outb[1 + i] = b1;
            for (int j = i; j < RT; j++, r++) {
                const double* restrict Zj = Zc + j * N;
                double a2 = 0.0, b2 = 0.0;
                #pragma omp simd reduction(+: a2, b2)
                for (long k = 0; k < N; k++) {
                    const double p = Zi[k] * Zj[k];
                    a2 += Wa[k] * p;
                    b2 += Wb[k] * p;
                }
                out[r] = a2;
                outb[r] = b2;
            }
        }
    }
    static void smi_sums(long N, int RT, int nw, const double* W, const double* Zc, double* out) {
        if (nw == 2)
            smi_sums_n(N, RT, 2, W, Zc, out);
        else
            smi_sums_n(N, RT, 1, W, Zc, out);
    }

    /* Polar points of the adaptive rule (``_values``), by columns (row stride st): X rows 0, 1 =
       h_1 = sqrt(t) (cos th, sin th) from XI rows 0, 1 = (t, th), LB = log of dh_1 / (dt dth) =
       -log 2; with d = 4 also IN = [u_2 = sqrt(t_2) (cos th_2, sin th_2); h_1] (rows 0-3, the
       inputs of the kernel (u_2, h_1) -> [Phi1^-1 u_2; log|det Phi1|]) from XI rows 2, 3, and
       LB = -2 log 2 (``smi_polar_layer2`` adds the rest). */
    static void smi_polar_points(int d, long K, long st, const double* XI, double* X, double* IN,
                                 double* LB) {
        for (int l = 0; l < d / 2; l++) {
            const double* restrict t = XI + 2 * l * st;
            const double* restrict th = t + st;
            double* restrict c = (l == 0 ? X : IN);
            double* restrict s = c + st;
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                const double r = sqrt(t[k]);
                c[k] = r * cos(th[k]);
                s[k] = r * sin(th[k]);
            }
        }
        for (long k = 0; k < K; k++)
            LB[k] = -(d / 2) * M_LN2;
        if (d == 4)
            for (long k = 0; k < K; k++) {
                IN[2 * st + k] = X[k];
                IN[3 * st + k] = X[st + k];
            }
    }

    /* d = 4: the kernel's outputs OUT = [h_2; log|det Phi1|] into X rows 2, 3 and LB (- log|det
       Phi1|); where they are not finite (det Phi1 = 0), h_2 = 0 and LB = -inf. */
    static void smi_polar_layer2(long K, long st, const double* OUT, double* X, double* LB) {
        #pragma omp simd
        for (long k = 0; k < K; k++) {
            const int ok = SMI_FINITE(OUT[k]) && SMI_FINITE(OUT[st + k]) && SMI_FINITE(OUT[2 * st + k]);
            X[2 * st + k] = ok ? OUT[k] : 0.0;
            X[3 * st + k] = ok ? OUT[st + k] : 0.0;
            LB[k] = ok ? LB[k] - OUT[2 * st + k] : -INFINITY;
        }
    }

    typedef void (*smi_kernel_cols)(const double*, long, const double*, double*, long, long);

    /* The rows of a tile's buffer (SMI_TILE doubles each): the data (n_data rows, filled by the
       caller), X (Z of the first term, RT rows), LQ (the pieces' lq, M rows), KO (kernel outputs,
       n_out rows), LB, INV, LMX, OK, LF and WC (2 rows each: one per term, nt ≤ 2), ZC (RT rows of
       nt SMI_TILE). */
    typedef struct { double *X, *LQ, *KO, *LB, *INV, *LMX, *OK, *LF, *WC, *ZC; } smi_tile_rows;
    static smi_tile_rows smi_tile_layout(double* buf, int n_data, int RT, int M, int n_out) {
        smi_tile_rows b;
        b.X = buf + n_data * SMI_TILE;
        b.LQ = b.X + RT * SMI_TILE;
        b.KO = b.LQ + M * SMI_TILE;
        b.LB = b.KO + n_out * SMI_TILE;
        b.INV = b.LB + SMI_TILE;
        b.LMX = b.INV + SMI_TILE;
        b.OK = b.LMX + SMI_TILE;
        b.LF = b.OK + SMI_TILE;
        b.WC = b.LF + 2 * SMI_TILE;
        b.ZC = b.WC + 2 * SMI_TILE;
        return b;
    }

    /* The rest of a tile, its nodes X (RT rows; route 0: d), their log bounds LB and partition
       factors INV in ``buf`` (the layout of ``smi_laplace_tile``): the kernel, the terms' log
       weights, the tile's maximum mx of lb + lf and, unless mx < floor, the sums out. */
    static double smi_tile_sums(int route, smi_kernel_cols f, const double* par, int n_data,
                                int n_out, const double* data, double delta, const double* omega,
                                const double* P, double const0, int R, int T, int d, int M, long K,
                                const double* ref, double floor, double* buf, double* out) {
        const int RT = R * T, nt = route == 0 ? 2 : 1;
        const smi_tile_rows b = smi_tile_layout(buf, n_data, RT, M, n_out);
        f(route == 0 ? buf : b.X, SMI_TILE, par, b.KO, SMI_TILE, K);     /* the kernel, by columns */
        smi_last_layer(route, T, d, K, SMI_TILE, b.KO, b.X, b.OK);
        double mx = smi_term_logs(route, nt, R, T, d, K, SMI_TILE, b.X, b.KO, b.OK, omega, P, const0,
                                  n_out, data, delta, b.LB, b.LF);
        if (mx < floor || mx == -INFINITY)              /* the tile is negligible */
            return mx;
        smi_weights(nt, K, SMI_TILE, mx, b.INV, b.LF, b.WC);
        smi_expand(nt, RT, T, d, K, SMI_TILE, b.X, ref, b.ZC);
        smi_sums(nt * K, RT, 1, b.WC, b.ZC, out);
        return mx;
    }

    /* Nodes x_k = c_m + A_m xi_k of partition piece m (xi_k's entry l at xi[k ks + l ls]) into X
       (d rows of stride st), and their partition weights pi_m(x_k) = e^(lq_m - max_j lq_j) INV_k,
       INV_k = 1 / sum_j e^(lq_j - max), lq_j = logh_j - (x - c_j)' H_j (x - c_j) / 2: the first
       factor added to LB (log), INV apart.  LQ: M rows, LMX: one row (scratch). */
    static void smi_place(int d, int M, int m, const double* centers, const double* A,
                          const double* H, const double* logh, const double* xi, long ks, long ls,
                          long K, long st, double* X, double* LQ, double* LB, double* INV,
                          double* LMX) {
        const double* c = centers + m * d;
        const double* Am = A + m * d * d;
        for (int i = 0; i < d; i++) {                   /* the nodes */
            double* restrict Xi = X + i * st;
            for (long k = 0; k < K; k++)
                Xi[k] = c[i];
            for (int l = 0; l <= i; l++) {
                const double a = Am[i * d + l];
                for (long k = 0; k < K; k++)
                    Xi[k] += a * xi[k * ks + l * ls];
            }
        }
        int active = 0;                                 /* the partition of unity */
        for (int j = 0; j < M; j++)
            active += logh[j] > -INFINITY;
        for (long k = 0; k < K; k++) {
            INV[k] = 1.0;
            LMX[k] = -INFINITY;
        }
        if (active < 2)
            return;
        for (int j = 0; j < M; j++) {
            if (!(logh[j] > -INFINITY))
                continue;
            double* restrict Q = LQ + j * st;
            const double* cj = centers + j * d;
            const double* Hj = H + j * d * d;
            for (long k = 0; k < K; k++)
                Q[k] = 0.0;
            for (int i = 0; i < d; i++)
                for (int l = 0; l < d; l++) {
                    const double h = Hj[i * d + l], ci = cj[i], cl = cj[l];
                    const double* restrict Xi = X + i * st;
                    const double* restrict Xl = X + l * st;
                    #pragma omp simd
                    for (long k = 0; k < K; k++)
                        Q[k] += (Xi[k] - ci) * h * (Xl[k] - cl);
                }
            const double lh = logh[j];
            #pragma omp simd
            for (long k = 0; k < K; k++) {
                Q[k] = lh - 0.5 * Q[k];
                LMX[k] = Q[k] > LMX[k] ? Q[k] : LMX[k];
            }
        }
        for (long k = 0; k < K; k++)
            INV[k] = 0.0;
        for (int j = 0; j < M; j++) {
            if (!(logh[j] > -INFINITY))
                continue;
            const double* restrict Q = LQ + j * st;
            #pragma omp simd
            for (long k = 0; k < K; k++)
                INV[k] += smi_exp_neg(Q[k] - LMX[k]);
        }
        const double* restrict Qm = LQ + m * st;
        #pragma omp simd
        for (long k = 0; k < K; k++) {
            LB[k] += Qm[k] - LMX[k];
            INV[k] = 1.0 / INV[k];
        }
    }

    /* The Laplace rule (``integrate``) on K <= SMI_TILE nodes x_k = c_m + A_m xi_k of partition
       piece m of one sample, by rows of the tile (the loops over the nodes vectorise, and so
       does the kernel's, by columns): the nodes and their partition weights (``smi_place``,
       the log bound lb_k = lw_k + log|det A_m| + lq_m - max_j lq_j and the factor INV_k); the
       kernel; the terms' log weights lf and the tile's maximum mx of lb + lf.  Unless mx < floor,
       then the weights e^(lb + lf - mx) / sum and out = [s0, s1, the upper triangle of s2 row by
       row] of Z - ref.
       Route 0: x = h_{<L} (d values), kernel (data, x) -> [h_L (T), log|det Phi|], two terms
       Z = [x; +-h_L] with lf = const0 - Q(Z)/2 - log|det Phi|; route 1: Z = x, kernel x -> g
       (n_out values), one term, lf = const0 - Q(Z)/2 - |data - g|^2 / (2 delta); Q(Z) =
       sum_t (Z_t - omega_t)' P (Z_t - omega_t).  Terms with a non-finite value weigh 0.  buf:
       (n_data + 3 RT + M + n_out + 8) SMI_TILE doubles, its first n_data rows each filled with
       its datum by the caller (route 0: the kernel's inputs are these rows and x's). */
    static double smi_laplace_tile(int route, smi_kernel_cols f, const double* par,
                                   int n_data, int n_out, const double* data, double delta,
                                   const double* omega, const double* P, double const0, int R,
                                   int T, int d, int M, int m, const double* centers,
                                   const double* A, const double* H, const double* logh,
                                   double ldA, const double* xi, const double* lw, long K,
                                   const double* ref, double floor, double* buf, double* out) {
        const smi_tile_rows b = smi_tile_layout(buf, n_data, R * T, M, n_out);
        for (long k = 0; k < K; k++)
            b.LB[k] = lw[k] + ldA;
        smi_place(d, M, m, centers, A, H, logh, xi, d, 1, K, SMI_TILE, b.X, b.LQ, b.LB, b.INV, b.LMX);
        return smi_tile_sums(route, f, par, n_data, n_out, data, delta, omega, P, const0, R, T, d, M,
                             K, ref, floor, buf, out);
    }
    """
    double smi_exp_neg(double x) noexcept nogil
    int SMI_TILE             # integrate_polar, L ≥ 2: nodes per tile (its buffers stay in L1)
    double SMI_SKIP          # a tile this far below the running maximum is left out
    double smi_polar3(const double* u, const double* om, const double* P, double const0,
                      const double* nodes, long stride, long K, double floor, double* buf,
                      double* out) noexcept nogil
    double smi_polar2(const double* u, const double* om, const double* P, double const0, double delta,
                      const double* nodes, long stride, long K, int m, double floor, double* buf,
                      double* out) noexcept nogil
    double smi_sphere2(const double* u, const double* om, const double* P, double const0,
                       const double* nodes, long stride, long K, double floor, double* buf,
                       double* out) noexcept nogil
    void smi_last_layer(int route, int T, int d, long K, long st, const double* KO, double* X,
                        double* OK) noexcept nogil
    double smi_term_logs(int route, int nt, int R, int T, int d, long K, long st, const double* X,
                         const double* KO, const double* OK, const double* omega, const double* P,
                         double const0, int n_out, const double* data, double delta, const double* LB,
                         double* LF) noexcept nogil
    void smi_weights(int nt, long K, long st, double mx, const double* INV, const double* LF,
                     double* Wc) noexcept nogil
    void smi_expand(int nt, int RT, int T, int d, long K, long st, const double* X, const double* ref,
                    double* Zc) noexcept nogil
    void smi_rule_weights(int nt, long K, const double* Wc, const double* w7, const double* w5, double* W,
                          double* mass) noexcept nogil
    void smi_sums(long N, int RT, int nw, const double* W, const double* Zc, double* out) noexcept nogil
    void smi_polar_points(int d, long K, long st, const double* XI, double* X, double* IN,
                          double* LB) noexcept nogil
    void smi_polar_layer2(long K, long st, const double* OUT, double* X, double* LB) noexcept nogil
    double smi_laplace_tile(int route, cols_t f, const double* par, int n_data,
                            int n_out, const double* data, double delta, const double* omega,
                            const double* P, double const0, int R, int T, int d, int M, int m,
                            const double* centers, const double* A, const double* H,
                            const double* logh, double ldA, const double* xi, const double* lw,
                            long K, const double* ref, double floor, double* buf,
                            double* out) noexcept nogil
    void smi_place(int d, int M, int m, const double* centers, const double* A, const double* H,
                   const double* logh, const double* xi, long ks, long ls, long K, long st, double* X,
                   double* LQ, double* LB, double* INV, double* LMX) noexcept nogil
    ctypedef struct smi_tile_rows:
        double* X
        double* LB
        double* INV
    smi_tile_rows smi_tile_layout(double* buf, int n_data, int RT, int M, int n_out) noexcept nogil
    double smi_tile_sums(int route, cols_t f, const double* par, int n_data, int n_out,
                         const double* data, double delta, const double* omega, const double* P,
                         double const0, int R, int T, int d, int M, long K, const double* ref,
                         double floor, double* buf, double* out) noexcept nogil


cdef inline double _quad_v(const double* Z, const double* omega, const double* Vinv,
                           int R, int T) noexcept nogil:
    """Σ_t (Z_t - ω_t)ᵀ V⁻¹ (Z_t - ω_t)."""
    cdef int a, b, t
    cdef double acc = 0.0, da
    for t in range(T):
        for a in range(R):
            da = Z[a * T + t] - omega[a * T + t]
            for b in range(R):
                acc += da * Vinv[a * R + b] * (Z[b * T + t] - omega[b * T + t])
    return acc


cdef inline double _logdet_tri(const double* A, int d) noexcept nogil:
    """log|det A| of a lower-triangular d × d A with a positive diagonal (a piece's rule scale)."""
    cdef int i
    cdef double acc = 0.0
    for i in range(d):
        acc += log(A[i * d + i])
    return acc


cdef struct Acc:
    double mx
    double s0
    double* s1
    double* s2
    int n


cdef inline void _rescale(Acc* acc, double top) noexcept nogil:
    """Move the sums to a new running maximum top > acc.mx (nothing overflows)."""
    cdef int i, n = acc.n
    cdef double scale = exp(acc.mx - top) if acc.mx > -INFINITY else 0.0
    acc.s0 *= scale
    for i in range(n):
        acc.s1[i] *= scale
    for i in range(n * n):
        acc.s2[i] *= scale
    acc.mx = top


cdef inline void _add(Acc* acc, double lw, const double* Z, const double* ref) noexcept nogil:
    cdef int i, j, n = acc.n
    cdef double w
    if lw > acc.mx:
        _rescale(acc, lw)
    w = smi_exp_neg(lw - acc.mx)
    acc.s0 += w
    for i in range(n):
        acc.s1[i] += w * (Z[i] - ref[i])
        for j in range(i, n):
            acc.s2[i * n + j] += w * (Z[i] - ref[i]) * (Z[j] - ref[j])


cdef inline void _add_sums(Acc* acc, double top, const double* part) noexcept nogil:
    """Add sums given relative to e^top, packed as [s0, s1, the upper triangle of s2 row by
    row] (``smi_polar2``, ``smi_polar3``), moving ``acc`` to top first when it is higher."""
    cdef int i, j, r = 1 + acc.n, n = acc.n
    cdef double scale
    if top == -INFINITY:
        return
    if top > acc.mx:
        _rescale(acc, top)
    scale = exp(top - acc.mx)
    acc.s0 += part[0] * scale
    for i in range(n):
        acc.s1[i] += part[1 + i] * scale
        for j in range(i, n):
            acc.s2[i * n + j] += part[r] * scale
            r += 1


cdef struct Site:        # one sample's integrand (route, kernel, data, ω, V⁻¹) and partition of unity
    int route, R, T, d, M, n_data, n_node, polar
    int nt             # terms per point: 2 (route 0: ±h_L), 2^L (polar: each earlier layer reflected too), 1
    long st            # points per column block (the Genz–Malik rule's count in d dimensions)
    cols_t f           # the kernel by columns
    cols_t f1          # polar mode, L = 3: (u_2, h_1) → [Φ⁽¹⁾⁻¹u_2; log|det Φ⁽¹⁾|], by columns
    const double* par
    const double* data
    const double* omega
    const double* Vinv
    double const0, delta, shift
    const double* centers
    const double* A
    const double* H
    const double* logh
    const double* ref
    double* x          # one point (``_affine``)
    double* IN1        # polar mode, L = 3: f1's inputs and outputs by columns (4 and 3 rows)
    double* OUT1
    double* LQ         # the pieces' log weights by columns (M rows; ``smi_place``)
    double* INV        # the points' partition factors 1 / Σ_j e^(lq_j - max) (``smi_place``)
    double* LMX        # the points' max_j lq_j (``smi_place``'s scratch)
    double* ldA        # log|det A_m| per piece
    double* buf        # the kernel's inputs by columns: route 0 [data rows; X], route 1 X
    double* X          # Z of the first term (RT rows; route 0: x, then h_L from the kernel)
    double* KO         # the kernel's outputs (n_node rows)
    double* LB         # the points' log partition weights (relative to shift)
    double* OK
    double* LF         # the terms' log weights (nt rows)
    double* WC         # their weights end to end (``smi_weights``: column k·np + j, term k at point j)
    double* ZC         # the terms' Z - ref end to end (``smi_expand``: RT rows of nt·st)
    double* W          # the terms' weights end to end times the 7-rule's weights, then times the 5-rule's
    double* mass       # the points' values (Σ over the terms)
    double* xi         # the points' ξ (d rows of st)
    double* w7         # the rules' weights per point
    double* w5
    double* packed     # the two rules' moment sums as ``smi_sums`` writes them


cdef inline int _gm_count(int d) noexcept nogil:
    """Points of the Genz–Malik rule in d dimensions: 1 + 4d + 2d(d - 1) + 2^d."""
    return 1 + 4 * d + 2 * d * (d - 1) + (1 << d)


cdef double* _site_init(Site* s, int route, cols_t f, const double* par, const double* data,
                        int n_data, const double* omega, const double* Vinv, double const0,
                        const double* centers, const double* A, const double* H,
                        const double* logh, int M, int d, const double* ref, int R, int T,
                        int n_node, double delta) noexcept nogil:
    """Fill ``s`` and allocate its scratch (returned; the caller frees it)."""
    cdef int i, j, m, RT = R * T, nt = 1 if route == 1 else 2
    cdef long st = _gm_count(d)
    cdef int n_sums = 1 + RT + RT * (RT + 1) // 2
    cdef double* work
    s.route, s.R, s.T, s.d, s.M, s.n_data, s.n_node = route, R, T, d, M, n_data, n_node
    s.polar = 0
    s.f, s.par, s.data, s.omega, s.Vinv, s.const0, s.delta = f, par, data, omega, Vinv, const0, delta
    s.centers, s.A, s.H, s.logh, s.ref = centers, A, H, logh, ref
    s.shift = -INFINITY
    for i in range(M):
        if logh[i] > s.shift:
            s.shift = logh[i]
    s.nt, s.st = nt, st
    work = <double*> malloc((d + M + st * (M + 2 + n_data + RT + n_node + 2 + 8 * (RT + 4) + 1 + d + 2 + 7)
                             + 2 * n_sums) * sizeof(double))
    s.x = work
    s.LQ = s.x + d
    s.INV = s.LQ + M * st
    s.LMX = s.INV + st
    s.ldA = s.LMX + st
    s.buf = s.ldA + M
    s.X = s.buf + n_data * st
    s.KO = s.X + RT * st
    s.LB = s.KO + n_node * st
    s.OK = s.LB + st
    s.LF = s.OK + st
    s.WC = s.LF + 8 * st
    s.ZC = s.WC + 8 * st
    s.W = s.ZC + 8 * RT * st
    s.mass = s.W + 16 * st
    s.xi = s.mass + st
    s.w7 = s.xi + d * st
    s.w5 = s.w7 + st
    s.IN1 = s.w5 + st
    s.OUT1 = s.IN1 + 4 * st
    s.packed = s.OUT1 + 3 * st
    for m in range(M if A != NULL else 0):
        s.ldA[m] = _logdet_tri(A + m * d * d, d)
    if route == 0:                      # the kernel's data rows
        for i in range(n_data):
            for j in range(st):
                s.buf[i * st + j] = data[i]
    return work


cdef inline void _affine(Site* s, int m, const double* xi) noexcept nogil:
    """x = c_m + A_m ξ into s.x (A_m lower triangular)."""
    cdef int d = s.d, i, l
    for i in range(d):
        s.x[i] = s.centers[m * d + i]
        for l in range(i + 1):
            s.x[i] += s.A[(m * d + i) * d + l] * xi[l]


cdef void _acc_init(Acc* acc, int RT) noexcept nogil:
    cdef int i
    acc.mx, acc.s0, acc.n = -INFINITY, 0.0, RT
    acc.s1 = <double*> malloc((RT + RT * RT) * sizeof(double))
    acc.s2 = acc.s1 + RT
    for i in range(RT + RT * RT):
        acc.s1[i] = 0.0


cdef void _acc_finish(Acc* acc, double* log_z, double* mean, double* second) noexcept nogil:
    """Write log mass, mean and (symmetrised) second moment; frees the sums."""
    cdef int i, j, RT = acc.n
    log_z[0] = acc.mx + log(acc.s0)
    for i in range(RT):
        mean[i] = acc.s1[i] / acc.s0
        for j in range(i, RT):
            second[i * RT + j] = acc.s2[i * RT + j] / acc.s0
            second[j * RT + i] = second[i * RT + j]
    free(acc.s1)


cdef double _const0(int route, int R, int T, double logdetV, int n_node, double delta) noexcept nogil:
    """The normalisation in the log integrand: -T (R log 2π + log det V) / 2, and for route 1
    (n_node noisy outputs) - n_node log(2πΔ) / 2."""
    cdef double c = -0.5 * T * (R * log(2 * M_PI) + logdetV)
    return c - 0.5 * n_node * log(2 * M_PI * delta) if route == 1 else c


cdef double* _tile_buffer(int route, int n_data, const double* data, int RT, int M, int n_out,
                          double** part) noexcept nogil:
    """A tile's buffer (``smi_laplace_tile``; route 0: its data rows filled) and, at ``part``,
    the tile's sums (1 + RT + RT² doubles)."""
    cdef int j
    cdef long k
    cdef long rows = (n_data if route == 0 else 0) + 3 * RT + M + n_out + 8
    cdef double* buf = <double*> malloc((rows * SMI_TILE + 1 + RT + RT * RT) * sizeof(double))
    part[0] = buf + rows * SMI_TILE
    if route == 0:                      # the kernel's data rows
        for j in range(n_data):
            for k in range(SMI_TILE):
                buf[j * SMI_TILE + k] = data[j]
    return buf


cdef void _sample(int route, cols_t f, const double* par, const double* data, int n_data,
                  const double* omega, const double* Vinv, double logdetV,
                  const double* centers, const double* A, const double* H, const double* logh, int M,
                  const double* xi, const double* lw, int G, int d,
                  const double* ref, int R, int T, int n_node, double delta,
                  double* log_z, double* mean, double* second) noexcept nogil:
    """The rule on every partition piece, tile by tile (``smi_laplace_tile``)."""
    cdef int RT = R * T, m, k0, n_out = n_node
    cdef long K
    cdef Acc acc
    cdef double const0 = _const0(route, R, T, logdetV, n_node, delta), ldA, top
    cdef double* part
    cdef double* buf = _tile_buffer(route, n_data, data, RT, M, n_out, &part)
    _acc_init(&acc, RT)
    for m in range(M):
        if not logh[m] > -INFINITY:
            continue
        ldA = _logdet_tri(A + m * d * d, d)
        k0 = 0
        while k0 < G:
            K = min(SMI_TILE, G - k0)
            top = smi_laplace_tile(route, f, par, n_data if route == 0 else 0, n_out, data, delta, omega,
                                   Vinv, const0, R, T, d, M, m, centers, A, H, logh, ldA, xi + k0 * d,
                                   lw + k0, K, ref, acc.mx - SMI_SKIP, buf, part)
            if top >= acc.mx - SMI_SKIP and top > -INFINITY:
                _add_sums(&acc, top, part)
            k0 += SMI_TILE
    _acc_finish(&acc, log_z, mean, second)
    free(buf)


def integrate(int route, capsule, const double[::1] params, const double[:, ::1] data,
              const double[:, ::1] omega, const double[:, :, ::1] Vinv, const double[::1] logdetV,
              const double[:, :, ::1] centers, const double[:, :, :, ::1] A,
              const double[:, :, :, ::1] H, const double[:, ::1] logh,
              const double[:, ::1] xi, const double[::1] lw, const double[:, ::1] ref,
              int R, int T, int n_node, double delta,
              double[::1] log_z, double[:, ::1] mean, double[:, :, ::1] second, int threads=0):
    """Posterior mass (log), mean E[Z - ref] and second moment E[(Z-ref)(Z-ref)ᵀ] per sample
    (``capsule``: the kernel by columns, ``Kernel.capsule("columns")``)."""
    cdef cols_t f = <cols_t> PyCapsule_GetPointer(capsule, "smi_kernel_cols")
    cdef Py_ssize_t n = omega.shape[0], i
    cdef int M = centers.shape[1], d = centers.shape[2], G = xi.shape[0], n_data = data.shape[1]
    if threads <= 0:
        threads = omp_get_max_threads()
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _sample(route, f, &params[0], &data[i, 0], n_data, &omega[i, 0], &Vinv[i, 0, 0],
                    logdetV[i], &centers[i, 0, 0], &A[i, 0, 0, 0], &H[i, 0, 0, 0], &logh[i, 0], M,
                    &xi[0, 0], &lw[0], G, d, &ref[i, 0], R, T, n_node, delta,
                    &log_z[i], &mean[i, 0], &second[i, 0, 0])


def integrate_polar(const double[:, ::1] u, const double[:, ::1] omega,
                    const double[:, :, ::1] Vinv, const double[::1] logdetV,
                    const long[::1] seg_ptr, const long[::1] seg_start, const long[::1] seg_stop,
                    const double[:, ::1] nodes, double[::1] log_z, double[:, ::1] mean,
                    double[:, :, ::1] second, int threads=0, double delta=0.0):
    """Polar rules (T = 2; T = 3 with L = 2, route 0: the spherical rule) on nodes shared by
    groups of samples: sample i runs over the node
    ranges seg_start[j]:seg_stop[j], seg_ptr[i] ≤ j < seg_ptr[i+1] (the nodes' data computed
    once for the whole group), with its own ω, V⁻¹.  ``nodes`` holds one node per column
    (width × count: the node loops read contiguous rows).

    - Route 0 (``delta`` = 0; L = 2 or 3): x = h_{<L} ∈ R^{2(L-1)}, rows [x, log weight, Φ⁻¹
      (2×2, row-major), log|det Φ|] (Φ = Φ⁽ᴸ⁻¹⁾(x)); h_L = Φ⁻¹u_L with the sample's u_L (row i
      of ``u``), and the integrand Σ_± N([x; ±h_L]; ω, V)/|det Φ|.
      With T = 3 (L = 2): x = h_1 ∈ R³, rows [x, log weight, Φ⁻¹ (3×3), log|det Φ|].
    - Route 1 (``delta`` = Δ > 0; L = 1 or 2): x = (h_{<L}, u_L), rows [x, log weight, Φ⁻¹,
      log|det Φ|, g = σ_β(u_L u_Lᵀ) (4, row-major)], ``u`` the sample's y (4 values):
      h_L = Φ⁻¹u_L (dh_L = du_L/|det Φ|) and the integrand N([h_{<L}; h_L]; ω, V) N(y; g, Δ I)
      (log_z exact).
    The integrand is folded over every reflection h_ℓ → -h_ℓ (Φ and g are even in each layer),
    so each layer's nodes cover a half plane and every node carries 2^L terms.  Moments about
    ω: mean E[Z - ω], second E[(Z - ω)(Z - ω)ᵀ].  Tiles of nodes all below e^-SMI_SKIP of the
    running maximum are left out."""
    cdef Py_ssize_t n = omega.shape[0], i
    cdef int L = Vinv.shape[1], noisy = delta > 0, T = omega.shape[1] // Vinv.shape[1]
    if threads <= 0:
        threads = omp_get_max_threads()
    if seg_ptr.shape[0] != n + 1 or seg_start.shape[0] != seg_stop.shape[0] or seg_ptr[n] > seg_start.shape[0]:
        raise ValueError("integrate_polar needs seg_ptr of n + 1 offsets into seg_start and seg_stop")
    if not ((T == 2 and 2 <= L <= POLAR_MAX_LAYERS and nodes.shape[0] == 2 * L + 4 and not noisy)
            or (T == 3 and L == 2 and nodes.shape[0] == 14 and not noisy and u.shape[1] == 3)
            or (T == 2 and 1 <= L <= 2 and nodes.shape[0] == 2 * L + 10 and noisy and u.shape[1] == 4)):
        raise ValueError(f"integrate_polar needs T = 2, 2 ≤ L ≤ {POLAR_MAX_LAYERS} and nodes of 2L + 4 values "
                         f"(route 0), T = 3, L = 2 and nodes of 14 values (route 0), or T = 2, 1 ≤ L ≤ 2, "
                         f"nodes of 2L + 10 values and 4 outputs (route 1)")
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _polar_sample(&u[i, 0], &omega[i, 0], &Vinv[i, 0, 0], logdetV[i], L, T, delta, &nodes[0, 0],
                          nodes.shape[0], nodes.shape[1], &seg_start[seg_ptr[i]], &seg_stop[seg_ptr[i]],
                          seg_ptr[i + 1] - seg_ptr[i], &log_z[i], &mean[i, 0], &second[i, 0, 0])


cdef void _product_sample(const double* rows, Py_ssize_t j0, Py_ssize_t j1, int width, const double* ucol,
                          Py_ssize_t stride, Py_ssize_t k0, Py_ssize_t k1, const double* omega, int RT,
                          double* log_z, double* mean, double* second) noexcept nogil:
    """One sample of ``integrate_product``: per row, the log weights of its terms (pass 1, with
    their maximum) and the sums Σ w, Σ w u, Σ w u uᵀ (pass 2, vectorised), then the row's
    moments of Z = [x; F u] from them into the running sums (``_add_sums``)."""
    cdef Acc acc
    cdef double top = -INFINITY, mx, e0, e1, w, s0, su0, su1, s00, s01, s11
    cdef double part[15]
    cdef double Z[4]
    cdef double mu[2]
    cdef double S[4]
    cdef const double* row
    cdef const double* u0 = ucol + k0
    cdef const double* u1 = ucol + stride + k0
    cdef const double* lw = ucol + 2 * stride + k0
    cdef Py_ssize_t j, k, K = k1 - k0
    cdef int a, b, p, m = width - 8
    cdef double* buf = <double*> malloc(max(K, 1) * sizeof(double))
    _acc_init(&acc, RT)
    for k in range(K):
        top = max(top, lw[k])
    for j in range(j0, j1):
        row = rows + j * width
        if row[m] + top < acc.mx - SMI_SKIP:     # the row's terms all below e^-SMI_SKIP of the sums
            continue
        mx = -INFINITY
        for k in range(K):
            e0 = row[m + 1] * u0[k] + row[m + 2] * u1[k] - row[m + 5]
            e1 = row[m + 3] * u0[k] + row[m + 4] * u1[k] - row[m + 6]
            buf[k] = lw[k] - 0.5 * row[m + 7] * (e0 * e0 + e1 * e1)
            mx = max(mx, buf[k])
        if mx == -INFINITY:
            continue
        s0 = su0 = su1 = s00 = s01 = s11 = 0.0
        for k in range(K):
            w = smi_exp_neg(buf[k] - mx)
            s0 += w
            su0 += w * u0[k]
            su1 += w * u1[k]
            s00 += w * u0[k] * u0[k]
            s01 += w * u0[k] * u1[k]
            s11 += w * u1[k] * u1[k]
        # moments of Z - ω about 0 (relative to e^mx): Z = [x; F u], F u's sums F(Σ w u), F(Σ w uuᵀ)Fᵀ
        for a in range(m):
            Z[a] = row[a] - omega[a]
        mu[0] = row[m + 1] * su0 + row[m + 2] * su1 - omega[m] * s0
        mu[1] = row[m + 3] * su0 + row[m + 4] * su1 - omega[m + 1] * s0
        S[0] = row[m + 1] * (row[m + 1] * s00 + row[m + 2] * s01) + row[m + 2] * (row[m + 1] * s01 + row[m + 2] * s11)
        S[1] = row[m + 1] * (row[m + 3] * s00 + row[m + 4] * s01) + row[m + 2] * (row[m + 3] * s01 + row[m + 4] * s11)
        S[3] = row[m + 3] * (row[m + 3] * s00 + row[m + 4] * s01) + row[m + 4] * (row[m + 3] * s01 + row[m + 4] * s11)
        # (F u - ω_L)(F u - ω_L)ᵀ = F u uᵀ Fᵀ - ω_L (F u)ᵀ - (F u) ω_Lᵀ + ω_L ω_Lᵀ, summed with w
        e0 = row[m + 1] * su0 + row[m + 2] * su1
        e1 = row[m + 3] * su0 + row[m + 4] * su1
        S[0] += -2 * omega[m] * e0 + omega[m] * omega[m] * s0
        S[1] += -omega[m] * e1 - omega[m + 1] * e0 + omega[m] * omega[m + 1] * s0
        S[3] += -2 * omega[m + 1] * e1 + omega[m + 1] * omega[m + 1] * s0
        S[2] = S[1]
        part[0] = s0
        for a in range(m):
            part[1 + a] = Z[a] * s0
        part[1 + m], part[2 + m] = mu[0], mu[1]
        p = 1 + RT
        for a in range(RT):
            for b in range(a, RT):
                if b < m:
                    part[p] = Z[a] * Z[b] * s0
                elif a < m:
                    part[p] = Z[a] * mu[b - m]
                else:
                    part[p] = S[2 * (a - m) + (b - m)]
                p += 1
        _add_sums(&acc, row[m] + mx, part)
    free(buf)
    _acc_finish(&acc, log_z, mean, second)


def integrate_product(const double[:, ::1] rows, const long[::1] row_ptr, const double[:, ::1] unodes,
                      const long[::1] u_ptr, const double[:, ::1] omega, double[::1] log_z,
                      double[:, ::1] mean, double[:, :, ::1] second, int threads=0):
    """The chart rule's product (smi_core.chart): sample i sums over its rows j (row_ptr[i] ≤ j <
    row_ptr[i+1]: [x_{<L} (2(L-1)), log weight c_j, F (2×2, row-major), m (2), 1/s²]) and its u
    nodes k (u_ptr[i] ≤ k < u_ptr[i+1]; ``unodes`` by columns: rows u_1, u_2, log weight w_k) the
    terms exp(c_j + w_k - |F u - m|²/(2s²)) at Z = [x_{<L}; F u] (T = 2, L = 1 or 2; no
    reflections: the nodes cover the whole space).  Rows whose c_j + max_k w_k is below
    e^-SMI_SKIP of the sums so far are skipped (rows in decreasing c_j skip the most).  Moments
    about ω, as ``integrate_polar``."""
    cdef Py_ssize_t n = omega.shape[0], i
    cdef int width = rows.shape[1], RT = omega.shape[1]
    if threads <= 0:
        threads = omp_get_max_threads()
    if not (RT in (2, 4) and width == RT + 6 and unodes.shape[0] == 3 and row_ptr.shape[0] == n + 1
            and u_ptr.shape[0] == n + 1 and rows.shape[0] > 0 and unodes.shape[1] > 0):
        raise ValueError("integrate_product needs L = 1 or 2, rows of 2L + 6 values, u nodes as 3 rows "
                         "and row_ptr, u_ptr of n + 1 offsets")
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _product_sample(&rows[0, 0], row_ptr[i], row_ptr[i + 1], width, &unodes[0, 0], unodes.shape[1],
                            u_ptr[i], u_ptr[i + 1], &omega[i, 0], RT, &log_z[i], &mean[i, 0], &second[i, 0, 0])


def integrate_nodes(int route, capsule, const double[::1] params, const double[:, ::1] data,
                    const double[:, ::1] omega, const double[:, :, ::1] Vinv, const double[::1] logdetV,
                    const double[:, ::1] rows, const long[::1] ptr, const double[:, ::1] xi,
                    const double[::1] lw, int R, int T, int n_node, double delta, double[::1] log_z,
                    double[:, ::1] mean, double[:, :, ::1] second, int threads=0):
    """A product rule: sample i sums Σ_j Σ_k e^{c_j + lw_k} f(x_jk) over its rows j (ptr[i] ≤ j <
    ptr[i+1] of ``rows``: [a_j (d - e), b_j (e), σ_j, c_j]) and the rule's nodes ξ_k (columns of
    ``xi``, e = its rows) with x_jk = [a_j; b_j + σ_j ξ_k]; f and the kernel ``capsule`` as
    ``integrate``'s route 1 (x = Z, d = R T: the noisy route), tile by tile (``smi_tile_sums``;
    tiles below e^-SMI_SKIP of the running maximum left out).  Returns log Σ, E[Z - ω] and
    E[(Z - ω)(Z - ω)ᵀ], as ``integrate_polar``."""
    cdef cols_t f = <cols_t> PyCapsule_GetPointer(capsule, "smi_kernel_cols")
    cdef Py_ssize_t n = omega.shape[0], i
    cdef int e = xi.shape[0], d = rows.shape[1] - 2
    if threads <= 0:
        threads = omp_get_max_threads()
    if not (route == 1 and omega.shape[1] == R * T and d == R * T and 0 < e <= d
            and lw.shape[0] == xi.shape[1] and ptr.shape[0] == n + 1 and ptr[n] <= rows.shape[0]
            and data.shape[0] == n and log_z.shape[0] == n):
        raise ValueError("integrate_nodes needs route 1, rows of R T + 2 values, a rule of at most R T rows "
                         "with one log weight per node, and ptr of n + 1 offsets")
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _nodes_sample(f, &params[0], &data[i, 0], &omega[i, 0], &Vinv[i, 0, 0],
                          logdetV[i], &rows[0, 0], ptr[i], ptr[i + 1], d, &xi[0, 0], &lw[0], xi.shape[1], e,
                          R, T, n_node, delta, &log_z[i], &mean[i, 0], &second[i, 0, 0])


cdef void _nodes_sample(cols_t f, const double* par, const double* data,
                        const double* omega, const double* Vinv, double logdetV, const double* rows,
                        Py_ssize_t j0, Py_ssize_t j1, int d, const double* xi, const double* lw, long G,
                        int e, int R, int T, int n_node, double delta, double* log_z, double* mean,
                        double* second) noexcept nogil:
    """One sample of ``integrate_nodes`` (route 1): the nodes of its rows j0:j1, row by row, by tiles."""
    cdef int RT = R * T, i, w = d + 2
    cdef long K = 0, k, c, t
    cdef Py_ssize_t j
    cdef const double* row
    cdef const double* xc
    cdef double* out
    cdef double v, sg
    cdef Acc acc
    cdef double const0 = _const0(1, R, T, logdetV, n_node, delta), top
    cdef double* part
    cdef double* buf = _tile_buffer(1, 0, data, RT, 0, n_node, &part)
    cdef smi_tile_rows b = smi_tile_layout(buf, 0, RT, 0, n_node)
    _acc_init(&acc, RT)
    for j in range(j0, j1):
        row = rows + j * w
        k = 0
        while k < G:                            # the row's nodes k:k+c into the tile's columns K:K+c
            c = min(G - k, SMI_TILE - K)
            for i in range(d):
                out, v, sg = b.X + i * SMI_TILE + K, row[i], row[d]
                if i < d - e:
                    for t in range(c):
                        out[t] = v
                else:
                    xc = xi + (i - d + e) * G + k
                    for t in range(c):
                        out[t] = v + sg * xc[t]
            for t in range(c):
                b.LB[K + t] = row[d + 1] + lw[k + t]
                b.INV[K + t] = 1.0
            K += c
            k += c
            if K == SMI_TILE or (j == j1 - 1 and k == G):
                top = smi_tile_sums(1, f, par, 0, n_node, data, delta, omega, Vinv, const0, R, T, d, 0, K,
                                    omega, acc.mx - SMI_SKIP, buf, part)
                if top >= acc.mx - SMI_SKIP and top > -INFINITY:
                    _add_sums(&acc, top, part)
                K = 0
    _acc_finish(&acc, log_z, mean, second)
    free(buf)


def polar_arcs(const long[::1] sample, const long[::1] seg_b0, const long[::1] seg_b1,
               const long[::1] seg_ring, const long[:, :, ::1] window, const long[::1] start,
               unsigned char[::1] used, int[::1] kept, long[::1] who, long[::1] lo, long[::1] hi):
    """Each sample's arcs of the polar rule's blocks as node ranges (``polar._arc_plan``).
    Segment j of sample[j] runs over blocks seg_b0[j]:seg_b1[j], ring seg_ring[j] + k of the
    sample's ``window`` for its k-th block, whose nodes start at start[b] and of which the
    ranges [lo', hi') and [lo, hi) = window[i, ring, 3:5], window[i, ring, 1:3] count.  Marks
    ``used`` (the nodes some range covers) and writes ``kept`` (used.size + 1, zeros on entry:
    kept[k] the used nodes before k), then the ranges in the numbering of the used nodes alone,
    ranges of a sample that adjoin there merged: (who, lo, hi)[:m].  Returns m."""
    cdef Py_ssize_t n_seg = seg_b0.shape[0], total = used.shape[0], j, k, b, r = 0, m = 0
    cdef long ring, a0, a1
    cdef int c = 0, part
    if kept.shape[0] != total + 1:
        raise ValueError("polar_arcs needs kept of one more entry than used")
    with nogil:
        for j in range(n_seg):              # the ranges in the set-up nodes' numbering
            for b in range(seg_b0[j], seg_b1[j]):
                ring = seg_ring[j] + b - seg_b0[j]
                for part in range(3, 0, -2):
                    a0, a1 = window[sample[j], ring, part], window[sample[j], ring, part + 1]
                    if a1 > a0:
                        who[r], lo[r], hi[r] = sample[j], start[b] + a0, start[b] + a1
                        kept[lo[r]] += 1
                        kept[hi[r]] -= 1
                        r += 1
        for k in range(total):              # kept: the running cover, then the used nodes before k
            c += kept[k]
            used[k] = c > 0
        c = 0
        for k in range(total + 1):
            kept[k] = c
            if k < total:
                c += used[k]
        for j in range(r):                  # renumbered in place (m ≤ j), adjoining ranges merged
            a0, a1 = kept[lo[j]], kept[hi[j]]
            if m > 0 and who[m - 1] == who[j] and hi[m - 1] == a0:
                hi[m - 1] = a1
            else:
                who[m], lo[m], hi[m] = who[j], a0, a1
                m += 1
    return m


def polar_product(const long[::1] blocks, const long[::1] offset, const long[::1] column, long R1, long R2,
                  const double[:, ::1] x1, const double[::1] lw1, const long[::1] start1,
                  const long[::1] count1, const double[:, ::1] x2, const double[::1] lw2,
                  const long[::1] start2, const long[::1] count2, const unsigned char[::1] keep,
                  double[:, :] nodes, int threads=0):
    """The product of one or two layers' ring rules (``PolarRule._polar_pieces``), block by
    block: block b (a flat index into (groups, R1 rings[, R2 rings])) holds the pairs of ring j
    of layer 1 and ring l of layer 2 of group g, b = (g·R1 + j)·R2 + l, layer 2 fastest.  Of
    the i-th block's pairs, set-up nodes offset[i]… of the mask ``keep`` (empty: all kept), the
    kept ones go to columns column[i]… of ``nodes``: rows the node coordinates (T per layer),
    then the sum of the layers' log weights.  A layer's nodes are its rings' nodes one after
    the other (ring r from start[r], count[r] nodes; groups in order).  R2 = 0: one layer, b =
    g·R1 + j."""
    cdef Py_ssize_t nb = blocks.shape[0], i
    if threads <= 0:
        threads = omp_get_max_threads()
    if nodes.shape[0] < x1.shape[1] * (2 if R2 > 0 else 1) + 1:
        raise ValueError("polar_product needs a row per coordinate and one for the log weight")
    with nogil:
        for i in prange(nb, num_threads=threads, schedule="static"):
            _product_block(blocks[i], offset[i], column[i], R1, R2, x1, lw1, start1, count1, x2, lw2,
                           start2, count2, keep, nodes)


cdef void _product_block(long b, long off, long col, long R1, long R2, const double[:, ::1] x1,
                         const double[::1] lw1, const long[::1] start1, const long[::1] count1,
                         const double[:, ::1] x2, const double[::1] lw2, const long[::1] start2,
                         const long[::1] count2, const unsigned char[::1] keep,
                         double[:, :] nodes) noexcept nogil:
    """One block of ``polar_product``."""
    cdef long ring1 = b // R2 if R2 > 0 else b, ring2 = (b // (R1 * R2)) * R2 + b % R2 if R2 > 0 else 0
    cdef long a, c, n2 = count2[ring2] if R2 > 0 else 1
    cdef int j, T = x1.shape[1], m = T * (2 if R2 > 0 else 1)
    cdef bint all_kept = keep.shape[0] == 0
    for a in range(start1[ring1], start1[ring1] + count1[ring1]):
        for c in range(n2):
            if all_kept or keep[off]:
                for j in range(T):
                    nodes[j, col] = x1[a, j]
                nodes[m, col] = lw1[a]
                if R2 > 0:
                    for j in range(T):
                        nodes[T + j, col] = x2[start2[ring2] + c, j]
                    nodes[m, col] += lw2[start2[ring2] + c]
                col += 1
            off += 1


cdef void _polar_sample(const double* u, const double* omega, const double* Vinv, double logdetV,
                        int L, int T, double delta, const double* nodes, Py_ssize_t rows, Py_ssize_t stride,
                        const long* seg_start, const long* seg_stop, Py_ssize_t n_seg,
                        double* log_z, double* mean, double* second) noexcept nogil:
    """One sample of ``integrate_polar`` (node k's value j < rows at nodes[j·stride + k]) over
    its segments: L ≥ 2 by tiles of SMI_TILE nodes (``_polar_range``); L = 1 (route 1) node by
    node with a running maximum (``_add``; per node h_1 = u_1 — Φ = I — the log constant and
    the two terms ±h_1)."""
    cdef Acc acc
    cdef Py_ssize_t k, s, end
    cdef int j, m = T * (L - 1) if delta == 0 else 2 * L    # the log weight's row
    cdef int RT = T * L
    cdef double h[2]
    cdef double lc, r2
    cdef double* buf = NULL
    cdef double* part = NULL
    cdef double* gather = NULL
    cdef Py_ssize_t filled = 0
    cdef double const0 = -0.5 * T * (L * log(2 * M_PI) + logdetV)
    if delta > 0:
        const0 -= 2.0 * log(2 * M_PI * delta)
    _acc_init(&acc, RT)
    if L >= 2:
        buf = <double*> malloc(((10 + rows) * SMI_TILE + 1 + RT + RT * (RT + 1) // 2) * sizeof(double))
        gather = buf + 10 * SMI_TILE
        part = gather + rows * SMI_TILE
    for s in range(n_seg):
        k, end = seg_start[s], seg_stop[s]
        if L >= 2:
            _polar_range(&acc, u, omega, Vinv, const0, delta, L, T, m, nodes, rows, stride, k, end, &filled,
                         gather, buf, part)
        else:                           # L = 1 (route 1): h_1 = u_1, the terms ±u_1
            for k in range(k, end):
                r2 = 0.0
                for j in range(4):
                    r2 += (u[j] - nodes[(m + 6 + j) * stride + k]) ** 2
                lc = const0 + nodes[m * stride + k] - 0.5 * r2 / delta
                h[0], h[1] = nodes[k], nodes[stride + k]
                for j in range(2):      # g is even in u_1
                    h[0], h[1] = -h[0], -h[1]
                    _add(&acc, lc - 0.5 * Vinv[0] * ((h[0] - omega[0]) ** 2 + (h[1] - omega[1]) ** 2), h, omega)
    if filled:
        _polar_tile(&acc, u, omega, Vinv, const0, delta, L, T, m, gather, SMI_TILE, filled, buf, part)
    free(buf)
    _acc_finish(&acc, log_z, mean, second)


cdef inline void _polar_range(Acc* acc, const double* u, const double* omega, const double* Vinv,
                              double const0, double delta, int L, int T, int m, const double* nodes,
                              Py_ssize_t rows, Py_ssize_t stride, Py_ssize_t k, Py_ssize_t end,
                              Py_ssize_t* filled, double* gather, double* buf, double* part) noexcept nogil:
    """Nodes k:end into the sums by tiles (``_polar_tile``: ``smi_polar2``, ``smi_polar3``, two
    passes each, the tiles' sums merged at their maxima): pieces of at least POLAR_IN_PLACE nodes
    read in place, shorter ones gathered into a tile with the next ranges' (``filled`` of it so
    far; the copies were 15 % of a three-layer call at q = 0.9·I, where most rings' arcs are
    16-64 nodes, 10 % with pieces from 128 nodes read in place)."""
    cdef Py_ssize_t cnt
    cdef int j
    while k < end:
        cnt = min(SMI_TILE, end - k)
        if cnt >= POLAR_IN_PLACE:
            _polar_tile(acc, u, omega, Vinv, const0, delta, L, T, m, nodes + k, stride, cnt, buf, part)
        else:
            cnt = min(SMI_TILE - filled[0], cnt)
            for j in range(rows):
                memcpy(gather + j * SMI_TILE + filled[0], nodes + j * stride + k, cnt * sizeof(double))
            filled[0] += cnt
            if filled[0] == SMI_TILE:
                _polar_tile(acc, u, omega, Vinv, const0, delta, L, T, m, gather, SMI_TILE, filled[0], buf, part)
                filled[0] = 0
        k += cnt


cdef inline void _polar_tile(Acc* acc, const double* u, const double* omega, const double* Vinv,
                             double const0, double delta, int L, int T, int m, const double* nodes,
                             Py_ssize_t stride, Py_ssize_t cnt, double* buf, double* part) noexcept nogil:
    """One tile of ``_polar_sample``: cnt nodes (columns of ``nodes``) into the sums, unless
    all are below e^-SMI_SKIP of the running maximum."""
    cdef double top, floor = acc.mx - SMI_SKIP
    if T == 3:
        top = smi_sphere2(u, omega, Vinv, const0, nodes, stride, cnt, floor, buf, part)
    elif L == 2:
        top = smi_polar2(u, omega, Vinv, const0, delta, nodes, stride, cnt, m, floor, buf, part)
    else:
        top = smi_polar3(u, omega, Vinv, const0, nodes, stride, cnt, floor, buf, part)
    if top >= floor:
        _add_sums(acc, top, part)


cdef struct Problem:
    int route, R, T, d, n_node, n_data, n_out
    kernel_t f              # the kernel with Jacobian: route 0 [h; logdet; ∂(h, logdet)/∂x], route 1 [g; ∂g/∂Z]
    const double* par
    const double* data      # route 0: u_L (T); route 1: y (n_node)
    const double* omega
    const double* Vinv
    double const0           # -½ T (R log 2π + log det V) (route 1 also - ½ k log 2πΔ)
    double delta
    double* work            # scratch: node_in (n_data + d), node_out, Z, r, Pr, D (RT×d), PD (RT×d)


cdef inline void _per_token_left(const double* M, int R, int T, const double* X, int m, double* out) noexcept nogil:
    """out = (M ⊗ I_T) X for X of RT rows (index a·T + t) and m columns, M R × R."""
    cdef int a, b, t, j
    cdef double acc
    for a in range(R):
        for t in range(T):
            for j in range(m):
                acc = 0.0
                for b in range(R):
                    acc += M[a * R + b] * X[(b * T + t) * m + j]
                out[(a * T + t) * m + j] = acc


cdef double _evaluate(Problem* p, const double* x, double sign, double* grad, double* H) noexcept nogil:
    """log f(x), its gradient and the Gauss–Newton Hessian Dᵀ P D (+ JᵀJ/Δ), P = V⁻¹ ⊗ I_T."""
    cdef int R = p.R, T = p.T, d = p.d, RT = p.R * p.T, k = p.n_node, i, j, a, b, t
    cdef double* node_in = p.work
    cdef double* out = node_in + p.n_data + d
    cdef double* Z = out + p.n_out
    cdef double* r = Z + RT
    cdef double* Pr = r + RT
    cdef double* D = Pr + RT
    cdef double* PD = D + RT * d
    cdef double logf, acc
    if p.route == 0:
        for i in range(p.n_data):
            node_in[i] = p.data[i]
        for i in range(d):
            node_in[p.n_data + i] = x[i]
        p.f(node_in, p.par, out)                 # out: h (T), logdet, then (T+1)×d Jacobian
        for i in range(d):
            Z[i] = x[i]
        for i in range(T):
            Z[d + i] = sign * out[i]
        for i in range(RT):
            for j in range(d):
                D[i * d + j] = (1.0 if i == j else 0.0) if i < d else sign * out[T + 1 + (i - d) * d + j]
    else:
        p.f(x, p.par, out)                       # out: g (k), then k×RT Jacobian
        for i in range(RT):
            Z[i] = x[i]
    for i in range(RT):
        r[i] = Z[i] - p.omega[i]
    _per_token_left(p.Vinv, R, T, r, 1, Pr)
    logf = p.const0
    for i in range(RT):
        logf -= 0.5 * r[i] * Pr[i]
    if p.route == 0:
        logf -= out[T]
        for j in range(d):
            grad[j] = -out[T + 1 + T * d + j]
            for i in range(RT):
                grad[j] -= D[i * d + j] * Pr[i]
        _per_token_left(p.Vinv, R, T, D, d, PD)
        for i in range(d):
            for j in range(d):
                acc = 0.0
                for a in range(RT):
                    acc += D[a * d + i] * PD[a * d + j]
                H[i * d + j] = acc
    else:
        for i in range(k):
            logf -= 0.5 * (p.data[i] - out[i]) ** 2 / p.delta
        for i in range(RT):
            grad[i] = -Pr[i]
            for j in range(k):
                grad[i] += out[k + j * RT + i] * (p.data[j] - out[j]) / p.delta
        for a in range(R):
            for t in range(T):
                for b in range(R):
                    for i in range(T):
                        H[(a * T + t) * RT + b * T + i] = p.Vinv[a * R + b] if i == t else 0.0
        for i in range(RT):
            for j in range(RT):
                acc = 0.0
                for a in range(k):
                    acc += out[k + a * RT + i] * out[k + a * RT + j]
                H[i * RT + j] += acc / p.delta
    return logf


cdef int _cholesky_solve(double* H, double* rhs, double* L, int d) noexcept nogil:
    """Solve H s = rhs (s written into rhs) by Cholesky; returns 0 if H is not positive definite."""
    cdef int i, j, k
    cdef double acc
    for i in range(d):
        for j in range(i + 1):
            acc = H[i * d + j]
            for k in range(j):
                acc -= L[i * d + k] * L[j * d + k]
            if i == j:
                if not acc > 0:
                    return 0
                L[i * d + i] = sqrt(acc)
            else:
                L[i * d + j] = acc / L[j * d + j]
    for i in range(d):
        acc = rhs[i]
        for k in range(i):
            acc -= L[i * d + k] * rhs[k]
        rhs[i] = acc / L[i * d + i]
    for i in range(d - 1, -1, -1):
        acc = rhs[i]
        for k in range(i + 1, d):
            acc -= L[k * d + i] * rhs[k]
        rhs[i] = acc / L[i * d + i]
    return 1


cdef void _newton(Problem* p, double* x, double sign, double* logf_out, double* H,
                  int iterations, double tol) noexcept nogil:
    """Damped Gauss–Newton ascent of log f from x (in place); halve the step until log f does
    not decrease.  Leaves x at the end point, log f there and the GN Hessian in H."""
    cdef int d = p.d, it, i, halvings, ok
    cdef double* grad = <double*> malloc((5 * d + 2 * d * d) * sizeof(double))
    cdef double* step = grad + d
    cdef double* trial = step + d
    cdef double* g2 = trial + d
    cdef double* tmp = g2 + d
    cdef double* H2 = tmp + d
    cdef double* L = H2 + d * d
    cdef double logf = _evaluate(p, x, sign, grad, H), lf2, t, dec
    for it in range(iterations):
        if not isfinite(logf):
            break
        for i in range(d):
            step[i] = grad[i]
        if not _cholesky_solve(H, step, L, d):
            break
        dec = 0.0
        for i in range(d):
            dec += step[i] * grad[i]
        if dec < tol * tol:
            break
        t = 1.0
        ok = 0
        for halvings in range(20):
            for i in range(d):
                trial[i] = x[i] + t * step[i]
            lf2 = _evaluate(p, trial, sign, g2, H2)
            if lf2 >= logf:
                ok = 1
                break
            t *= 0.5
        if not ok:
            break
        for i in range(d):
            x[i] = trial[i]
            grad[i] = g2[i]
        for i in range(d * d):
            H[i] = H2[i]
        logf = lf2
    logf_out[0] = logf
    free(grad)


def modes(int route, capsule, const double[::1] params, const double[:, ::1] data,
          const double[:, ::1] omega, const double[:, :, ::1] Vinv, const double[::1] const0,
          double[:, :, ::1] x, const double[:, ::1] signs, double[:, ::1] logf,
          double[:, :, :, ::1] H, int R, int T, int n_node, double delta,
          int iterations=50, double tol=1e-6, int threads=0):
    """Laplace modes: Gauss–Newton from every start x[i, k] (in place), with log f and the
    Gauss–Newton Hessian at the end point."""
    cdef kernel_t f = <kernel_t> PyCapsule_GetPointer(capsule, "smi_kernel")
    cdef Py_ssize_t n = x.shape[0], i
    cdef int K = x.shape[1], d = x.shape[2], k, RT = R * T, n_data = data.shape[1]
    cdef int n_out = n_node * (1 + d)
    if threads <= 0:
        threads = omp_get_max_threads()
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _modes_one(route, f, &params[0], &data[i, 0], n_data, &omega[i, 0], &Vinv[i, 0, 0],
                       const0[i], &x[i, 0, 0], &signs[i, 0], &logf[i, 0], &H[i, 0, 0, 0],
                       K, d, R, T, n_node, n_out, delta, iterations, tol)


cdef void _modes_one(int route, kernel_t f, const double* par, const double* data, int n_data,
                     const double* omega, const double* Vinv, double const0, double* x,
                     const double* signs, double* logf, double* H, int K, int d, int R, int T,
                     int n_node, int n_out, double delta, int iterations, double tol) noexcept nogil:
    cdef Problem p
    cdef int k, RT = R * T
    p.route, p.R, p.T, p.d, p.n_node, p.n_data, p.n_out = route, R, T, d, n_node, n_data, n_out
    p.f, p.par, p.data, p.omega, p.Vinv, p.const0, p.delta = f, par, data, omega, Vinv, const0, delta
    p.work = <double*> malloc((n_data + d + n_out + 3 * RT + 2 * RT * d) * sizeof(double))
    for k in range(K):
        _newton(&p, x + k * d, signs[k], logf + k, H + k * d * d, iterations, tol)
    free(p.work)


# -- adaptive cubature (Genz–Malik 7/5) for samples the tensor rule does not resolve ------------

cdef double GM_L2 = sqrt(9.0 / 70.0), GM_L3 = sqrt(9.0 / 10.0), GM_L5 = sqrt(9.0 / 19.0)


cdef int _gm_points(int d, const double* c, const double* h, double* xi, long st, double* w7,
                    double* w5) noexcept nogil:
    """The Genz–Malik points on the box c ± h into xi (d rows of stride st) with the degree-7 and
    degree-5 rules' weights (the box's volume included): the centre; per axis i, ±λ₂ and ±λ₃
    along it (points 1 + 4i … 4 + 4i, the fourth differences); ±λ₃ on pairs of axes; the corners
    ±λ₅ (weight 0 in the 5-rule).  Returns their count (``_gm_count``)."""
    cdef int i, j, k, corner, p = 1
    cdef double vol = 1.0
    cdef double lam[4]
    cdef double w[4]
    cdef double v[4]
    for i in range(d):
        vol *= 2.0 * h[i]
    lam[0], lam[1], lam[2], lam[3] = GM_L2, -GM_L2, GM_L3, -GM_L3
    w[0] = w[1] = vol * 980.0 / 6561.0
    w[2] = w[3] = vol * (1820.0 - 400.0 * d) / 19683.0
    v[0] = v[1] = vol * 245.0 / 486.0
    v[2] = v[3] = vol * (265.0 - 100.0 * d) / 1458.0
    for j in range(_gm_count(d)):
        for i in range(d):
            xi[i * st + j] = c[i]
    w7[0] = vol * (12824.0 - 9120.0 * d + 400.0 * d * d) / 19683.0
    w5[0] = vol * (729.0 - 950.0 * d + 50.0 * d * d) / 729.0
    for i in range(d):
        for k in range(4):
            xi[i * st + p] += lam[k] * h[i]
            w7[p], w5[p] = w[k], v[k]
            p += 1
    for i in range(d):
        for j in range(i + 1, d):
            for k in range(4):
                xi[i * st + p] += (GM_L3 if k & 1 else -GM_L3) * h[i]
                xi[j * st + p] += (GM_L3 if k & 2 else -GM_L3) * h[j]
                w7[p], w5[p] = vol * 200.0 / 19683.0, vol * 25.0 / 729.0
                p += 1
    for corner in range(1 << d):
        for i in range(d):
            xi[i * st + p] += (GM_L5 if (corner >> i) & 1 else -GM_L5) * h[i]
        w7[p], w5[p] = vol * 6859.0 / 19683.0 / (1 << d), 0.0
        p += 1
    return p


cdef double _values(Site* s, int m, int np) noexcept nogil:
    """The integrand at the np points ξ_j of s.xi (piece m), by columns: s.WC[k·np + j] =
    e^(lb_j + lf_kj - mx), the weight of term k at point j.  The points x = c_m + A_m ξ and their
    partition weights (``smi_place``); polar sites (``integrate_polar_adaptive``): ξ = (t, θ),
    x = √t (cos θ, sin θ), dx = ½ dt dθ; with d = 4 also ξ = (t_1, θ_1, t_2, θ_2), u_2 =
    √t_2 (cos θ_2, sin θ_2) and x = (h_1, Φ⁽¹⁾(h_1)⁻¹u_2), dx = ¼ dt_1 dθ_1 dt_2 dθ_2 / |det Φ⁽¹⁾|
    (``smi_polar_points``, ``smi_polar_layer2``).  The terms as ``smi_term_logs``, their Z in s.X
    with the signs of ``smi_sign``.  Returns mx, relative to s.shift (-inf if nothing is finite)."""
    cdef int d = s.d, j
    cdef long st = s.st
    cdef double mx
    cdef const double* inv = NULL
    if s.polar:
        smi_polar_points(d, np, st, s.xi, s.X, s.IN1, s.LB)
        if d == 4:
            s.f1(s.IN1, st, s.par, s.OUT1, st, np)
            smi_polar_layer2(np, st, s.OUT1, s.X, s.LB)
        for j in range(np):
            s.LB[j] -= s.shift
    else:
        for j in range(np):
            s.LB[j] = s.ldA[m] - s.shift
        smi_place(d, s.M, m, s.centers, s.A, s.H, s.logh, s.xi, 1, st, np, st, s.X, s.LQ, s.LB, s.INV, s.LMX)
        inv = s.INV
    s.f(s.buf if s.route == 0 else s.X, st, s.par, s.KO, st, np)
    smi_last_layer(s.route, s.T, d, np, st, s.KO, s.X, s.OK)
    mx = smi_term_logs(s.route, s.nt, s.R, s.T, d, np, st, s.X, s.KO, s.OK, s.omega, s.Vinv, s.const0,
                       s.n_node, s.data, s.delta, s.LB, s.LF)
    smi_weights(s.nt, np, st, mx if mx > -INFINITY else 0.0, inv, s.LF, s.WC)
    return mx


cdef double _region(Site* s, int m, const double* c, const double* h, double* S, double* scratch,
                    const double* whiten, int* axis) noexcept nogil:
    """Genz–Malik degree-7 rule on the box c ± h (component m): moment sums into S (1 + RT + RT²;
    the second moments' upper triangle), relative to e^s.shift, returns the error and the axis
    to split.  Error: Σ of the absolute entries of the 7-rule - 5-rule difference in mass, W·S1
    and W·S2·Wᵀ (the upper triangle), W = ``whiten`` (RT × RT, L⁻¹ ⊗ I_T for V = LLᵀ: then an
    error ε·mass moves g_out by ≤ ε/√λ_min(V) and dg_out = V⁻¹(Cov - V)V⁻¹ by ≤ ε/λ_min(V)).
    A box whose largest term is below e^-300 of the shift adds nothing (its terms are weighed
    relative to that largest term, ``smi_weights``).  ``scratch``: n + 2 RT² values."""
    cdef int d = s.d, RT = s.R * s.T, n = 1 + RT + RT * RT, n_sums = 1 + RT + RT * (RT + 1) // 2
    cdef int i, j, a, b, k, r, np
    cdef long st = s.st
    cdef double fd, fdmax = -1.0, f0, err, t, mx, scale
    cdef double* D
    cdef double* WD
    cdef double* Sb = scratch
    cdef double* f = s.mass
    np = _gm_points(d, c, h, s.xi, st, s.w7, s.w5)
    mx = _values(s, m, np)
    scale = exp(mx) if mx > -300.0 else 0.0
    smi_rule_weights(s.nt, np, s.WC, s.w7, s.w5, s.W, s.mass)
    smi_expand(s.nt, RT, s.T, d, np, st, s.X, s.ref, s.ZC)
    smi_sums(s.nt * np, RT, 2, s.W, s.ZC, s.packed)
    for i in range(n):
        S[i] = 0.0
        Sb[i] = 0.0
    S[0], Sb[0] = scale * s.packed[0], scale * s.packed[n_sums]
    r = 1 + RT
    for i in range(RT):
        S[1 + i], Sb[1 + i] = scale * s.packed[1 + i], scale * s.packed[n_sums + 1 + i]
        for j in range(i, RT):
            S[1 + RT + i * RT + j], Sb[1 + RT + i * RT + j] = scale * s.packed[r], scale * s.packed[n_sums + r]
            r += 1
    f0 = f[0]
    axis[0] = 0
    for i in range(d):                          # the fourth differences along each axis
        fd = fabs(f[1 + 4 * i] + f[2 + 4 * i] - 2 * f0
                  - (GM_L2 * GM_L2 / (GM_L3 * GM_L3)) * (f[3 + 4 * i] + f[4 + 4 * i] - 2 * f0))
        if fd > fdmax * (1 + 1e-12):
            fdmax, axis[0] = fd, i
    D = scratch + n                             # the second moments' difference, then W·D
    WD = D + RT * RT
    for a in range(RT):
        for b in range(a, RT):
            D[a * RT + b] = D[b * RT + a] = S[1 + RT + a * RT + b] - Sb[1 + RT + a * RT + b]
    err = fabs(S[0] - Sb[0])
    for a in range(RT):
        t = 0.0
        for b in range(RT):
            t += whiten[a * RT + b] * (S[1 + b] - Sb[1 + b])
            WD[a * RT + b] = 0.0
            for k in range(RT):
                WD[a * RT + b] += whiten[a * RT + k] * D[k * RT + b]
        err += fabs(t)
    for a in range(RT):
        for b in range(a, RT):
            t = 0.0
            for k in range(RT):
                t += WD[a * RT + k] * whiten[b * RT + k]
            err += fabs(t)
    return err


cdef inline void _heap_push(int* heap, int* size, const double* key, int k) noexcept nogil:
    """Max-heap of region indices ordered by ``key``."""
    cdef int i = size[0], parent
    size[0] += 1
    while i > 0:
        parent = (i - 1) // 2
        if key[heap[parent]] >= key[k]:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = k


cdef inline int _heap_pop(int* heap, int* size, const double* key) noexcept nogil:
    cdef int top = heap[0], last, i = 0, child
    size[0] -= 1
    last = heap[size[0]]
    while 2 * i + 1 < size[0]:
        child = 2 * i + 1
        if child + 1 < size[0] and key[heap[child + 1]] > key[heap[child]]:
            child += 1
        if key[last] >= key[heap[child]]:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = last
    return top


cdef inline int _ipow(int b, int e) noexcept nogil:
    cdef int r = 1
    for _ in range(e):
        r *= b
    return r


cdef int _tile(double* c, double* h, int d, int split, double bound) noexcept nogil:
    """split^d equal boxes tiling ±bound in d dimensions into c, h (centres, half-widths);
    returns their count."""
    cdef int j, i, k, count = _ipow(split, d)
    cdef double w = bound / split
    for j in range(count):
        k = j
        for i in range(d):
            c[j * d + i] = -bound + (2 * (k % split) + 1) * w
            h[j * d + i] = w
            k //= split
    return count


cdef void _adaptive_one(Site* s, const double* whiten, double bound, const int* split, double tol,
                        int max_regions, double* log_z, double* mean, double* second, int* used,
                        double* achieved, const double* V, double amp) noexcept nogil:
    """Start from split[m]^d equal boxes tiling ±bound (whitened coordinates) of every active
    piece m."""
    cdef int d = s.d, m, j, count = 0, total = 0
    for m in range(s.M):
        total += _ipow(split[m], d)
    cdef double* c = <double*> malloc(2 * total * d * sizeof(double))
    cdef double* h = c + total * d
    cdef int* piece = <int*> malloc(total * sizeof(int))
    for m in range(s.M):
        if not s.logh[m] > -INFINITY:
            continue
        for j in range(_tile(c + count * d, h + count * d, d, split[m], bound)):
            piece[count] = m
            count += 1
    _adaptive_regions(s, whiten, c, h, piece, count, tol, max_regions, log_z, mean, second, used, achieved,
                      V, amp)
    free(c)
    free(piece)


cdef double _kappa(Site* s, const double* V, double amp, const double* tot, double* work) noexcept nogil:
    """κ = max(1, amp / M), M the largest entry of (g_out, dg_out) from the moment sums ``tot``
    (about s.ref; upper triangle of the second moments), amp = max(λ_min(V)^-½, λ_min(V)⁻¹): an
    error ε·mass in the whitened moments moves the metric (relative to M) by ≤ εκ
    (``channels._amp``).  ``work``: 2 RT² values."""
    cdef int R = s.R, T = s.T, RT = R * T, i, j
    cdef double M = 0.0, x
    cdef double* D = work
    cdef double* PD = work + RT * RT
    for i in range(RT):                     # g_out = (V⁻¹ ⊗ I)(E[Z] - ω)
        D[i] = s.ref[i] + tot[1 + i] / tot[0] - s.omega[i]
    _per_token_left(s.Vinv, R, T, D, 1, PD)
    for i in range(RT):
        M = fmax(M, fabs(PD[i]))
    for i in range(RT):                     # D = Cov - V ⊗ I
        for j in range(i, RT):
            x = tot[1 + RT + i * RT + j] / tot[0] - tot[1 + i] * tot[1 + j] / (tot[0] * tot[0])
            if i % T == j % T:
                x -= V[(i // T) * R + j // T]
            D[i * RT + j] = D[j * RT + i] = x
    _per_token_left(s.Vinv, R, T, D, RT, PD)      # dg_out = (V⁻¹ ⊗ I) D (V⁻¹ ⊗ I), D symmetric:
    for i in range(RT):                             # its rows are (V⁻¹ ⊗ I) applied to PD's rows
        _per_token_left(s.Vinv, R, T, PD + i * RT, 1, D)
        for j in range(RT):
            M = fmax(M, fabs(D[j]))
    return fmax(1.0, amp / fmax(M, 1e-300))


cdef inline void _bisect(double* c, double* h, int d, int b, int k, int ax) noexcept nogil:
    """Halve box b (centres c, half-widths h, d per box) across axis ax: its halves are b and k."""
    cdef int i
    h[b * d + ax] *= 0.5
    for i in range(d):
        c[k * d + i] = c[b * d + i]
        h[k * d + i] = h[b * d + i]
    c[b * d + ax] -= h[b * d + ax]
    c[k * d + ax] += h[b * d + ax]


cdef void _adaptive_regions(Site* s, const double* whiten, const double* c0, const double* h0,
                            const int* piece, int n0, double tol, int max_regions,
                            double* log_z, double* mean, double* second, int* used,
                            double* achieved, const double* V=NULL, double amp=0.0) noexcept nogil:
    """Globally adaptive Genz–Malik cubature from the n0 boxes c0 ± h0 (of pieces ``piece``):
    bisect the box of largest error along its axis of largest fourth difference until
    Σ|I7 - I5| ≤ tol · mass or max_regions is reached.  With ``V`` (R × R): until
    κ Σ|I7 - I5| ≤ tol · mass, κ (``_kappa``) from the running sums, so that tol bounds the
    metric of (g_out, dg_out) rather than the whitened moments; ``achieved`` is then κ Σ|I7 - I5| / mass."""
    cdef int d = s.d, RT = s.R * s.T, n = 1 + RT + RT * RT, m, k, i, j, count = 0, best, ax
    cdef double* rc = <double*> malloc(max_regions * (2 * d + 1 + n) * sizeof(double))
    cdef double* rh = rc + max_regions * d
    cdef double* rerr = rh + max_regions * d
    cdef double* rS = rerr + max_regions
    cdef int* rm = <int*> malloc(3 * max_regions * sizeof(int))
    cdef int* raxis = rm + max_regions
    cdef int* heap = raxis + max_regions
    cdef int size = 0
    cdef double* scratch = <double*> malloc((n + 2 * RT * RT) * sizeof(double))
    cdef double err_total = 0.0, kappa = 1.0
    cdef double* tot = <double*> malloc((n + 2 * RT * RT) * sizeof(double))      # running sums (tot[0]: mass), work
    for i in range(n):
        tot[i] = 0.0
    for k in range(min(n0, max_regions)):
        for i in range(d):
            rc[count * d + i] = c0[k * d + i]
            rh[count * d + i] = h0[k * d + i]
        rm[count] = piece[k]
        rerr[count] = _region(s, rm[count], rc + count * d, rh + count * d, rS + count * n, scratch, whiten, raxis + count)
        err_total += rerr[count]
        for i in range(n):
            tot[i] += rS[count * n + i]
        count += 1
    for k in range(count):
        _heap_push(heap, &size, rerr, k)
    if V != NULL:
        kappa = _kappa(s, V, amp, tot, scratch + n)
    while err_total * kappa > tol * fabs(tot[0]) and count < max_regions:
        best = _heap_pop(heap, &size, rerr)
        ax = raxis[best]
        err_total -= rerr[best]
        for i in range(n):
            tot[i] -= rS[best * n + i]
        _bisect(rc, rh, d, best, count, ax)
        rm[count] = rm[best]
        count += 1
        for j in range(2):
            k = best if j == 0 else count - 1
            rerr[k] = _region(s, rm[k], rc + k * d, rh + k * d, rS + k * n, scratch, whiten, raxis + k)
            err_total += rerr[k]
            for i in range(n):
                tot[i] += rS[k * n + i]
            _heap_push(heap, &size, rerr, k)
        if V != NULL:
            kappa = _kappa(s, V, amp, tot, scratch + n)
    for i in range(n):
        scratch[i] = 0.0
    for k in range(count):
        for i in range(n):
            scratch[i] += rS[k * n + i]
    log_z[0] = s.shift + log(scratch[0])
    for i in range(RT):
        mean[i] = scratch[1 + i] / scratch[0]
        for j in range(i, RT):
            second[i * RT + j] = scratch[1 + RT + i * RT + j] / scratch[0]
            second[j * RT + i] = second[i * RT + j]
    used[0] = count
    if V != NULL:
        kappa = _kappa(s, V, amp, scratch, tot + n)
    achieved[0] = err_total * kappa / fabs(tot[0])
    free(tot)
    free(rc)
    free(rm)
    free(scratch)


def integrate_adaptive(int route, capsule, const double[::1] params, const double[:, ::1] data,
                       const double[:, ::1] omega, const double[:, :, ::1] Vinv,
                       const double[::1] const0, const double[:, :, ::1] centers,
                       const double[:, :, :, ::1] A, const double[:, :, :, ::1] H,
                       const double[:, ::1] logh, const double[:, ::1] ref,
                       const double[:, :, ::1] whiten, int R, int T, int n_node, double delta,
                       double tol, int max_regions, double bound, const int[::1] split,
                       double[::1] log_z, double[:, ::1] mean, double[:, :, ::1] second,
                       int[::1] used, double[::1] achieved, int threads=0,
                       const double[:, :, ::1] V=None, const double[::1] amp=None,
                       jacobian=None, const double[::1] ridge=None, const double[::1] lam=None):
    """Adaptive Genz–Malik cubature of every partition piece over the box ±bound (whitened
    coordinates of its component), until Σ|I7 - I5| ≤ tol · mass or max_regions is reached
    (the moments' differences whitened by ``whiten``, (n, RT, RT): see ``_region``), starting from
    split[m]^d equal boxes for piece m.  With ``V`` (n, R, R) and ``amp`` (n,):
    κ Σ|I7 - I5| ≤ tol · mass (``_adaptive_regions``).  Route 1, d ≤ 4, with ``jacobian`` (the
    kernel x ↦ [g; ∂g/∂x]), ``ridge`` = [reach, width, cap, floor] (reach and width in units of
    y, cap ≥ split[M-1]^d) and ``lam`` (n,): the last piece alone (the caller gives it weight 1),
    from its equal boxes refined onto the likelihood's ridge (``_ridge_boxes``); max_regions
    then counts on top of those boxes."""
    cdef bint metric = V is not None, on_ridge = jacobian is not None
    cdef int d = centers.shape[2]
    if on_ridge and (route != 1 or d > 4 or ridge is None or ridge.shape[0] != 4 or lam is None
                     or lam.shape[0] != omega.shape[0] or ridge[2] < _ipow(split[centers.shape[1] - 1], d)):
        raise ValueError("integrate_adaptive on the ridge needs route 1, d ≤ 4, ridge = [reach, width, cap ≥ "
                         "split[-1]^d, floor] and lam (n,)")
    cdef cols_t f = <cols_t> PyCapsule_GetPointer(capsule, "smi_kernel_cols")
    cdef kernel_t jac = <kernel_t> PyCapsule_GetPointer(jacobian, "smi_kernel") if on_ridge else NULL
    cdef Py_ssize_t n = omega.shape[0], i
    if threads <= 0:
        threads = omp_get_max_threads()
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _adaptive_sample(route, f, &params[0], &data[i, 0], data.shape[1], &omega[i, 0],
                             &Vinv[i, 0, 0], const0[i], &centers[i, 0, 0], &A[i, 0, 0, 0],
                             &H[i, 0, 0, 0], &logh[i, 0], centers.shape[1], d,
                             &ref[i, 0], &whiten[i, 0, 0], R, T, n_node, delta, tol, max_regions, bound, &split[0],
                             &log_z[i], &mean[i, 0], &second[i, 0, 0], &used[i], &achieved[i],
                             &V[i, 0, 0] if metric else NULL, amp[i] if metric else 0.0,
                             jac, &ridge[0] if on_ridge else NULL, lam[i] if on_ridge else 0.0)


cdef void _adaptive_sample(int route, cols_t f, const double* par, const double* data, int n_data,
                           const double* omega, const double* Vinv, double const0,
                           const double* centers, const double* A, const double* H,
                           const double* logh, int M, int d, const double* ref, const double* whiten,
                           int R, int T, int n_node, double delta, double tol, int max_regions,
                           double bound, const int* split, double* log_z, double* mean, double* second,
                           int* used, double* achieved, const double* V, double amp, kernel_t jac,
                           const double* ridge, double lam) noexcept nogil:
    cdef Site s
    cdef double* work = _site_init(&s, route, f, par, data, n_data, omega, Vinv, const0, centers,
                                   A, H, logh, M, d, ref, R, T, n_node, delta)
    cdef int cap, count, k
    cdef double* box
    cdef int* piece
    cdef double top
    if jac == NULL:
        _adaptive_one(&s, whiten, bound, split, tol, max_regions, log_z, mean, second, used, achieved, V, amp)
    else:
        cap = <int> ridge[2]
        box = <double*> malloc(2 * cap * d * sizeof(double))
        piece = <int*> malloc(cap * sizeof(int))
        count = _ridge_boxes(&s, jac, bound, split[M - 1], ridge, lam, box, box + cap * d, &top)
        for k in range(count):
            piece[k] = M - 1
        s.shift = fmax(s.shift, top)        # sums relative to the highest point seen
        _adaptive_regions(&s, whiten, box, box + cap * d, piece, count, tol, max_regions + count, log_z, mean,
                          second, used, achieved, V, amp)
        free(box)
        free(piece)
    free(work)


cdef int _ridge_boxes(Site* s, kernel_t jac, double bound, int split, const double* ridge, double lam,
                      double* c, double* h, double* top) noexcept nogil:
    """The last piece's split^d equal boxes tiling ±bound (ξ, x = c_m + A_m ξ), every box that the
    likelihood's ridge {g(x) = y} may cross halved until g changes by at most ``width`` across it,
    breadth first, into c, h (at most cap boxes; returns their count; ``top``: the highest log
    integrand seen).  With g and J = ∂g/∂x at the box's centre and corners and half-widths h_i,
    g moves by about s_i = max |J A_m e_i| h_i along axis i; the ridge may cross the box where
    min |y − g| − 2 Σ s_i ≤ reach, and the box is then cut across its axis of largest s_i (a
    heuristic, not a bound: g is only sampled) — unless the prior bounds the integrand on the box
    below e^-floor of the highest point seen: the piece being the prior's (centred at ω), its
    exponent is ≥ ½ lam |ξ|², lam = λ_min(A_mᵀ P A_m)."""
    cdef int d = s.d, k = s.n_node, m = s.M - 1, cap = <int> ridge[2], count, head = 0, size, b, p, i, j, a
    cdef int ax, corners = 1 << d
    cdef double reach = ridge[0], width = ridge[1], floor = ridge[3]
    cdef double miss, total, gap2, sq, acc, lf
    cdef double* out = <double*> malloc((k * (1 + d) + 2 * d) * sizeof(double))
    cdef double* xi = out + k * (1 + d)
    cdef double* move = xi + d
    cdef int* queue = <int*> malloc(cap * sizeof(int))
    top[0] = -INFINITY
    count = size = _tile(c, h, d, split, bound)
    for j in range(count):
        queue[j] = j
    while size > 0:
        b = queue[head]
        head = (head + 1) % cap
        size -= 1
        miss = INFINITY
        for i in range(d):
            move[i] = 0.0
        for p in range(corners + 1):            # the centre, then the corners
            for i in range(d):
                xi[i] = c[b * d + i] + (0.0 if p == 0 else (h[b * d + i] if (p - 1) >> i & 1 else -h[b * d + i]))
            _affine(s, m, xi)
            jac(s.x, s.par, out)
            sq = 0.0
            for a in range(k):
                sq += (s.data[a] - out[a]) ** 2
            miss = fmin(miss, sqrt(sq))
            lf = s.const0 - 0.5 * _quad_v(s.x, s.omega, s.Vinv, s.R, s.T) - 0.5 * sq / s.delta
            if lf > top[0]:
                top[0] = lf
            for i in range(d):                  # |J A_m e_i| h_i
                sq = 0.0
                for a in range(k):
                    acc = 0.0
                    for j in range(i, d):
                        acc += out[k + a * d + j] * s.A[(m * d + j) * d + i]
                    sq += acc * acc
                move[i] = fmax(move[i], sqrt(sq) * h[b * d + i])
        total, ax, gap2 = 0.0, 0, 0.0
        for i in range(d):
            total += move[i]
            if move[i] > move[ax]:
                ax = i
            gap2 += fmax(fabs(c[b * d + i]) - h[b * d + i], 0.0) ** 2
        if (miss - 2 * total <= reach and move[ax] > width and count < cap
                and s.const0 - 0.5 * lam * gap2 >= top[0] - floor):
            _bisect(c, h, d, b, count, ax)
            queue[(head + size) % cap] = b
            queue[(head + size + 1) % cap] = count
            size += 2
            count += 1
    free(out)
    free(queue)
    return count


def integrate_polar_adaptive(capsule, const double[::1] params, const double[:, ::1] u,
                             const double[:, ::1] omega, const double[:, ::1] ref,
                             const double[:, :, ::1] Vinv,
                             const double[::1] const0, const double[::1] shift,
                             const double[:, ::1] boxes, const long[::1] start,
                             const double[:, :, ::1] whiten, const double[::1] tol, int max_regions,
                             double[::1] log_z, double[:, ::1] mean, double[:, :, ::1] second,
                             int[::1] used, double[::1] achieved, int threads=0, capsule1=None,
                             const double[:, :, ::1] V=None, const double[::1] amp=None):
    """Route 0, T = 2, L = 2: adaptive Genz–Malik cubature in x = h_1 = √t (cos θ, sin θ) over
    t ≥ 0, θ ∈ [0, π) (the reflection -x is a term of every point); L = 3 (``capsule1``: the
    two-layer node kernel, (u_2, h_1) ↦ [Φ⁽¹⁾⁻¹u_2; log|det Φ⁽¹⁾|]): in (t_1, θ_1, t_2, θ_2) with
    h_1 as above and u_2 = Φ⁽¹⁾h_2 = √t_2 (cos θ_2, sin θ_2), where both layers' softmax cliffs
    are the planes θ_ℓ ∈ {0, π/4, π/2} (each reflection h_ℓ → -h_ℓ a term of every point).
    From the initial boxes rows start[i]:start[i+1] of ``boxes`` = [centre (d), half-widths (d)]
    (the caller chooses them), until Σ|I7 - I5| ≤ tol[i] · mass (whitened, as
    ``integrate_adaptive``).  ``shift`` ≈ the largest
    log integrand (the sums are kept relative to it).  Moments about ``ref`` (n, RT), as
    ``integrate`` (Z at the highest peak: moments about a far ω would lose the covariance along a
    near-singular V's thin direction to cancellation).  With ``V`` (n, R, R) and ``amp`` (n,):
    tol bounds the metric of (g_out, dg_out) instead (``_adaptive_regions``)."""
    cdef cols_t f = <cols_t> PyCapsule_GetPointer(capsule, "smi_kernel_cols")
    cdef cols_t f1 = NULL
    cdef bint metric = V is not None
    cdef Py_ssize_t n = omega.shape[0], i
    cdef int d = boxes.shape[1] // 2, R = Vinv.shape[1]
    if threads <= 0:
        threads = omp_get_max_threads()
    if u.shape[1] != 2 or not ((R == 2 and d == 2) or (R == 3 and d == 4 and capsule1 is not None)):
        raise ValueError("integrate_polar_adaptive needs T = 2 and L = 2 (boxes of 4 values) or "
                         "L = 3 (boxes of 8 values and capsule1)")
    if d == 4:
        f1 = <cols_t> PyCapsule_GetPointer(capsule1, "smi_kernel_cols")
    with nogil:
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            _polar_adaptive_sample(f, f1, &params[0], &u[i, 0], &omega[i, 0], &ref[i, 0], &Vinv[i, 0, 0], const0[i],
                                   shift[i], &boxes[start[i], 0], start[i + 1] - start[i], d, R,
                                   &whiten[i, 0, 0], tol[i], max_regions, &log_z[i], &mean[i, 0],
                                   &second[i, 0, 0], &used[i], &achieved[i],
                                   &V[i, 0, 0] if metric else NULL, amp[i] if metric else 0.0)


cdef void _polar_adaptive_sample(cols_t f, cols_t f1, const double* par, const double* u, const double* omega,
                                 const double* ref, const double* Vinv, double const0, double shift,
                                 const double* boxes, Py_ssize_t nb, int d, int R, const double* whiten,
                                 double tol, int max_regions, double* log_z, double* mean, double* second,
                                 int* used, double* achieved, const double* V, double amp) noexcept nogil:
    cdef Site s
    cdef Py_ssize_t k
    cdef int i
    cdef double logh = 0.0
    cdef double* ch = <double*> malloc(2 * d * nb * sizeof(double))
    cdef int* piece = <int*> malloc(nb * sizeof(int))
    cdef double* work = _site_init(&s, 0, f, par, u, 2, omega, Vinv, const0, NULL, NULL, NULL,
                                   &logh, 1, d, ref, R, 2, 3, 0.0)
    s.polar, s.shift, s.f1, s.nt = 1, shift, f1, 2 << (d // 2)
    for k in range(nb):
        for i in range(d):
            ch[d * k + i] = boxes[2 * d * k + i]
            ch[d * nb + d * k + i] = boxes[2 * d * k + d + i]
        piece[k] = 0
    _adaptive_regions(&s, whiten, ch, ch + d * nb, piece, <int> nb, tol, max_regions,
                      log_z, mean, second, used, achieved, V, amp)
    free(ch)
    free(piece)
    free(work)


def logit_product(const double[::1] a1, const double[::1] w1, const long[::1] p1,
                  const double[::1] a2, const double[::1] w2, const long[::1] p2, double[:, ::1] out,
                  const long[::1] start):
    """Nodes of a tensor rule in the logits a = (a_1, a_2) of a T = 2 softmax layer (smi_core.logit_rule):
    per block k, the product of the axis rules a1[p1[k]:p1[k+1]] (weights w1) and a2[p2[k]:p2[k+1]]
    (weights w2, ascending) over the wedge S = a_1 + a_2 > 0, written from column start[k] of
    ``out`` as rows [h_1 (2), log weight] with h_1 = (a_1, −a_2)/√S, the one-layer pre-image of
    spec §4, and weight w_1 w_2/(2S) (dh_1 = da/(2S)).  start[k + 1] − start[k] must be the
    block's count (``logit_counts``)."""
    cdef Py_ssize_t k, i, j, c
    cdef double S, root
    for k in range(p1.shape[0] - 1):
        c = start[k]
        for i in range(p1[k], p1[k + 1]):
            for j in range(_first_above(a2, p2[k], p2[k + 1], -a1[i]), p2[k + 1]):
                S = a1[i] + a2[j]
                root = sqrt(S)
                out[0, c], out[1, c] = a1[i] / root, -a2[j] / root
                out[2, c] = log(w1[i] * w2[j] / (2 * S))
                c += 1


def logit_counts(const double[::1] a1, const long[::1] p1, const double[::1] a2, const long[::1] p2,
                 long[::1] count):
    """The number of nodes of each block of ``logit_product``, into ``count``."""
    cdef Py_ssize_t k, i
    for k in range(p1.shape[0] - 1):
        count[k] = 0
        for i in range(p1[k], p1[k + 1]):
            count[k] += p2[k + 1] - _first_above(a2, p2[k], p2[k + 1], -a1[i])


cdef Py_ssize_t _first_above(const double[::1] x, Py_ssize_t lo, Py_ssize_t hi, double v) noexcept nogil:
    """The first index in lo:hi of the ascending x with x > v (hi if none)."""
    cdef Py_ssize_t mid
    while lo < hi:
        mid = (lo + hi) // 2
        if x[mid] > v:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef inline Py_ssize_t _count_below(const long[::1] x, long v, bint equal) noexcept nogil:
    """The number of entries of the ascending x below v (with ``equal``: at most v)."""
    cdef Py_ssize_t lo = 0, hi = x.shape[0], mid
    while lo < hi:
        mid = (lo + hi) // 2
        if x[mid] < v or (equal and x[mid] == v):
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline Py_ssize_t _first_piece(const long[::1] edges, long start) noexcept nogil:
    """The piece (edges[p]:edges[p + 1]) that holds node ``start``; a segment start:stop spans
    the pieces _first_piece(start) … _count_below(edges, stop, False) − 1."""
    return _count_below(edges, start, True) - 1


def piece_counts(const long[::1] seg_start, const long[::1] seg_stop, const long[::1] edges, long[::1] ptr):
    """``polar._by_piece``, first pass: each segment seg_start[j]:seg_stop[j] of kept nodes is
    cut at the pieces' ``edges`` (piece p: edges[p]:edges[p + 1]); ptr (edges.shape[0], zeros on
    entry) becomes each piece's first cut segment, ptr[-1] their number."""
    cdef Py_ssize_t j, p, P = edges.shape[0] - 1
    if ptr.shape[0] != edges.shape[0] or seg_stop.shape[0] != seg_start.shape[0]:
        raise ValueError("piece_counts needs one ptr entry per edge and a stop per start")
    with nogil:
        for j in range(seg_start.shape[0]):
            for p in range(_first_piece(edges, seg_start[j]), _count_below(edges, seg_stop[j], False)):
                ptr[p + 1] += 1
        for p in range(P):
            ptr[p + 1] += ptr[p]


def piece_segments(const long[::1] sample, const long[::1] seg_start, const long[::1] seg_stop,
                   const long[::1] edges, const long[::1] ptr, long[::1] who, long[::1] start, long[::1] stop):
    """``polar._by_piece``, second pass (``ptr`` from ``piece_counts``): the cut segments (who,
    start, stop), by piece and within a piece in the segments' order (by sample)."""
    cdef Py_ssize_t j, p, k, P = edges.shape[0] - 1
    cdef long* cursor
    if who.shape[0] < ptr[P] or start.shape[0] < ptr[P] or stop.shape[0] < ptr[P]:
        raise ValueError("piece_segments needs who, start and stop of ptr[-1] entries")
    cursor = <long*> malloc(max(P, 1) * sizeof(long))
    with nogil:
        for p in range(P):
            cursor[p] = ptr[p]
        for j in range(seg_start.shape[0]):
            for p in range(_first_piece(edges, seg_start[j]), _count_below(edges, seg_stop[j], False)):
                k = cursor[p]
                cursor[p] += 1
                who[k], start[k], stop[k] = sample[j], max(seg_start[j], edges[p]), min(seg_stop[j], edges[p + 1])
    free(cursor)


cdef extern from *:
    """
    /* The θ rule's sums for one sample over nodes [k0, k1) (theta_product): K nodes by columns
       (stride K) with rows [Φ⁻¹ (2×2, row-major), log|det Φ|] and W rows [w, 3 moment weights]
       for each of the two weight sets.  h = Φ⁻¹u; the sign s of hᵀPω picks the larger term,
       y = s h − ω its deviation, E = −½ yᵀPy − log|det Φ| its log weight and E − 2|hᵀPω| the
       other's (at −s h).  st = [running max, the sums of each set relative to e^max].  Pass 1
       (``smi_theta_logw``): the tile's E into buf, its max and the reflections' max; the sums are
       rescaled when the tile raises the running max.  Pass 2 (``smi_theta_sums``, in registers,
       h and y recomputed): e = e^(E − max), q = e^−2|hᵀPω| and, per set, [Σ w e(1 + q), Σ w e q,
       Σ w e y (2), Σ w e q y (2), Σ w e (1 + q) y yᵀ (3: 00, 01, 11)] and Σ w_r e (1 + q) per
       moment row r, into sums.  A tile below e^−SMI_THETA_SKIP of the max adds nothing, nor do
       its reflections where all of them are that far below (q = 0: pinned, |hᵀPω| is large).
       512-bit vectors where the host has them.  Three layers at q₃₃ = 0.99 (2026-12-03, one
       core, the levels (21, 21) and (33, 27) of 64 draws): 16 ns per node with 14 weight rows in
       separate passes over buffers, 14 fused with 256-bit vectors, 10.6 with 512, 7.5 skipping
       the reflections; in the channel (all levels, 48 draws) 7.7–9.1, and 7.1–8.3 with the nested
       weights' 8 rows (``outer``). */
    #define SMI_THETA_SUMS 12   /* per set: the 9 sums and 3 moment rows */
    #define SMI_THETA_SKIP 60.0
    #define SMI_THETA_TARGET __attribute__((always_inline, target("prefer-vector-width=512")))
    #define SMI_THETA_NODE                                                                          \
        double h0 = F00[k] * u0 + F01[k] * u1, h1 = F10[k] * u0 + F11[k] * u1;                     \
        double s = h0 * v0 + h1 * v1, sg = s < 0 ? -1.0 : 1.0;                                     \
        double y0 = sg * h0 - w0, y1 = sg * h1 - w1;
    #define SMI_THETA_SET(o, w)                                                                     \
        { double wk = (w)[k], we = wk * e, wq = wk * eq, wt = wk * g;                              \
          o##z += wt; o##m0 += we * y0; o##m1 += we * y1;                                           \
          if (reflect) { o##zq += wq; o##q0 += wq * y0; o##q1 += wq * y1; }                         \
          o##s00 += wt * y0 * y0; o##s01 += wt * y0 * y1; o##s11 += wt * y1 * y1;                   \
          o##r0 += (w)[K + k] * g; o##r1 += (w)[2 * K + k] * g; o##r2 += (w)[3 * K + k] * g; }
    #define SMI_THETA_VARS(o) o##z = 0, o##zq = 0, o##m0 = 0, o##m1 = 0, o##q0 = 0, o##q1 = 0, o##s00 = 0, \
        o##s01 = 0, o##s11 = 0, o##r0 = 0, o##r1 = 0, o##r2 = 0
    #define SMI_THETA_RED(o) o##z, o##zq, o##m0, o##m1, o##q0, o##q1, o##s00, o##s01, o##s11, o##r0, o##r1, o##r2
    #define SMI_THETA_ARGS long K, long k0, long k1, const double* restrict nodes, const double* u,  \
                           const double* omega, const double* P
    #define SMI_THETA_LOCALS                                                                        \
        const double* F00 = nodes + k0; const double* F01 = nodes + K + k0; const double* F10 = nodes + 2 * K + k0; \
        const double* F11 = nodes + 3 * K + k0; const double* LD = nodes + 4 * K + k0;              \
        double u0 = u[0], u1 = u[1], w0 = omega[0], w1 = omega[1], p00 = P[0], p01 = P[1], p11 = P[2]; \
        double v0 = p00 * w0 + p01 * w1, v1 = p01 * w0 + p11 * w1;                                 \
        long n = k1 - k0;
    static inline SMI_THETA_TARGET void smi_theta_logw(SMI_THETA_ARGS, double* restrict E, double* out) {
        SMI_THETA_LOCALS
        double mx = -INFINITY, mq = -INFINITY;
        #pragma omp simd reduction(max:mx, mq)
        for (long k = 0; k < n; k++) {
            SMI_THETA_NODE
            double e = -0.5 * (p00 * y0 * y0 + 2.0 * p01 * y0 * y1 + p11 * y1 * y1) - LD[k];
            e = SMI_FINITE(e) ? e : -INFINITY;
            E[k] = e;
            mx = SMI_MAX(mx, e);
            mq = SMI_MAX(mq, e - 2.0 * fabs(s));
        }
        out[0] = mx; out[1] = mq;
    }
    static inline SMI_THETA_TARGET void smi_theta_sums(SMI_THETA_ARGS, const int reflect, const double* restrict W,
                                                       const double* restrict E, double mx, double* restrict sums) {
        SMI_THETA_LOCALS
        (void) LD;
        const double* wa = W + k0; const double* wb = W + 4 * K + k0;
        double SMI_THETA_VARS(a), SMI_THETA_VARS(b);
        #pragma omp simd reduction(+:SMI_THETA_RED(a), SMI_THETA_RED(b))
        for (long k = 0; k < n; k++) {
            SMI_THETA_NODE
            double e = smi_exp_neg(E[k] - mx), eq = reflect ? e * smi_exp_neg(-2.0 * fabs(s)) : 0.0, g = e + eq;
            SMI_THETA_SET(a, wa)
            SMI_THETA_SET(b, wb)
        }
        double r[2 * SMI_THETA_SUMS] = {SMI_THETA_RED(a), SMI_THETA_RED(b)};
        for (int j = 0; j < 2 * SMI_THETA_SUMS; j++) sums[j] = r[j];
    }
    /* One tile into st (1 + 2 S sums).  Plain (outer NULL, S = 12): the sums as they are.  Nested
       (three layers, S = 15): the tile is the block of θ_1 node b, W its inner rows [w_2, the three
       of h_2h_2ᵀ] per set, and outer (8 × B) the outer ones [w_1, w_1^(00), w_1^(01), w_1^(11)]
       per set: the 9 sums and h_2h_2ᵀ's scaled by w_1, h_1h_1ᵀ's = w_1^(ab) Σ w_2 e(1 + q). */
    __attribute__((target("prefer-vector-width=512")))
    static void smi_theta_tile(long K, long k0, long k1, const double* restrict nodes, const double* restrict W,
                               const double* outer, long B, long b, const double* u, const double* omega,
                               const double* P, double* restrict buf, double* restrict st) {
        double m[2], t[2 * SMI_THETA_SUMS];
        int S = outer ? SMI_THETA_SUMS + 3 : SMI_THETA_SUMS;
        smi_theta_logw(K, k0, k1, nodes, u, omega, P, buf, m);
        if (!(m[0] > st[0] - SMI_THETA_SKIP)) return;
        if (m[0] > st[0]) {
            double scale = st[0] > -INFINITY ? exp(st[0] - m[0]) : 0.0;
            for (int j = 1; j <= 2 * S; j++) st[j] *= scale;
            st[0] = m[0];
        }
        if (m[1] > st[0] - SMI_THETA_SKIP) smi_theta_sums(K, k0, k1, nodes, u, omega, P, 1, W, buf, st[0], t);
        else smi_theta_sums(K, k0, k1, nodes, u, omega, P, 0, W, buf, st[0], t);
        for (int set = 0; set < 2; set++) {
            double* o = st + 1 + S * set; const double* ts = t + SMI_THETA_SUMS * set;
            if (!outer) {
                for (int j = 0; j < SMI_THETA_SUMS; j++) o[j] += ts[j];
                continue;
            }
            const double* c = outer + 4 * set * B + b;
            for (int j = 0; j < 9; j++) o[j] += c[0] * ts[j];
            for (int r = 0; r < 3; r++) {
                o[9 + r] += c[(1 + r) * B] * ts[0];
                o[12 + r] += c[0] * ts[9 + r];
            }
        }
    }
    """
    int SMI_THETA_SUMS
    void smi_theta_tile(long K, long k0, long k1, const double* nodes, const double* W, const double* outer, long B,
                        long b, const double* u, const double* omega, const double* P, double* buf,
                        double* st) noexcept nogil


THETA_TILE = 2048       # nodes per tile (plain): a tile's node rows and weights (≈ 200 kB) stay in cache
THETA_CHUNK = 16        # samples that go over the tiles together


def theta_product(const double[:, ::1] nodes, const double[:, ::1] weights, const double[:, ::1] u,
                  const double[:, ::1] omega, const double[:, ::1] prec, double[:, ::1] out, int threads=0,
                  outer=None):
    """The θ rule (smi_core.theta_rule) on K nodes shared by every sample: ``nodes`` rows [Φ⁻¹
    (2×2, row-major), log|det Φ|], ``weights`` rows [w, 3 moment weights] of the full and the
    truncated rule (8 × K); per sample u_L (2), ω_L (2) and P = V_LL⁻¹ as [P_00, P_01, P_11].
    Row i of ``out``: [max log weight, the 12 sums of each weight set] (``smi_theta_tile``).
    Nested (three layers, smi_core.theta3_rule): ``outer`` (8 × B) the outer weights, the nodes
    B blocks of K/B (one per θ_1 node) and ``weights`` the inner ones; ``out`` then has the 15
    sums per set.  THETA_CHUNK samples at a time over tiles of THETA_TILE nodes (nested: the
    blocks), the node data read once per chunk, not per sample."""
    cdef Py_ssize_t n = u.shape[0], K = nodes.shape[1], c, i, j, k0, k1
    cdef Py_ssize_t tile = THETA_TILE, chunk = THETA_CHUNK, B = 0, tiles
    cdef const double[:, ::1] outer_w
    cdef const double* outer_p = NULL
    cdef int S = SMI_THETA_SUMS
    cdef double* buf
    if threads <= 0:
        threads = omp_get_max_threads()
    if outer is not None:
        outer_w = outer
        B, S = outer_w.shape[1], SMI_THETA_SUMS + 3
        if not (outer_w.shape[0] == 8 and B > 0 and K % B == 0):
            raise ValueError("theta_product needs outer weights of 8 rows over blocks that divide the nodes")
        outer_p, tile = &outer_w[0, 0], K // B
    if not (nodes.shape[0] == 5 and weights.shape[0] == 8 and weights.shape[1] == K and K > 0
            and u.shape[1] == 2 and omega.shape[0] == n and omega.shape[1] == 2 and prec.shape[0] == n
            and prec.shape[1] == 3 and out.shape[0] == n and out.shape[1] == 1 + 2 * S):
        raise ValueError("theta_product needs nodes of 5 rows, weights of 8 rows over the same nodes, and per "
                         f"sample u (2), omega (2), prec (3) and out (1 + {2 * S})")
    tiles = (K + tile - 1) // tile
    out[:, 0] = -INFINITY
    out[:, 1:] = 0.0
    with nogil:
        for c in prange((n + chunk - 1) // chunk, num_threads=threads, schedule="dynamic"):
            buf = <double*> malloc(tile * sizeof(double))
            for j in range(tiles):
                k0 = j * tile
                k1 = min(K, k0 + tile)
                for i in range(c * chunk, min(n, c * chunk + chunk)):
                    smi_theta_tile(K, k0, k1, &nodes[0, 0], &weights[0, 0], outer_p, B, j, &u[i, 0],
                                   &omega[i, 0], &prec[i, 0], buf, &out[i, 0])
            free(buf)
