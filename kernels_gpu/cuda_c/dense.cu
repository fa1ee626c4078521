// GEMM epilogues shared by dense and conv: bias + activation forward, and the activation
// derivative with the bias gradient's partial sums in the same pass.
//
// The GEMM output z is viewed as (N, O, L): dense has L = 1 (rows × features), conv has the
// channels-first (sample, output channel, output position) order of its GEMMs.  The layer's
// output y is (N, O, L) too, or (N, L, O) when `channels_last` (conv with channels-last data):
// the epilogue writes the layout the caller asked for, so no separate transpose pass runs.

#include "common.cuh"

// y = act(z + b); with `keep` the pre-activation z + b is written back into z for the backward.
template <class T>
__global__ void bias_act_fwd(T* z, const T* b, T* y, long long N, long long O, long long L, int channels_last,
                             int keep, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * O * L;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long l = e % L, o = (e / L) % O, n = e / (O * L);
        const A pre = static_cast<A>(to_acc(z[e])) + param_or<A>(b, o, A(0));
        if (keep) z[e] = from_acc<T>(pre);
        y[channels_last ? (n * L + l) * O + o : e] = from_acc<T>(act_fwd(pre, code, A(slope)));
    }
}

// g = dy · act'(pre) in the (N, O, L) order, and per-block partial sums of g for the bias:
// threads along w = o · L + l (blockIdx.x) and along samples (threadIdx.y, the block's chunk of
// `rows` samples in blockIdx.y); part[chunk · O · L + w] (part may be null: no bias gradient).
template <class T>
__global__ void act_grad_bias(const T* dy, const T* pre, T* g, typename acc_of<T>::type* part, long long N,
                              long long O, long long L, long long rows, int channels_last, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long width = O * L;
    const long long w = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long chunk = blockIdx.y;
    A s = 0, unused = 0;
    if (w < width) {
        const long long o = w / L, l = w % L;
        const long long hi = min(N, (chunk + 1) * rows);
        for (long long n = chunk * rows + threadIdx.y; n < hi; n += blockDim.y) {
            const long long e = n * width + w;
            A gv = static_cast<A>(to_acc(dy[channels_last ? (n * L + l) * O + o : e]));
            if (code != PNN_ACT_IDENTITY) gv *= act_grad(static_cast<A>(to_acc(pre[e])), code, A(slope));
            g[e] = from_acc<T>(gv);
            s += gv;
        }
    }
    if (!part) return;  // uniform over the grid: no thread reaches the barrier below
    column_sum2(s, unused, shared_as<A>());
    if (threadIdx.y == 0 && w < width) part[chunk * width + w] = s;
}

// One block per output channel o: db[o] = Σ part[(k · O + o) · L + l] over chunks k and l.
template <class T>
__global__ void bias_grad_finalize(const typename acc_of<T>::type* part, T* db, long long O, long long L,
                                   long long chunks) {
    typedef typename acc_of<T>::type A;
    const long long o = blockIdx.x;
    A s = 0, unused = 0;
    for (long long m = threadIdx.x; m < chunks * L; m += blockDim.x) {
        const long long k = m / L, l = m % L;
        s += part[(k * O + o) * L + l];
    }
    block_sum2(s, unused, shared_as<A>());
    if (threadIdx.x == 0) db[o] = from_acc<T>(s);
}
