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
"""
from cpython.pycapsule cimport PyCapsule_GetPointer
from cython.parallel cimport prange
from libc.math cimport exp, log, sqrt, INFINITY, M_PI, isfinite
from libc.stdlib cimport malloc, free
from openmp cimport omp_get_max_threads

ctypedef void (*kernel_t)(const double*, const double*, double*) noexcept nogil


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


cdef inline double _quad_h(const double* x, const double* c, const double* H, int d) noexcept nogil:
    cdef int i, j
    cdef double acc = 0.0
    for i in range(d):
        for j in range(d):
            acc += (x[i] - c[i]) * H[i * d + j] * (x[j] - c[j])
    return acc


cdef struct Acc:
    double mx
    double s0
    double* s1
    double* s2
    int n


cdef inline void _add(Acc* acc, double lw, const double* Z, const double* ref) noexcept nogil:
    cdef int i, j, n = acc.n
    cdef double scale, w
    if lw > acc.mx:
        scale = exp(acc.mx - lw) if acc.mx > -INFINITY else 0.0
        acc.s0 *= scale
        for i in range(n):
            acc.s1[i] *= scale
        for i in range(n * n):
            acc.s2[i] *= scale
        acc.mx = lw
    w = exp(lw - acc.mx)
    acc.s0 += w
    for i in range(n):
        acc.s1[i] += w * (Z[i] - ref[i])
        for j in range(i, n):
            acc.s2[i * n + j] += w * (Z[i] - ref[i]) * (Z[j] - ref[j])


cdef void _sample(int route, kernel_t f, const double* par, const double* data, int n_data,
                  const double* omega, const double* Vinv, double logdetV,
                  const double* centers, const double* A, const double* H, const double* logh, int M,
                  const double* xi, const double* lw, int G, int d,
                  const double* ref, int R, int T, int n_node, double delta,
                  double* log_z, double* mean, double* second) noexcept nogil:
    cdef int RT = R * T, m, j, k, i, l, s
    cdef double* work = <double*> malloc((2 * d + n_data + n_node + 2 * RT + M) * sizeof(double))
    cdef double* x = work
    cdef double* node_in = work + d
    cdef double* node_out = node_in + n_data + d
    cdef double* Z = node_out + n_node
    cdef double* s1 = Z + RT
    cdef double* lq = s1 + RT
    cdef double* s2 = <double*> malloc(RT * RT * sizeof(double))
    cdef Acc acc
    cdef double const0 = -0.5 * T * (R * log(2 * M_PI) + logdetV)
    cdef double logdetA, lmax, lse, base, lf, sq, r
    acc.mx, acc.s0, acc.s1, acc.s2, acc.n = -INFINITY, 0.0, s1, s2, RT
    for i in range(RT):
        s1[i] = 0.0
    for i in range(RT * RT):
        s2[i] = 0.0
    if route == 0:
        for i in range(n_data):
            node_in[i] = data[i]
    for m in range(M):
        if not logh[m] > -INFINITY:
            continue
        logdetA = 0.0
        for i in range(d):
            logdetA += log(A[(m * d + i) * d + i])
        for k in range(G):
            for i in range(d):
                x[i] = centers[m * d + i]
                for l in range(i + 1):
                    x[i] += A[(m * d + i) * d + l] * xi[k * d + l]
            base = logdetA + lw[k]
            if M > 1:
                lmax = -INFINITY
                for j in range(M):
                    lq[j] = logh[j] - 0.5 * _quad_h(x, centers + j * d, H + j * d * d, d) if logh[j] > -INFINITY else -INFINITY
                    if lq[j] > lmax:
                        lmax = lq[j]
                lse = 0.0
                for j in range(M):
                    lse += exp(lq[j] - lmax)
                base += lq[m] - lmax - log(lse)
            if route == 0:
                for i in range(d):
                    node_in[n_data + i] = x[i]
                f(node_in, par, node_out)
                if not isfinite(node_out[T]):          # det Φ = 0: the Gaussian factor vanishes there
                    continue
                for s in range(2):
                    for i in range(d):
                        Z[i] = x[i]
                    for i in range(T):
                        Z[d + i] = node_out[i] if s == 0 else -node_out[i]
                    lf = const0 - 0.5 * _quad_v(Z, omega, Vinv, R, T) - node_out[T]
                    if isfinite(lf):
                        _add(&acc, base + lf, Z, ref)
            else:
                f(x, par, node_out)
                sq = 0.0
                for i in range(n_node):
                    r = data[i] - node_out[i]
                    sq += r * r
                lf = (const0 - 0.5 * _quad_v(x, omega, Vinv, R, T) - 0.5 * sq / delta
                      - 0.5 * n_node * log(2 * M_PI * delta))
                _add(&acc, base + lf, x, ref)
    log_z[0] = acc.mx + log(acc.s0)
    for i in range(RT):
        mean[i] = s1[i] / acc.s0
        for j in range(i, RT):
            second[i * RT + j] = s2[i * RT + j] / acc.s0
            second[j * RT + i] = second[i * RT + j]
    free(work)
    free(s2)


def integrate(int route, capsule, const double[::1] params, const double[:, ::1] data,
              const double[:, ::1] omega, const double[:, :, ::1] Vinv, const double[::1] logdetV,
              const double[:, :, ::1] centers, const double[:, :, :, ::1] A,
              const double[:, :, :, ::1] H, const double[:, ::1] logh,
              const double[:, ::1] xi, const double[::1] lw, const double[:, ::1] ref,
              int R, int T, int n_node, double delta,
              double[::1] log_z, double[:, ::1] mean, double[:, :, ::1] second, int threads=0):
    """Posterior mass (log), mean E[Z - ref] and second moment E[(Z-ref)(Z-ref)ᵀ] per sample."""
    cdef kernel_t f = <kernel_t> PyCapsule_GetPointer(capsule, "smi_kernel")
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
