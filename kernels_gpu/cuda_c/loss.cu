// log_softmax and cross_entropy, forward and backward.
//
// The class (softmax) axis views x as (outer, C, inner).  `rows` kernels take inner == 1: one
// block per row, the max and the sum of exponentials as block reductions.  `cols` kernels take
// inner > 1: one thread per (outer, inner) position walking its C classes (adjacent threads read
// adjacent memory).  Everything accumulates in float (double for double data).
//
// cross_entropy (PyTorch's semantics, see portable_nn/reference/loss.py): per position n the
// forward keeps lse_n = max + log Σ exp(z − max) and A_n = Σ_c a_{n,c} (the target weights:
// one-hot or probabilities, class weights, label smoothing, ignored positions 0); the loss is
// reduced by a single-block kernel in a fixed order.  The backward is elementwise:
// dz = g_n (exp(z − lse_n) A_n − a_{n,c}),  dt = −g_n (1 − ε) w_c (z − lse_n).

#include "common.cuh"

// --------------------------------------------------------------------------- log_softmax

template <class T>
__global__ void lsm_rows_fwd(const T* x, T* y, long long rows, long long C) {
    typedef typename acc_of<T>::type A;
    A* sh = shared_as<A>();
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * C;
        A m = -pnn_inf<A>();
        for (long long c = threadIdx.x; c < C; c += blockDim.x) {
            const A v = static_cast<A>(to_acc(xr[c]));
            m = (pnn_isnan(m) || m >= v) ? m : v;
        }
        m = block_max(m, sh);
        A s = 0, unused = 0;
        for (long long c = threadIdx.x; c < C; c += blockDim.x) s += pnn_exp(static_cast<A>(to_acc(xr[c])) - m);
        block_sum2(s, unused, sh);
        const A lse = m + pnn_log(s);
        for (long long c = threadIdx.x; c < C; c += blockDim.x)
            y[r * C + c] = from_acc<T>(static_cast<A>(to_acc(xr[c])) - lse);
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
        const A lse = m + pnn_log(s);
        for (long long c = 0; c < C; ++c)
            y[base + c * inner] = from_acc<T>(static_cast<A>(to_acc(x[base + c * inner])) - lse);
    }
}

// dx = dy − exp(y) · Σ dy along the class axis.
template <class T>
__global__ void lsm_rows_bwd(const T* y, const T* dy, T* dx, long long rows, long long C) {
    typedef typename acc_of<T>::type A;
    A* sh = shared_as<A>();
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        A s = 0, unused = 0;
        for (long long c = threadIdx.x; c < C; c += blockDim.x) s += static_cast<A>(to_acc(dy[r * C + c]));
        block_sum2(s, unused, sh);
        for (long long c = threadIdx.x; c < C; c += blockDim.x) {
            const long long o = r * C + c;
            dx[o] = from_acc<T>(static_cast<A>(to_acc(dy[o])) - pnn_exp(static_cast<A>(to_acc(y[o]))) * s);
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
        const A lse = m + pnn_log(s);
        A ell = 0, total = 0, picked_w = 0;
        if (probabilities) {
            for (long long c = 0; c < C; ++c) {
                const A p = static_cast<A>(to_acc(z[base + c * inner])) - lse;
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
                const A picked = static_cast<A>(to_acc(z[base + label * inner])) - lse;
                ell = -picked_w * picked;
                total = picked_w;
                if (eps > A(0)) {
                    A smooth = 0, wall = 0;
                    for (long long c = 0; c < C; ++c) {
                        const A wc = param_or<A>(weight, c, A(1));
                        smooth -= wc * (static_cast<A>(to_acc(z[base + c * inner])) - lse);
                        wall += wc;
                    }
                    ell = (A(1) - eps) * ell + eps / A(C) * smooth;
                    total = (A(1) - eps) * picked_w + eps / A(C) * wall;
                }
            }
        }
        loss[n] = ell;
        wsum[n] = picked_w;
        lse_out[n] = lse;
        total_out[n] = total;
        if (y_none) y_none[n] = from_acc<T>(ell);
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
        const A p = static_cast<A>(to_acc(z[e])) - lse[n];
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
