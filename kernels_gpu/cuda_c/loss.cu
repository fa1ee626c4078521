// log_softmax and cross_entropy, forward and backward.
//
// The class (softmax) axis views x as (outer, C, inner).  `rows` kernels take inner == 1: one
// block per row, the max and the sum of exponentials as block reductions.  `cols` kernels take
// inner > 1: one thread per (outer, inner) position walking its C classes (adjacent threads read
// adjacent memory).  Everything accumulates in float (double for double data).
//
// cross_entropy (PyTorch's semantics, see portable_nn/reference/loss.py): per position n the
// forward keeps lse_n = max + log Σ exp(z − max) as its two parts (lse holds every max, then
// every log Σ; log-probabilities are (z − max) − log Σ) and A_n = Σ_c a_{n,c} (the target weights:
// one-hot or probabilities, class weights, label smoothing, ignored positions 0); the loss is
// reduced by a single-block kernel in a fixed order.  The backward is elementwise:
// dz = g_n (exp(z − lse_n) A_n − a_{n,c}),  dt = −g_n (1 − ε) w_c (z − lse_n).

#include "common.cuh"

// --------------------------------------------------------------------------- log_softmax

// Online log-sum-exp: (m, s) with Σ exp(v − m) = s over the values seen; NaN wins, −inf adds
// nothing, +inf makes the sum NaN.  One pass over a row instead of a max pass then a sum pass (the rows kernels read
// the logits once for lse; 32000 classes: a row is 128 KB).
template <class A> __device__ __forceinline__ void lse_merge(A& m, A& s, A m2, A s2) {
    if (pnn_isnan(m)) return;
    if (pnn_isnan(m2)) {
        m = m2;
        s = m2;
    } else if (m2 == -pnn_inf<A>()) {
        return;
    } else if (m == -pnn_inf<A>()) {
        m = m2;
        s = s2;
    } else if (m2 <= m) {
        s += s2 * pnn_exp(m2 - m);
    } else {
        s = s * pnn_exp(m - m2) + s2;
        m = m2;
    }
    // A +inf maximum makes the sum exp(+inf − +inf) = NaN, as the two-pass form (and PyTorch) has it.
    if (m == pnn_inf<A>()) s = m - m;
}

struct pnn_lse_pair {
    template <class A> __device__ __forceinline__ void operator()(A& m, A& s, A m2, A s2) const {
        lse_merge(m, s, m2, s2);
    }
};

// (m, s) over the block (block_reduce_pair); every thread gets the total.
template <class A> __device__ __forceinline__ void block_lse(A& m, A& s, A* sh) {
    block_reduce_pair(m, s, sh, -pnn_inf<A>(), A(0), pnn_lse_pair());
}

// Where this thread's share of a row starts and how far it steps, in elements: V at a time with
// `vec` (C a multiple of V, the row 16-byte aligned), else one.  One 4-byte load per thread in
// flight kept the (4096, 32000) rows at a third (log_softmax) and a sixth (cross_entropy) of copy
// bandwidth on an H200.
template <class T> __device__ __forceinline__ long long row_start(int vec) {
    return static_cast<long long>(threadIdx.x) * (vec ? vec_width<T>::value : 1);
}
template <class T> __device__ __forceinline__ long long row_step(int vec) {
    return static_cast<long long>(blockDim.x) * (vec ? vec_width<T>::value : 1);
}

// The values at xr[c] (V of them with `vec`, else one) as A; returns how many.
template <class T, class A> __device__ __forceinline__ int row_values(const T* xr, long long c, int vec,
                                                                     A* v) {
    if (vec) {
        load_vec<vec_width<T>::value>(xr + c, v);
        return vec_width<T>::value;
    }
    v[0] = static_cast<A>(to_acc(xr[c]));
    return 1;
}

// Store ``v`` at yr[c] (V values with `vec`, else one): row_values' counterpart.
template <class T, class A> __device__ __forceinline__ void row_store(T* yr, long long c, int vec, const A* v) {
    if (vec) {
        store_vec<vec_width<T>::value>(yr + c, v);
    } else {
        yr[c] = from_acc<T>(v[0]);
    }
}

// The log-sum-exp of row r (C contiguous values) by the whole block, as its two parts: the max m
// and log Σ exp(x − m).  Outputs are formed as (x − m) − log Σ: x − m is exact near the max, so a
// large common offset costs no digits (x − (m + log Σ) lost 4e-5 relative at offset 1000, H200).
template <class T, class A> __device__ __forceinline__ void row_lse(const T* xr, long long C, int vec, A* sh, A& m,
                                                                   A& logs) {
    A s = 0;
    m = -pnn_inf<A>();
    for (long long c = row_start<T>(vec); c < C; c += row_step<T>(vec)) {
        A v[vec_width<T>::value];
        const int n = row_values(xr, c, vec, v);
        for (int k = 0; k < n; ++k) lse_merge(m, s, v[k], A(1));
    }
    block_lse(m, s, sh);
    logs = pnn_log(s);
}

template <class T>
__global__ void lsm_rows_fwd(const T* x, T* y, long long rows, long long C, int vec) {
    typedef typename acc_of<T>::type A;
    A* sh = shared_as<A>();
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * C;
        A m, logs;
        row_lse<T, A>(xr, C, vec, sh, m, logs);
        for (long long c = row_start<T>(vec); c < C; c += row_step<T>(vec)) {
            A v[vec_width<T>::value];
            const int n = row_values(xr, c, vec, v);
            for (int k = 0; k < n; ++k) v[k] = (v[k] - m) - logs;
            row_store(y + r * C, c, vec, v);
        }
    }
}

template <class T>
__global__ void lsm_cols_fwd(const T* x, T* y, long long outer, long long C, long long inner) {
    typedef typename acc_of<T>::type A;
    const long long total = outer * inner;
    for (long long n = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; n < total;
         n += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long base = (n / inner) * C * inner + n % inner;
        A m = -pnn_inf<A>();
        for (long long c = 0; c < C; ++c) {
            const A v = static_cast<A>(to_acc(x[base + c * inner]));
            m = (pnn_isnan(m) || m >= v) ? m : v;
        }
        A s = 0;
        for (long long c = 0; c < C; ++c) s += pnn_exp(static_cast<A>(to_acc(x[base + c * inner])) - m);
        const A logs = pnn_log(s);
        for (long long c = 0; c < C; ++c)
            y[base + c * inner] = from_acc<T>((static_cast<A>(to_acc(x[base + c * inner])) - m) - logs);
    }
}

// dx = dy − exp(y) · Σ dy along the class axis.
template <class T>
__global__ void lsm_rows_bwd(const T* y, const T* dy, T* dx, long long rows, long long C, int vec) {
    typedef typename acc_of<T>::type A;
    A* sh = shared_as<A>();
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* yr = y + r * C;
        const T* dyr = dy + r * C;
        A s = 0, unused = 0;
        for (long long c = row_start<T>(vec); c < C; c += row_step<T>(vec)) {
            A g[vec_width<T>::value];
            const int n = row_values(dyr, c, vec, g);
            for (int k = 0; k < n; ++k) s += g[k];
        }
        block_sum2(s, unused, sh);
        for (long long c = row_start<T>(vec); c < C; c += row_step<T>(vec)) {
            A g[vec_width<T>::value], v[vec_width<T>::value];
            const int n = row_values(dyr, c, vec, g);
            row_values(yr, c, vec, v);
            for (int k = 0; k < n; ++k) g[k] -= pnn_exp(v[k]) * s;
            row_store(dx + r * C, c, vec, g);
        }
    }
}

template <class T>
__global__ void lsm_cols_bwd(const T* y, const T* dy, T* dx, long long outer, long long C, long long inner) {
    typedef typename acc_of<T>::type A;
    const long long total = outer * inner;
    for (long long n = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; n < total;
         n += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long base = (n / inner) * C * inner + n % inner;
        A s = 0;
        for (long long c = 0; c < C; ++c) s += static_cast<A>(to_acc(dy[base + c * inner]));
        for (long long c = 0; c < C; ++c) {
            const long long o = base + c * inner;
            dx[o] = from_acc<T>(static_cast<A>(to_acc(dy[o])) - pnn_exp(static_cast<A>(to_acc(y[o]))) * s);
        }
    }
}

// --------------------------------------------------------------------------- cross_entropy

// The target weight a_{n,c} of class c at position n (index targets: `label`, probability
// targets: `prob` = t_{n,c}); eps is the label smoothing.
template <class A>
__device__ __forceinline__ A ce_weight(int probabilities, long long label, A prob, long long c, long long C, A wc,
                                       A eps, int valid) {
    if (probabilities) return (prob * (A(1) - eps) + eps / A(C)) * wc;
    if (!valid) return A(0);
    A a = c == label ? (A(1) - eps) * wc : A(0);
    if (eps > A(0)) a += eps / A(C) * wc;
    return a;
}

// The per-position results every cross_entropy forward writes (the "none" output when asked).
template <class T, class A>
__device__ __forceinline__ void ce_store(long long n, long long positions, A ell, A picked_w, A m, A logs, A total,
                                         A* loss, A* wsum, A* lse_out, A* total_out, T* y_none) {
    loss[n] = ell;
    wsum[n] = picked_w;
    lse_out[n] = m;
    lse_out[positions + n] = logs;
    total_out[n] = total;
    if (y_none) y_none[n] = from_acc<T>(ell);
}

// One thread per position: lse_n, A_n, the loss (into y_none when reduction is "none") and the
// picked weight (the "mean" denominator's share).
template <class T, class PT>
__global__ void ce_fwd(const T* z, const long long* labels, const T* probs, const PT* weight, T* y_none,
                       typename acc_of<T>::type* loss, typename acc_of<T>::type* wsum,
                       typename acc_of<T>::type* lse_out, typename acc_of<T>::type* total_out, long long outer,
                       long long C, long long inner, long long ignore_index, double eps_d, int probabilities) {
    typedef typename acc_of<T>::type A;
    const A eps = A(eps_d);
    const long long positions = outer * inner;
    for (long long n = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; n < positions;
         n += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long base = (n / inner) * C * inner + n % inner;
        A m = -pnn_inf<A>();
        for (long long c = 0; c < C; ++c) {
            const A v = static_cast<A>(to_acc(z[base + c * inner]));
            m = (pnn_isnan(m) || m >= v) ? m : v;
        }
        A s = 0;
        for (long long c = 0; c < C; ++c) s += pnn_exp(static_cast<A>(to_acc(z[base + c * inner])) - m);
        const A logs = pnn_log(s);
        A ell = 0, total = 0, picked_w = 0;
        if (probabilities) {
            for (long long c = 0; c < C; ++c) {
                const A p = (static_cast<A>(to_acc(z[base + c * inner])) - m) - logs;
                const A a = ce_weight(1, 0, static_cast<A>(to_acc(probs[base + c * inner])), c, C,
                                      param_or<A>(weight, c, A(1)), eps, 1);
                ell -= a * p;
                total += a;
            }
        } else {
            const long long label = labels[n];
            const int valid = label != ignore_index;
            if (valid) {
                picked_w = param_or<A>(weight, label, A(1));
                const A picked = (static_cast<A>(to_acc(z[base + label * inner])) - m) - logs;
                ell = -picked_w * picked;
                total = picked_w;
                if (eps > A(0)) {
                    A smooth = 0, wall = 0;
                    for (long long c = 0; c < C; ++c) {
                        const A wc = param_or<A>(weight, c, A(1));
                        smooth -= wc * ((static_cast<A>(to_acc(z[base + c * inner])) - m) - logs);
                        wall += wc;
                    }
                    ell = (A(1) - eps) * ell + eps / A(C) * smooth;
                    total = (A(1) - eps) * picked_w + eps / A(C) * wall;
                }
            }
        }
        ce_store(n, positions, ell, picked_w, m, logs, total, loss, wsum, lse_out, total_out, y_none);
    }
}

// inner == 1: one block per position (a row of C classes, read coalesced; the per-thread
// ce_fwd walks a row alone, 9.4 ms for (4096, 32000) float32 on an H200).  Same outputs as
// ce_fwd.  The sums over classes that smoothing and probability targets need are taken in the
// same pass, of a · (z − z0) with z0 the row's first logit, so Σ a (z − lse) keeps its digits.
template <class T, class PT>
__global__ void ce_rows_fwd(const T* z, const long long* labels, const T* probs, const PT* weight, T* y_none,
                            typename acc_of<T>::type* loss, typename acc_of<T>::type* wsum,
                            typename acc_of<T>::type* lse_out, typename acc_of<T>::type* total_out, long long rows,
                            long long C, long long ignore_index, double eps_d, int probabilities, int vec) {
    typedef typename acc_of<T>::type A;
    const A eps = A(eps_d);
    A* sh = shared_as<A>();
    for (long long n = blockIdx.x; n < rows; n += gridDim.x) {
        const T* zr = z + n * C;
        const long long label = probabilities ? 0 : labels[n];
        const int valid = probabilities || label != ignore_index;
        const int sums = probabilities || (valid && eps > A(0));
        const A z0 = static_cast<A>(to_acc(zr[0]));
        A m = -pnn_inf<A>(), s = 0, sz = 0, sa = 0;
        for (long long c0 = row_start<T>(vec); c0 < C; c0 += row_step<T>(vec)) {
            A vs[vec_width<T>::value];
            const int count = row_values(zr, c0, vec, vs);
            for (int k = 0; k < count; ++k) {
                const long long c = c0 + k;
                const A v = vs[k];
                lse_merge(m, s, v, A(1));
                if (sums) {
                    const A wc = param_or<A>(weight, c, A(1));
                    const A a = probabilities
                                    ? ce_weight(1, 0, static_cast<A>(to_acc(probs[n * C + c])), c, C, wc, eps, 1)
                                    : wc;
                    sz += a * (v - z0);
                    sa += a;
                }
            }
        }
        block_lse(m, s, sh);
        if (sums) block_sum2(sz, sa, sh);
        if (threadIdx.x != 0) continue;
        const A logs = pnn_log(s);
        const A spread = -(sz - ((m - z0) + logs) * sa);  // −Σ a (z − lse)
        A ell = 0, total = 0, picked_w = 0;
        if (probabilities) {
            ell = spread;
            total = sa;
        } else if (valid) {
            picked_w = param_or<A>(weight, label, A(1));
            ell = -picked_w * ((static_cast<A>(to_acc(zr[label])) - m) - logs);
            total = picked_w;
            if (eps > A(0)) {
                ell = (A(1) - eps) * ell + eps / A(C) * spread;
                total = (A(1) - eps) * picked_w + eps / A(C) * sa;
            }
        }
        ce_store(n, rows, ell, picked_w, m, logs, total, loss, wsum, lse_out, total_out, y_none);
    }
}

// inner == 1: one block per position, threads along its classes (no per-element index division).
template <class T, class PT>
__global__ void ce_rows_bwd(const T* z, const long long* labels, const T* probs, const PT* weight, const T* g,
                            const typename acc_of<T>::type* den, const typename acc_of<T>::type* lse,
                            const typename acc_of<T>::type* total, T* dz, T* dt, long long rows, long long C,
                            long long ignore_index, double eps_d, int probabilities, int reduction) {
    typedef typename acc_of<T>::type A;
    const A eps = A(eps_d);
    for (long long n = blockIdx.x; n < rows; n += gridDim.x) {
        A gn = static_cast<A>(to_acc(g[reduction == 0 ? n : 0]));
        if (reduction == 2) gn /= den[0];
        const A mx = lse[n], logs = lse[rows + n], tot = total[n];
        const long long label = probabilities ? 0 : labels[n];
        const int valid = probabilities || label != ignore_index;
        for (long long c = threadIdx.x; c < C; c += blockDim.x) {
            const long long e = n * C + c;
            const A p = (static_cast<A>(to_acc(z[e])) - mx) - logs;
            const A wc = param_or<A>(weight, c, A(1));
            if (dz) {
                const A a = ce_weight(probabilities, label, probabilities ? static_cast<A>(to_acc(probs[e])) : A(0), c,
                                      C, wc, eps, valid);
                dz[e] = from_acc<T>(gn * (pnn_exp(p) * tot - a));
            }
            if (dt) dt[e] = from_acc<T>(-(A(1) - eps) * gn * wc * p);
        }
    }
}

// One block: y = Σ loss (reduction 1, "sum") or Σ loss / denominator (reduction 2, "mean": the
// picked weights' sum for index targets, the number of positions for probabilities; NaN when 0).
// den_out keeps the denominator for the backward.
template <class T>
__global__ void ce_reduce(const typename acc_of<T>::type* loss, const typename acc_of<T>::type* wsum, T* y,
                          typename acc_of<T>::type* den_out, long long positions, int reduction, int probabilities) {
    typedef typename acc_of<T>::type A;
    A s = 0, w = 0;
    for (long long n = threadIdx.x; n < positions; n += blockDim.x) {
        s += loss[n];
        w += wsum[n];
    }
    block_sum2(s, w, shared_as<A>());
    if (threadIdx.x != 0) return;
    if (reduction == 1) {
        y[0] = from_acc<T>(s);
        den_out[0] = A(1);
        return;
    }
    const A den = probabilities ? A(positions) : w;
    y[0] = from_acc<T>(den == A(0) ? pnn_inf<A>() - pnn_inf<A>() : s / den);
    den_out[0] = den == A(0) ? A(1) : den;
}

// One thread per logit: dz (and dt for probability targets).  g: the cotangent, per position
// (reduction 0) or a scalar (1: sum, 2: mean, divided by den[0]).
template <class T, class PT>
__global__ void ce_bwd(const T* z, const long long* labels, const T* probs, const PT* weight, const T* g,
                       const typename acc_of<T>::type* den, const typename acc_of<T>::type* lse,
                       const typename acc_of<T>::type* total, T* dz, T* dt, long long outer, long long C,
                       long long inner, long long ignore_index, double eps_d, int probabilities, int reduction) {
    typedef typename acc_of<T>::type A;
    const A eps = A(eps_d);
    const long long size = outer * C * inner;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < size;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long o = e / (C * inner), c = (e / inner) % C, i = e % inner;
        const long long n = o * inner + i;
        A gn = static_cast<A>(to_acc(g[reduction == 0 ? n : 0]));
        if (reduction == 2) gn /= den[0];
        const A p = (static_cast<A>(to_acc(z[e])) - lse[n]) - lse[outer * inner + n];
        const A wc = param_or<A>(weight, c, A(1));
        if (dz) {
            const long long label = probabilities ? 0 : labels[n];
            const A a = ce_weight(probabilities, label, probabilities ? static_cast<A>(to_acc(probs[e])) : A(0), c, C,
                                  wc, eps, probabilities || label != ignore_index);
            dz[e] = from_acc<T>(gn * (pnn_exp(p) * total[n] - a));
        }
        if (dt) dt[e] = from_acc<T>(-(A(1) - eps) * gn * wc * p);
    }
}
