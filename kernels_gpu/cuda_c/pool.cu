// max_pool and avg_pool, forward and backward, 1-D to 3-D, channels first or last.
//
// Canonical view of a C-contiguous x (pool.py): B planes of D·H·W positions of K contiguous
// channels, x5[b, d, h, w, k]; 1-D and 2-D pools have leading spatial axes of size 1.  Along an
// axis, output o reads input positions o·stride − pad + t·dilation, t < window; positions outside
// the input are padding (skipped; avg_pool's divisor, computed by the api, accounts for them).
//
// Forward: one thread per output element, the window in row-major order.  max keeps the first
// maximum (v > best), and any NaN replaces the best (NaN propagates, the last NaN's position is
// the gradient's target), as PyTorch does; a window of padding only gives −inf and position −1.
// Backward: one thread per input element *gathers* from the outputs whose windows cover it (no
// atomics: deterministic, and no zero-filling pass).
//
// max_unpool (x and indices as B planes of P_in positions of K channels, y as B planes of P_out):
// unpool_claim gives each output position the largest x position (in the plane) whose index
// names it (atomicMax on an int32 buffer filled with -1), so duplicates resolve to the last entry
// in x's order whatever the scheduling; unpool_fill then gathers (zero where nothing claimed);
// the backward gives each entry dy at its index if it holds the claim, else 0.

#include "common.cuh"

template <class T>
__global__ void pool_fwd(const T* x, T* y, int* arg, const double* div0, const double* div1, const double* div2,
                         long long B, long long K, long long i0, long long i1, long long i2, long long o0,
                         long long o1, long long o2, long long w0, long long w1, long long w2, long long s0,
                         long long s1, long long s2, long long p0, long long p1, long long p2, long long d0,
                         long long d1, long long d2, int is_max) {
    typedef typename acc_of<T>::type A;
    const long long total = B * o0 * o1 * o2 * K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long r = e;
        const long long k = r % K; r /= K;
        const long long c = r % o2; r /= o2;
        const long long bq = r % o1; r /= o1;
        const long long a = r % o0;
        const long long b = r / o0;
        const T* plane = x + b * i0 * i1 * i2 * K;
        A best = is_max ? -pnn_inf<A>() : A(0);
        long long where = -1;
        for (long long t0 = 0; t0 < w0; ++t0) {
            const long long u0 = a * s0 - p0 + t0 * d0;
            if (u0 < 0 || u0 >= i0) continue;
            for (long long t1 = 0; t1 < w1; ++t1) {
                const long long u1 = bq * s1 - p1 + t1 * d1;
                if (u1 < 0 || u1 >= i1) continue;
                for (long long t2 = 0; t2 < w2; ++t2) {
                    const long long u2 = c * s2 - p2 + t2 * d2;
                    if (u2 < 0 || u2 >= i2) continue;
                    const long long pos = (u0 * i1 + u1) * i2 + u2;
                    const A v = static_cast<A>(to_acc(plane[pos * K + k]));
                    if (is_max) {
                        if (v > best || pnn_isnan(v)) {
                            best = v;
                            where = pos;
                        }
                    } else {
                        best += v;
                    }
                }
            }
        }
        if (!is_max) best /= static_cast<A>(div0[a] * div1[bq] * div2[c]);
        y[e] = from_acc<T>(best);
        if (arg) arg[e] = static_cast<int>(where);
    }
}

// The outputs covering input position u along one axis: o·s − p + t·d = u for some t < w.
__device__ __forceinline__ bool pool_source(long long u, long long t, long long s, long long p, long long d,
                                            long long n_out, long long& o) {
    const long long num = u + p - t * d;
    if (num < 0 || num % s) return false;
    o = num / s;
    return o < n_out;
}

template <class T>
__global__ void pool_bwd(const T* dy, T* dx, const int* arg, const double* div0, const double* div1,
                         const double* div2, long long B, long long K, long long i0, long long i1, long long i2,
                         long long o0, long long o1, long long o2, long long w0, long long w1, long long w2,
                         long long s0, long long s1, long long s2, long long p0, long long p1, long long p2,
                         long long d0, long long d1, long long d2, int is_max) {
    typedef typename acc_of<T>::type A;
    const long long total = B * i0 * i1 * i2 * K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long r = e;
        const long long k = r % K; r /= K;
        const long long u2 = r % i2; r /= i2;
        const long long u1 = r % i1; r /= i1;
        const long long u0 = r % i0;
        const long long b = r / i0;
        const long long pos = (u0 * i1 + u1) * i2 + u2;
        const long long out_plane = b * o0 * o1 * o2 * K;
        A sum = 0;
        long long a, bq, c;
        for (long long t0 = 0; t0 < w0; ++t0) {
            if (!pool_source(u0, t0, s0, p0, d0, o0, a)) continue;
            for (long long t1 = 0; t1 < w1; ++t1) {
                if (!pool_source(u1, t1, s1, p1, d1, o1, bq)) continue;
                for (long long t2 = 0; t2 < w2; ++t2) {
                    if (!pool_source(u2, t2, s2, p2, d2, o2, c)) continue;
                    const long long o = out_plane + ((a * o1 + bq) * o2 + c) * K + k;
                    if (is_max) {
                        if (arg[o] == pos) sum += static_cast<A>(to_acc(dy[o]));
                    } else {
                        sum += static_cast<A>(to_acc(dy[o])) / static_cast<A>(div0[a] * div1[bq] * div2[c]);
                    }
                }
            }
        }
        dx[e] = from_acc<T>(sum);
    }
}

__global__ void unpool_claim(const long long* idx, int* winner, long long B, long long K, long long p_in,
                             long long p_out) {
    const long long total = B * p_in * K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long k = e % K;
        const long long r = e / K;
        const long long p = r % p_in;
        const long long b = r / p_in;
        const long long q = idx[e];
        if (q >= 0 && q < p_out) atomicMax(winner + (b * p_out + q) * K + k, static_cast<int>(p));
    }
}

template <class T>
__global__ void unpool_fill(const T* x, const int* winner, T* y, long long B, long long K, long long p_in,
                            long long p_out) {
    const long long total = B * p_out * K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long k = e % K;
        const long long b = e / K / p_out;
        const int w = winner[e];
        y[e] = w >= 0 ? x[(b * p_in + w) * K + k] : from_acc<T>(0.0f);
    }
}

template <class T>
__global__ void unpool_bwd(const T* dy, const long long* idx, const int* winner, T* dx, long long B, long long K,
                           long long p_in, long long p_out) {
    const long long total = B * p_in * K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long k = e % K;
        const long long p = (e / K) % p_in;
        const long long b = e / K / p_in;
        const long long q = idx[e];
        const long long o = (b * p_out + q) * K + k;
        dx[e] = (q >= 0 && q < p_out && winner[o] == p) ? dy[o] : from_acc<T>(0.0f);
    }
}
