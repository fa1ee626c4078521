// im2col and col2im for conv (1-D to 3-D, groups, stride/padding/dilation, channels first or last).
//
// cols has shape (N, G, Cg·K, L): sample, group, (input channel in the group, kernel offset),
// output position; K = k0·k1·k2, L = o0·o1·o2 (1-D and 2-D padded to 3-D with size-1 axes).
// Along an axis, output position o and kernel offset t read input u = o·s − p + t·d (outside the
// input: zero padding).  col2im is the adjoint as a *gather*: one thread per input element sums
// the cols entries that read it (no atomics: deterministic, no zero-fill).

#include "common.cuh"

template <class T>
__global__ void im2col(const T* x, T* cols, long long N, long long C, long long i0, long long i1,
                       long long i2, long long o0, long long o1, long long o2, long long k0, long long k1,
                       long long k2, long long s0, long long s1, long long s2, long long p0, long long p1,
                       long long p2, long long d0, long long d1, long long d2, int channels_last) {
    const long long K = k0 * k1 * k2, L = o0 * o1 * o2;
    const long long total = N * C * K * L;  // = N · G · (Cg · K) · L
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long r = e;
        const long long l = r % L; r /= L;
        const long long t = r % K; r /= K;
        const long long c = r % C;  // (group, channel in group) flattened = input channel
        const long long n = r / C;
        const long long a = l / (o1 * o2), bq = (l / o2) % o1, cq = l % o2;
        const long long t0 = t / (k1 * k2), t1 = (t / k2) % k1, t2 = t % k2;
        const long long u0 = a * s0 - p0 + t0 * d0, u1 = bq * s1 - p1 + t1 * d1, u2 = cq * s2 - p2 + t2 * d2;
        T v = from_acc<T>(0.0f);
        if (u0 >= 0 && u0 < i0 && u1 >= 0 && u1 < i1 && u2 >= 0 && u2 < i2) {
            const long long pos = (u0 * i1 + u1) * i2 + u2;
            v = x[channels_last ? (n * i0 * i1 * i2 + pos) * C + c : (n * C + c) * i0 * i1 * i2 + pos];
        }
        cols[e] = v;
    }
}

__device__ __forceinline__ bool conv_source(long long u, long long t, long long s, long long p, long long d,
                                            long long n_out, long long& o) {
    const long long num = u + p - t * d;
    if (num < 0 || num % s) return false;
    o = num / s;
    return o < n_out;
}

template <class T>
__global__ void col2im(const T* cols, T* dx, long long N, long long C, long long i0, long long i1,
                       long long i2, long long o0, long long o1, long long o2, long long k0, long long k1,
                       long long k2, long long s0, long long s1, long long s2, long long p0, long long p1,
                       long long p2, long long d0, long long d1, long long d2, int channels_last) {
    typedef typename acc_of<T>::type A;
    const long long K = k0 * k1 * k2, L = o0 * o1 * o2, S = i0 * i1 * i2;
    const long long total = N * C * S;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long n, c, pos;
        if (channels_last) {
            c = e % C; pos = (e / C) % S; n = e / (C * S);
        } else {
            pos = e % S; c = (e / S) % C; n = e / (C * S);
        }
        const long long u0 = pos / (i1 * i2), u1 = (pos / i2) % i1, u2 = pos % i2;
        const T* base = cols + (n * C + c) * K * L;  // (n, g, cg) rows of cols, flattened
        A sum = 0;
        long long a, bq, cq;
        for (long long t0 = 0; t0 < k0; ++t0) {
            if (!conv_source(u0, t0, s0, p0, d0, o0, a)) continue;
            for (long long t1 = 0; t1 < k1; ++t1) {
                if (!conv_source(u1, t1, s1, p1, d1, o1, bq)) continue;
                for (long long t2 = 0; t2 < k2; ++t2) {
                    if (!conv_source(u2, t2, s2, p2, d2, o2, cq)) continue;
                    const long long t = (t0 * k1 + t1) * k2 + t2;
                    sum += static_cast<A>(to_acc(base[t * L + (a * o1 + bq) * o2 + cq]));
                }
            }
        }
        dx[e] = from_acc<T>(sum);
    }
}
