// Norm kernels (batch, layer, group, instance, rms), forward and backward, for every layout; moments at the end.
//
// Every norm is one computation on the canonical view of a C-contiguous x (see norm.py):
//     x4 = x.reshape(nn, pp, cc, qq)     statistics per group (i, c) over (p, q)
//     parameter of element (c, q) = c * cg + q / ss
// Two ways to walk a group, chosen by the launcher:
//   row mode     a block (or `splits` blocks) per group, threads along the group's elements;
//                for long contiguous runs (qq >= 32, or pp == 1);
//   column mode  2-D blocks, threadIdx.x along the row of width cc * qq, threadIdx.y and a
//                chunk of rows per block; for short runs (channels-last, (N, C) batch norm).
// Partial sums are reduced by a second kernel in a fixed order: results are deterministic.
//
// Statistics are shifted sums (the group's first element is the shift), accumulated in float
// (double for double data).  The mean is kept as two numbers, mean = hi + lo with hi the shift:
// x - hi is exact for x near the mean, so float32 data with a large offset normalises as
// accurately as centred data.  `mean` arrays hold hi for every group, then lo for every group.

#include "common.cuh"

// Offset of element e of group (i, c), and the element's parameter index.
struct NormGeom {
    long long nn, pp, cc, qq, cg, ss;

    __device__ __forceinline__ long long offset(long long i, long long c, long long e) const {
        if (pp == 1) return (i * cc + c) * qq + e;
        const long long p = e / qq;
        return ((i * pp + p) * cc + c) * qq + (e - p * qq);
    }
    __device__ __forceinline__ long long param(long long c, long long e) const {
        const long long q = pp == 1 ? e : e % qq;
        return c * cg + (ss == 1 ? q : q / ss);
    }
};

template <class A> __device__ __forceinline__ A xhat_of(A xv, A mh, A ml, A r) { return ((xv - mh) - ml) * r; }

// N parameter values from position e, or `fill` for an absent parameter.
template <int N, class A, class P> __device__ __forceinline__ void load_params(const P* p, long long e, A fill,
                                                                               A* out) {
    if (p) {
        load_vec<N>(p + e, out);
    } else {
#pragma unroll
        for (int m = 0; m < N; ++m) out[m] = fill;
    }
}


// The columns wcol .. wcol + V - 1 of a row of width cc * qq: their groups' channel and parameters.
// One division for the first column, then steps (the elementwise kernels walk few rows per thread,
// so this setup is paid per handful of vectors).
template <int V, class A, class PT>
__device__ __forceinline__ void vec_columns(const PT* w, const PT* b, long long w0, long long qq, long long cg,
                                            long long ss, long long* cs, A* wj, A* bj) {
    long long c = w0 / qq, q = w0 - c * qq;
#pragma unroll
    for (int m = 0; m < V; ++m) {
        const long long j = c * cg + (ss == 1 ? q : q / ss);
        cs[m] = c;
        wj[m] = param_or<A>(w, j, A(1));
        bj[m] = param_or<A>(b, j, A(0));
        if (++q == qq) {
            q = 0;
            ++c;
        }
    }
}

// The walk of a thread of norm_apply / norm_bwd_dx over rows of `nvec` column vectors: vector
// `col` of rows first, first + step, …  Rows narrower than a block (channels-last: 64 vectors for
// 256 channels) share it, blockDim.x / nvec rows at a time, where one row per block left three
// quarters of the threads idle (norm.py's _apply_grid then makes a single block column).
struct ElementwiseWalk {
    long long col, first, step;
    bool active;
};

__device__ __forceinline__ ElementwiseWalk elementwise_walk(long long nvec) {
    ElementwiseWalk walk;
    if (nvec <= 0) {
        walk.col = walk.first = walk.step = 0;
        walk.active = false;
    } else if (nvec < static_cast<long long>(blockDim.x)) {
        const long long per_block = blockDim.x / nvec, sub = threadIdx.x / nvec;
        walk.col = threadIdx.x - sub * nvec;
        walk.first = blockIdx.y * per_block + sub;
        walk.step = gridDim.y * per_block;
        walk.active = sub < per_block;
    } else {
        walk.col = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
        walk.first = blockIdx.y;
        walk.step = gridDim.y;
        walk.active = walk.col < nvec;
    }
    return walk;
}

// The group of row rr of the canonical view at channel c, with no division in the usual cases
// (batch norm: nn == 1; layer, instance and group norm: pp == 1).
__device__ __forceinline__ long long group_of_row(long long rr, long long nn, long long pp, long long cc,
                                                  long long c) {
    const long long i = pp == 1 ? rr : (nn == 1 ? 0 : rr / pp);
    return i * cc + c;
}


// --------------------------------------------------------------------------- forward

// This thread's share (stride blockDim.x) of the shifted sums Σ(x − shift), Σ(x − shift)² over
// elements [lo, hi) of group (i, c); with `vec`, lo and hi count V-vectors (qq a multiple of V,
// x 16-byte aligned: V elements of one row per load).
template <class T, class A>
__device__ __forceinline__ void shifted_sums(const T* x, const NormGeom& geo, long long i, long long c, long long lo,
                                             long long hi, int vec, A shift, A& s1, A& s2) {
    const int V = vec_width<T>::value;
    if (vec) {
#pragma unroll 4
        for (long long ev = lo + threadIdx.x; ev < hi; ev += blockDim.x) {
            A xv[V];
            load_vec<V>(x + geo.offset(i, c, ev * V), xv);
#pragma unroll
            for (int m = 0; m < V; ++m) {
                const A d = xv[m] - shift;
                s1 += d;
                s2 += d * d;
            }
        }
        return;
    }
    for (long long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const A d = static_cast<A>(to_acc(x[geo.offset(i, c, e)])) - shift;
        s1 += d;
        s2 += d * d;
    }
}


// Row mode, one block per group: statistics (when `train`) then y = act(x̂ · w + b).
template <class T, class PT>
__global__ void norm_fwd_fused(const T* x, const PT* w, const PT* b, T* y, typename acc_of<T>::type* mean,
                               typename acc_of<T>::type* rstd, typename acc_of<T>::type* var, long long nn,
                               long long pp, long long cc, long long qq, long long cg, long long ss, int train,
                               int center, double eps, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const NormGeom geo = {nn, pp, cc, qq, cg, ss};
    const long long g = blockIdx.x;
    const long long groups = nn * cc;
    if (g >= groups) return;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    A mh, ml, r;
    if (train) {
        const A shift = (center && n > 0) ? static_cast<A>(to_acc(x[geo.offset(i, c, 0)])) : A(0);
        A s1 = 0, s2 = 0;
        shifted_sums(x, geo, i, c, 0, vec ? n / V : n, vec, shift, s1, s2);
        block_sum2(s1, s2, shared_as<A>());
        A v;
        if (n == 0) {
            mh = 0; ml = 0; v = 0;
        } else if (center) {
            const A cm = s1 / A(n);
            mh = shift; ml = cm; v = (s2 - s1 * cm) / A(n);
            v = v < A(0) ? A(0) : v;  // rounding only: NaN data keeps a NaN variance
        } else {
            mh = 0; ml = 0; v = s2 / A(n);
        }
        r = A(1) / pnn_sqrt(v + A(eps));
        if (threadIdx.x == 0) {
            mean[g] = mh;
            mean[groups + g] = ml;
            rstd[g] = r;
            var[g] = v;
        }
    } else {
        mh = mean[g]; ml = mean[groups + g]; r = rstd[g];
    }
    if (vec) {
        const int same = ss % V == 0;
        for (long long ev = threadIdx.x; ev < n / V; ev += blockDim.x) {
            const long long e = ev * V, o = geo.offset(i, c, e), j0 = geo.param(c, e);
            A xv[V];
            load_vec<V>(x + o, xv);
#pragma unroll
            for (int m = 0; m < V; ++m) {
                const long long j = same ? j0 : geo.param(c, e + m);
                const A z = xhat_of(xv[m], mh, ml, r) * param_or<A>(w, j, A(1)) + param_or<A>(b, j, A(0));
                xv[m] = act_fwd(z, code, A(slope));
            }
            store_vec<V>(y + o, xv);
        }
        return;
    }
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        const long long o = geo.offset(i, c, e);
        const long long j = geo.param(c, e);
        const A z = xhat_of(static_cast<A>(to_acc(x[o])), mh, ml, r) * param_or<A>(w, j, A(1)) + param_or<A>(b, j, A(0));
        y[o] = from_acc<T>(act_fwd(z, code, A(slope)));
    }
}

// Row mode with `splits` blocks per group: shifted partial sums of block (g, k) into
// part[(i * splits + k) * cc + c] (the column layout below with qp = 1).
template <class T>
__global__ void norm_stats_partial(const T* x, typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b,
                                   long long nn, long long pp, long long cc, long long qq, long long splits,
                                   int center, int vec) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const NormGeom geo = {nn, pp, cc, qq, 1, 1};
    const long long g = blockIdx.x, k = blockIdx.y;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const A shift = (center && n > 0) ? static_cast<A>(to_acc(x[geo.offset(i, c, 0)])) : A(0);
    A s1 = 0, s2 = 0;
    // chunks of whole vectors with `vec` (the scalar form: 27% of copy bandwidth, ncu)
    const long long units = vec ? n / V : n, chunk = (units + splits - 1) / splits;
    shifted_sums(x, geo, i, c, k * chunk, min(units, k * chunk + chunk), vec, shift, s1, s2);
    block_sum2(s1, s2, shared_as<A>());
    if (threadIdx.x == 0) {
        part_a[(i * splits + k) * cc + c] = s1;
        part_b[(i * splits + k) * cc + c] = s2;
    }
}

// norm_col_partial with 16-byte vectors: a thread takes V adjacent columns (width a multiple of V,
// x and dy aligned); a warp then reads 512 contiguous bytes of a row instead of 128 (the scalar
// form ran at 25% of copy bandwidth for channels-last batch_norm on an H200, ncu).  Statistics
// (mode 0) are per sample (ii = i), so each column's shift is loaded once.
template <class T, class PT>
__device__ __forceinline__ void norm_col_partial_vec(const T* x, const T* dy, const PT* w, const PT* b,
                                                     const typename acc_of<T>::type* mean,
                                                     const typename acc_of<T>::type* rstd,
                                                     typename acc_of<T>::type* part_a,
                                                     typename acc_of<T>::type* part_b, long long nn, long long pp,
                                                     long long cc, long long qq, long long cg, long long ss,
                                                     long long p_eff, long long chunks, long long rows, int mode,
                                                     int center, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const long long width = cc * qq;
    const long long w0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
    const long long ii = blockIdx.y / chunks, k = blockIdx.y % chunks;
    const long long groups = nn * cc;
    A a[V], bs[V];
#pragma unroll
    for (int m = 0; m < V; ++m) {
        a[m] = 0;
        bs[m] = 0;
    }
    if (w0 < width) {
        long long cs[V];
        A wj[V], bj[V], shift[V];
        vec_columns<V>(w, b, w0, qq, cg, ss, cs, wj, bj);
#pragma unroll
        for (int m = 0; m < V; ++m)
            shift[m] = (mode == 0 && center) ? static_cast<A>(to_acc(x[(ii * pp * cc + cs[m]) * qq])) : A(0);
        const long long lo = k * rows, hi = min(p_eff, lo + rows);
        for (long long p = lo + threadIdx.y; p < hi; p += blockDim.y) {
            const long long rr = ii * p_eff + p;
            A xv[V];
            load_vec<V>(x + rr * width + w0, xv);
            if (mode == 0) {
#pragma unroll
                for (int m = 0; m < V; ++m) {
                    const A d = xv[m] - shift[m];
                    a[m] += d;
                    bs[m] += d * d;
                }
            } else {
                const long long gbase = (rr / pp) * cc;
                A gv[V];
                load_vec<V>(dy + rr * width + w0, gv);
#pragma unroll
                for (int m = 0; m < V; ++m) {
                    const long long g = gbase + cs[m];
                    const A xh = xhat_of(xv[m], mean[g], mean[groups + g], rstd[g]);
                    A gm = gv[m];
                    if (code != PNN_ACT_IDENTITY) gm *= act_grad(xh * wj[m] + bj[m], code, A(slope));
                    a[m] += gm;
                    bs[m] += gm * xh;
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < V; ++m) {
        column_sum2(a[m], bs[m], shared_as<A>());
        __syncthreads();
    }
    if (threadIdx.y == 0 && w0 < width) {
        store_vec<V>(part_a + (ii * chunks + k) * width + w0, a);
        store_vec<V>(part_b + (ii * chunks + k) * width + w0, bs);
    }
}

// Column mode partial sums.  Rows are r = ii * p_eff + p for ii < nn_eff and the block's chunk
// of p; column wcol = c * qq + q of the row of width cc * qq.  mode 0: shifted sums of x (the
// shift of group (i, c) is its first element); mode 1: Σ g and Σ g·x̂ with g = dy · act'(x̂ w + b).
// Writes part[(ii * chunks + k) * cc * qq + wcol].
template <class T, class PT>
__global__ void norm_col_partial(const T* x, const T* dy, const PT* w, const PT* b,
                                 const typename acc_of<T>::type* mean, const typename acc_of<T>::type* rstd,
                                 typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b, long long nn,
                                 long long pp, long long cc, long long qq, long long cg, long long ss,
                                 long long nn_eff, long long p_eff, long long chunks, long long rows, int mode,
                                 int center, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    if (vec) {
        norm_col_partial_vec<T, PT>(x, dy, w, b, mean, rstd, part_a, part_b, nn, pp, cc, qq, cg, ss, p_eff, chunks,
                                    rows, mode, center, code, slope);
        return;
    }
    const long long width = cc * qq;
    const long long wcol = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long ii = blockIdx.y / chunks, k = blockIdx.y % chunks;
    const long long groups = nn * cc;
    A a = 0, bsum = 0;
    if (wcol < width) {
        const long long c = wcol / qq, q = wcol % qq;
        const long long j = c * cg + q / ss;
        const A wj = param_or<A>(w, j, A(1)), bj = param_or<A>(b, j, A(0));
        const long long lo = k * rows, hi = min(p_eff, lo + rows);
        for (long long p = lo + threadIdx.y; p < hi; p += blockDim.y) {
            const long long rr = ii * p_eff + p;
            const long long i = rr / pp;
            const A xv = static_cast<A>(to_acc(x[rr * width + wcol]));
            if (mode == 0) {
                const A shift = center ? static_cast<A>(to_acc(x[(i * pp * cc + c) * qq])) : A(0);
                const A d = xv - shift;
                a += d;
                bsum += d * d;
            } else {
                const long long g = i * cc + c;
                const A xh = xhat_of(xv, mean[g], mean[groups + g], rstd[g]);
                A gv = static_cast<A>(to_acc(dy[rr * width + wcol]));
                if (code != PNN_ACT_IDENTITY) gv *= act_grad(xh * wj + bj, code, A(slope));
                a += gv;
                bsum += gv * xh;
            }
        }
    }
    column_sum2(a, bsum, shared_as<A>());
    if (threadIdx.y == 0 && wcol < width) {
        part_a[(ii * chunks + k) * width + wcol] = a;
        part_b[(ii * chunks + k) * width + wcol] = bsum;
    }
}

// This lane's share (stride 32) of the sums over group (i, c)'s partial entries
// ((i * chunks + k) * cc + c) * qp + q, k < chunks, q < qp, each times w[c * cg + q / ss] when
// `apply_w`; warp_sum2 then adds the lanes.  A thread per group walking its partials alone waited
// on every load in turn: 36-46 µs for 66 chunks of batch_norm (64, 256, 56, 56) channels-last on
// an H200 (ncu), a tenth of the pass.
template <class A, class PT>
__device__ __forceinline__ void lane_partial_sums(const A* part_a, const A* part_b, const PT* w, long long i,
                                                  long long c, long long cc, long long chunks, long long qp,
                                                  long long cg, long long ss, int apply_w, A& sa, A& sb) {
    sa = A(0);
    sb = A(0);
    const long long items = chunks * qp;
    for (long long t = threadIdx.x & 31; t < items; t += 32) {
        const long long k = qp == 1 ? t : t / qp, q = t - k * qp;
        const long long e = ((i * chunks + k) * cc + c) * qp + q;
        const A wj = apply_w ? param_or<A>(w, c * cg + (ss == 1 ? q : q / ss), A(1)) : A(1);
        sa += part_a[e] * wj;
        sb += part_b[e] * wj;
    }
}

// Σ a and Σ b over the 32 lanes of a warp in a fixed order (reproducible); lane 0 gets the totals.
// Every lane of the warp takes part.
template <class A> __device__ __forceinline__ void warp_sum2(A& a, A& b) {
    for (int off = 16; off > 0; off >>= 1) {
        const A a2 = __shfl_down_sync(0xffffffffu, a, off);
        const A b2 = __shfl_down_sync(0xffffffffu, b, off);
        a += a2;
        b += b2;
    }
}

// One warp per group: merge the partial shifted sums part[((i * chunks + k) * cc + c) * qp + q]
// (k < chunks, q < qp) in a fixed order into mean (hi, lo), rstd and the biased variance.
template <class T>
__global__ void norm_stats_finalize(const T* x, const typename acc_of<T>::type* part_a,
                                    const typename acc_of<T>::type* part_b, typename acc_of<T>::type* mean,
                                    typename acc_of<T>::type* rstd, typename acc_of<T>::type* var, long long nn,
                                    long long pp, long long cc, long long qq, long long chunks, long long qp,
                                    int center, double eps) {
    typedef typename acc_of<T>::type A;
    const long long groups = nn * cc;
    const long long g = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    if (g >= groups) return;  // whole warps
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    A s1, s2;
    lane_partial_sums(part_a, part_b, static_cast<const A*>(nullptr), i, c, cc, chunks, qp, 1, 1, 0, s1, s2);
    warp_sum2(s1, s2);
    if ((threadIdx.x & 31) != 0) return;
    A mh = 0, ml = 0, v = 0;
    if (n > 0 && center) {
        const A cm = s1 / A(n);
        mh = static_cast<A>(to_acc(x[(i * pp * cc + c) * qq]));
        ml = cm;
        v = (s2 - s1 * cm) / A(n);
        v = v < A(0) ? A(0) : v;  // rounding only: NaN data keeps a NaN variance
    } else if (n > 0) {
        v = s2 / A(n);
    }
    mean[g] = mh;
    mean[groups + g] = ml;
    var[g] = v;
    rstd[g] = A(1) / pnn_sqrt(v + A(eps));
}

// norm_apply (Backward = false: y = act(x̂ w + b)) and norm_bwd_dx (Backward = true) with 16-byte
// vectors: a thread takes V adjacent columns of every row it visits (width a multiple of V, arrays
// 16-byte aligned).  The scalar forms ran at 22% (apply) and 33% (dx) of copy bandwidth for
// batch_norm (64, 256, 56, 56) float32 on an H200 (ncu).  `dy`, `mgw`, `mgwx` only for the backward.
template <bool Backward, class T, class PT>
__device__ __forceinline__ void norm_elementwise_vec(const T* x, const T* dy, const PT* w, const PT* b, T* out,
                                                     const typename acc_of<T>::type* mean,
                                                     const typename acc_of<T>::type* rstd,
                                                     const typename acc_of<T>::type* mgw,
                                                     const typename acc_of<T>::type* mgwx, long long nn,
                                                     long long pp, long long cc, long long qq, long long cg,
                                                     long long ss, int train, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const long long width = cc * qq;
    const ElementwiseWalk walk = elementwise_walk(width / V);
    if (!walk.active) return;
    const long long w0 = walk.col * V;
    const long long groups = nn * cc;
    long long cs[V];
    A wj[V], bj[V];
    vec_columns<V>(w, b, w0, qq, cg, ss, cs, wj, bj);
    for (long long rr = walk.first; rr < nn * pp; rr += walk.step) {
        const long long gbase = group_of_row(rr, nn, pp, cc, 0);
        A xv[V], gv[V], res[V];
        load_vec<V>(x + rr * width + w0, xv);
        if (Backward) load_vec<V>(dy + rr * width + w0, gv);
#pragma unroll
        for (int m = 0; m < V; ++m) {
            const long long g = gbase + cs[m];
            const A r = rstd[g];
            const A xh = xhat_of(xv[m], mean[g], mean[groups + g], r);
            if (!Backward) {
                res[m] = act_fwd(xh * wj[m] + bj[m], code, A(slope));
                continue;
            }
            A gm = gv[m];
            if (code != PNN_ACT_IDENTITY) gm *= act_grad(xh * wj[m] + bj[m], code, A(slope));
            const A gw = gm * wj[m];
            res[m] = train ? r * (gw - mgw[g] - xh * mgwx[g]) : r * gw;
        }
        store_vec<V>(out + rr * width + w0, res);
    }
}

// y = act(x̂ · w + b) elementwise; blockIdx.y strides over the nn * pp rows of width cc * qq.
// `vec`: V columns per thread (norm_elementwise_vec), else one.
template <class T, class PT>
__global__ void norm_apply(const T* x, const PT* w, const PT* b, T* y, const typename acc_of<T>::type* mean,
                           const typename acc_of<T>::type* rstd, long long nn, long long pp, long long cc,
                           long long qq, long long cg, long long ss, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    if (vec) {
        norm_elementwise_vec<false, T, PT>(x, nullptr, w, b, y, mean, rstd, nullptr, nullptr, nn, pp, cc, qq, cg, ss,
                                           1, code, slope);
        return;
    }
    const long long width = cc * qq;
    const ElementwiseWalk walk = elementwise_walk(width);
    if (!walk.active) return;
    const long long wcol = walk.col;
    const long long groups = nn * cc;
    const long long c = wcol / qq, q = wcol % qq;
    const long long j = c * cg + q / ss;
    const A wj = param_or<A>(w, j, A(1)), bj = param_or<A>(b, j, A(0));
    for (long long rr = walk.first; rr < nn * pp; rr += walk.step) {
        const long long g = group_of_row(rr, nn, pp, cc, c);
        const long long o = rr * width + wcol;
        const A z = xhat_of(static_cast<A>(to_acc(x[o])), mean[g], mean[groups + g], rstd[g]) * wj + bj;
        y[o] = from_acc<T>(act_fwd(z, code, A(slope)));
    }
}

// --------------------------------------------------------------------------- backward
//
// With g = dy · act'(z), gw = g · w:  dx = rstd · (gw − mean(gw) − x̂ · mean(gw · x̂)) (training;
// mean(gw) is 0 for rms_norm), dx = rstd · gw (running statistics);  dw = Σ g · x̂,  db = Σ g.
// When cg == 1 every element of a group shares one parameter ("w-free" sums): the group sums
// Σ g and Σ g · x̂ are then also that group's share of dw and db, and w is applied afterwards.

template <class T, class PT>
__device__ __forceinline__ void grad_at(const T* x, const T* dy, const PT* w, const PT* b, long long o, long long j,
                                        typename acc_of<T>::type mh, typename acc_of<T>::type ml,
                                        typename acc_of<T>::type r, int wfree, int code, double slope,
                                        typename acc_of<T>::type& gw, typename acc_of<T>::type& xh) {
    typedef typename acc_of<T>::type A;
    xh = xhat_of(static_cast<A>(to_acc(x[o])), mh, ml, r);
    A gv = static_cast<A>(to_acc(dy[o]));
    const A wj = param_or<A>(w, j, A(1));
    if (code != PNN_ACT_IDENTITY) gv *= act_grad(xh * wj + param_or<A>(b, j, A(0)), code, A(slope));
    gw = wfree ? gv : gv * wj;
}

// grad_at for V adjacent elements from e (one row of the canonical view: qq a multiple of V);
// xv and gv hold x and dy on entry, x̂ and g·w (or g when `wfree`) on return.
template <int V, class A, class PT>
__device__ __forceinline__ void grad_vec(const NormGeom& geo, const PT* w, const PT* b, long long c, long long e,
                                         A mh, A ml, A r, int wfree, int code, double slope, A* xv, A* gv) {
    const long long j0 = geo.param(c, e);
    const int same = geo.ss % V == 0;
#pragma unroll
    for (int m = 0; m < V; ++m) {
        const long long j = same ? j0 : geo.param(c, e + m);
        const A xh = xhat_of(xv[m], mh, ml, r);
        const A wj = param_or<A>(w, j, A(1));
        A g = gv[m];
        if (code != PNN_ACT_IDENTITY) g *= act_grad(xh * wj + param_or<A>(b, j, A(0)), code, A(slope));
        xv[m] = xh;
        gv[m] = wfree ? g : g * wj;
    }
}

// Row mode, one block per group (training): the group sums, then dx.  When cg == 1 the w-free
// sums also go to part[i * cc + c] for the parameter gradients (part_a may be null).
template <class T, class PT>
__global__ void norm_bwd_fused(const T* x, const T* dy, const PT* w, const PT* b,
                               const typename acc_of<T>::type* mean, const typename acc_of<T>::type* rstd, T* dx,
                               typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b, long long nn,
                               long long pp, long long cc, long long qq, long long cg, long long ss, int center,
                               int need_x, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const NormGeom geo = {nn, pp, cc, qq, cg, ss};
    const long long g = blockIdx.x;
    const long long groups = nn * cc;
    if (g >= groups) return;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const int wfree = cg == 1;
    const A mh = mean[g], ml = mean[groups + g], r = rstd[g];
    A sa = 0, sb = 0;
    if (vec) {
        for (long long ev = threadIdx.x; ev < n / V; ev += blockDim.x) {
            const long long o = geo.offset(i, c, ev * V);
            A xv[V], gv[V];
            load_vec<V>(x + o, xv);
            load_vec<V>(dy + o, gv);
            grad_vec<V>(geo, w, b, c, ev * V, mh, ml, r, wfree, code, slope, xv, gv);
#pragma unroll
            for (int m = 0; m < V; ++m) {
                sa += gv[m];
                sb += gv[m] * xv[m];
            }
        }
    } else {
        for (long long e = threadIdx.x; e < n; e += blockDim.x) {
            A gw, xh;
            grad_at(x, dy, w, b, geo.offset(i, c, e), geo.param(c, e), mh, ml, r, wfree, code, slope, gw, xh);
            sa += gw;
            sb += gw * xh;
        }
    }
    block_sum2(sa, sb, shared_as<A>());
    if (wfree && part_a && threadIdx.x == 0) {
        part_a[g] = sa;
        part_b[g] = sb;
    }
    if (!need_x || n == 0) return;
    if (wfree) {
        const A wc = param_or<A>(w, c, A(1));
        sa *= wc;
        sb *= wc;
    }
    const A mgw = center ? sa / A(n) : A(0);
    const A mgwx = sb / A(n);
    if (vec) {
        for (long long ev = threadIdx.x; ev < n / V; ev += blockDim.x) {
            const long long o = geo.offset(i, c, ev * V);
            A xv[V], gv[V];
            load_vec<V>(x + o, xv);
            load_vec<V>(dy + o, gv);
            grad_vec<V>(geo, w, b, c, ev * V, mh, ml, r, 0, code, slope, xv, gv);
#pragma unroll
            for (int m = 0; m < V; ++m) gv[m] = r * (gv[m] - mgw - xv[m] * mgwx);
            store_vec<V>(dx + o, gv);
        }
        return;
    }
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        const long long o = geo.offset(i, c, e);
        A gw, xh;
        grad_at(x, dy, w, b, o, geo.param(c, e), mh, ml, r, 0, code, slope, gw, xh);
        dx[o] = from_acc<T>(r * (gw - mgw - xh * mgwx));
    }
}

// Row mode with `splits` blocks per group: partial group sums (w-free when cg == 1) into
// part[(i * splits + k) * cc + c].
template <class T, class PT>
__global__ void norm_bwd_partial(const T* x, const T* dy, const PT* w, const PT* b,
                                 const typename acc_of<T>::type* mean, const typename acc_of<T>::type* rstd,
                                 typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b, long long nn,
                                 long long pp, long long cc, long long qq, long long cg, long long ss,
                                 long long splits, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const NormGeom geo = {nn, pp, cc, qq, cg, ss};
    const long long g = blockIdx.x, k = blockIdx.y;
    const long long groups = nn * cc;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const A mh = mean[g], ml = mean[groups + g], r = rstd[g];
    A sa = 0, sb = 0;
    if (vec) {  // as norm_stats_partial
        const long long nv = n / V, chunk = (nv + splits - 1) / splits;
        const long long lo = k * chunk, hi = min(nv, lo + chunk);
#pragma unroll 2
        for (long long ev = lo + threadIdx.x; ev < hi; ev += blockDim.x) {
            const long long o = geo.offset(i, c, ev * V);
            A xv[V], gv[V];
            load_vec<V>(x + o, xv);
            load_vec<V>(dy + o, gv);
            grad_vec<V>(geo, w, b, c, ev * V, mh, ml, r, cg == 1, code, slope, xv, gv);
#pragma unroll
            for (int m = 0; m < V; ++m) {
                sa += gv[m];
                sb += gv[m] * xv[m];
            }
        }
    } else {
        const long long chunk = (n + splits - 1) / splits;
        const long long lo = k * chunk, hi = min(n, lo + chunk);
        for (long long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
            A gw, xh;
            grad_at(x, dy, w, b, geo.offset(i, c, e), geo.param(c, e), mh, ml, r, cg == 1, code, slope, gw, xh);
            sa += gw;
            sb += gw * xh;
        }
    }
    block_sum2(sa, sb, shared_as<A>());
    if (threadIdx.x == 0) {
        part_a[(i * splits + k) * cc + c] = sa;
        part_b[(i * splits + k) * cc + c] = sb;
    }
}

// One warp per group: mean(gw) and mean(gw · x̂) from partials laid out as in
// norm_stats_finalize; `apply_w` multiplies partial column q of group c by w[c * cg + q / ss].
template <class T, class PT>
__global__ void norm_bwd_group_finalize(const PT* w, const typename acc_of<T>::type* part_a,
                                        const typename acc_of<T>::type* part_b, typename acc_of<T>::type* mgw,
                                        typename acc_of<T>::type* mgwx, long long nn, long long pp, long long cc,
                                        long long qq, long long cg, long long ss, long long chunks, long long qp,
                                        int apply_w, int center) {
    typedef typename acc_of<T>::type A;
    const long long groups = nn * cc;
    const long long g = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    if (g >= groups) return;  // whole warps
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    A sa, sb;
    lane_partial_sums(part_a, part_b, w, i, c, cc, chunks, qp, cg, ss, apply_w, sa, sb);
    warp_sum2(sa, sb);
    if ((threadIdx.x & 31) != 0) return;
    mgw[g] = (center && n > 0) ? sa / A(n) : A(0);
    mgwx[g] = n > 0 ? sb / A(n) : A(0);
}

// dx elementwise (rows in blockIdx.y as in norm_apply); `train` = 0 for running statistics;
// `vec`: V columns per thread (norm_elementwise_vec), else one.
template <class T, class PT>
__global__ void norm_bwd_dx(const T* x, const T* dy, const PT* w, const PT* b, const typename acc_of<T>::type* mean,
                            const typename acc_of<T>::type* rstd, const typename acc_of<T>::type* mgw,
                            const typename acc_of<T>::type* mgwx, T* dx, long long nn, long long pp, long long cc,
                            long long qq, long long cg, long long ss, int train, int code, double slope, int vec) {
    typedef typename acc_of<T>::type A;
    if (vec) {
        norm_elementwise_vec<true, T, PT>(x, dy, w, b, dx, mean, rstd, mgw, mgwx, nn, pp, cc, qq, cg, ss, train, code,
                                          slope);
        return;
    }
    const long long width = cc * qq;
    const ElementwiseWalk walk = elementwise_walk(width);
    if (!walk.active) return;
    const long long wcol = walk.col;
    const long long groups = nn * cc;
    const long long c = wcol / qq, q = wcol % qq;
    const long long j = c * cg + q / ss;
    for (long long rr = walk.first; rr < nn * pp; rr += walk.step) {
        const long long g = group_of_row(rr, nn, pp, cc, c);
        const long long o = rr * width + wcol;
        const A r = rstd[g];
        A gw, xh;
        grad_at(x, dy, w, b, o, j, mean[g], mean[groups + g], r, 0, code, slope, gw, xh);
        dx[o] = from_acc<T>(train ? r * (gw - mgw[g] - xh * mgwx[g]) : r * gw);
    }
}

// One block per parameter j = c * cg + jj: dw[j] = Σ part_b, db[j] = Σ part_a over the partial
// entries ((kk * cc + c) * qp + jj * s_eff + s) for kk < rows_of_parts, s < s_eff; a block tree
// reduction (fixed order).  dw or db may be null (not needed).
template <class T, class PT>
__global__ void norm_param_finalize(const typename acc_of<T>::type* part_a, const typename acc_of<T>::type* part_b,
                                    PT* dw, PT* db, long long cc, long long cg, long long rows_of_parts,
                                    long long qp, long long s_eff) {
    typedef typename acc_of<T>::type A;
    const long long j = blockIdx.x;
    if (j >= cc * cg) return;
    const long long c = j / cg, jj = j % cg;
    const long long total = rows_of_parts * s_eff;
    A sa = 0, sb = 0;
    for (long long m = threadIdx.x; m < total; m += blockDim.x) {
        const long long kk = m / s_eff, s = m % s_eff;
        const long long o = (kk * cc + c) * qp + jj * s_eff + s;
        sa += part_a[o];
        sb += part_b[o];
    }
    block_sum2(sa, sb, shared_as<A>());
    if (threadIdx.x == 0) {
        if (dw) dw[j] = from_acc<PT>(sb);
        if (db) db[j] = from_acc<PT>(sa);
    }
}

// --------------------------------------------------------------------------- contiguous rows
//
// layer_norm / rms_norm over trailing axes: groups are rows of n contiguous elements and the
// parameters are indexed by the position in the row (cc == 1, cg == n, ss == 1).  The launcher
// takes this path when n is a multiple of the 16-byte vector width and every array is 16-byte
// aligned: each thread loads its share of a row once, in 16-byte vectors, keeps it in registers
// and writes the output from there, so the row is read once (the generic row kernel above reads
// it twice, scalar, with 64-bit index arithmetic per element: 30% of copy bandwidth for
// (8192, 4096) float32 on an H200, ncu).  The backward also accumulates the parameter-gradient
// partials of its rows in registers (the generic path re-reads x and dy for them).

// Vectors of a row per thread, at most: the forward keeps x (ROWS_FWD_VECS · 16 bytes per
// thread), the backward x, dy and two parameter-gradient accumulators (ROWS_BWD_VECS each).
#define ROWS_FWD_VECS 4
#define ROWS_BWD_VECS 2

// One block per row (grid-stride over rows): shifted sums (the row's first element is the
// shift, as norm_fwd_fused), then y = act(x̂ · w + b).  `items` vectors of the row per thread.
template <class T, class PT>
__global__ void norm_rows_fwd(const T* x, const PT* w, const PT* b, T* y, typename acc_of<T>::type* mean,
                              typename acc_of<T>::type* rstd, typename acc_of<T>::type* var, long long rows,
                              long long n, int items, int center, double eps, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const long long nvec = n / V;
    A* sh = shared_as<A>();
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        A v[ROWS_FWD_VECS * V];
        const A shift = center ? static_cast<A>(to_acc(xr[0])) : A(0);
        A s1 = 0, s2 = 0;
#pragma unroll
        for (int k = 0; k < ROWS_FWD_VECS; ++k) {
            const long long vi = threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (k < items && vi < nvec) {
                load_vec<V>(xr + vi * V, v + k * V);
#pragma unroll
                for (int m = 0; m < V; ++m) {
                    const A d = v[k * V + m] - shift;
                    s1 += d;
                    s2 += d * d;
                }
            }
        }
        block_sum2(s1, s2, sh);
        A mh, ml, vr;
        if (center) {
            const A cm = s1 / A(n);
            mh = shift; ml = cm; vr = (s2 - s1 * cm) / A(n);
            vr = vr < A(0) ? A(0) : vr;  // rounding only: NaN data keeps a NaN variance
        } else {
            mh = 0; ml = 0; vr = s2 / A(n);
        }
        const A r = A(1) / pnn_sqrt(vr + A(eps));
        if (threadIdx.x == 0) {
            mean[row] = mh;
            mean[rows + row] = ml;
            rstd[row] = r;
            var[row] = vr;
        }
#pragma unroll
        for (int k = 0; k < ROWS_FWD_VECS; ++k) {
            const long long vi = threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (k < items && vi < nvec) {
                A wv[V], bv[V], out[V];
                load_params<V>(w, vi * V, A(1), wv);
                load_params<V>(b, vi * V, A(0), bv);
#pragma unroll
                for (int m = 0; m < V; ++m)
                    out[m] = act_fwd(xhat_of(v[k * V + m], mh, ml, r) * wv[m] + bv[m], code, A(slope));
                store_vec<V>(y + row * n + vi * V, out);
            }
        }
    }
}

// Block k takes rows [k · per_block, (k + 1) · per_block): for each, the sums of g·w and g·w·x̂
// (g = dy · act'(x̂ w + b)) then dx; the parameter-gradient partials of its rows (Σ g·x̂, Σ g per
// position) go to part_b/part_a[k · n + e] when part_a is given; dx is skipped when null.
template <class T, class PT>
__global__ void norm_rows_bwd(const T* x, const T* dy, const PT* w, const PT* b,
                              const typename acc_of<T>::type* mean, const typename acc_of<T>::type* rstd, T* dx,
                              typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b, long long rows,
                              long long n, long long per_block, int items, int center, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const int V = vec_width<T>::value;
    const int E = ROWS_BWD_VECS * V;
    const long long nvec = n / V;
    A* sh = shared_as<A>();
    A pa[E], pb[E];
#pragma unroll
    for (int m = 0; m < E; ++m) {
        pa[m] = 0;
        pb[m] = 0;
    }
    const long long first = static_cast<long long>(blockIdx.x) * per_block;
    const long long last = min(rows, first + per_block);
    for (long long row = first; row < last; ++row) {
        const A mh = mean[row], ml = mean[rows + row], r = rstd[row];
        A xh[E], gw[E];
        A sa = 0, sb = 0;
#pragma unroll
        for (int k = 0; k < ROWS_BWD_VECS; ++k) {
            const long long vi = threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (k < items && vi < nvec) {
                A xv[V], gv[V], wv[V], bv[V];
                load_vec<V>(x + row * n + vi * V, xv);
                load_vec<V>(dy + row * n + vi * V, gv);
                load_params<V>(w, vi * V, A(1), wv);
                if (code != PNN_ACT_IDENTITY) load_params<V>(b, vi * V, A(0), bv);
#pragma unroll
                for (int m = 0; m < V; ++m) {
                    const A h = xhat_of(xv[m], mh, ml, r);
                    A g = gv[m];
                    if (code != PNN_ACT_IDENTITY) g *= act_grad(h * wv[m] + bv[m], code, A(slope));
                    pa[k * V + m] += g;
                    pb[k * V + m] += g * h;
                    xh[k * V + m] = h;
                    gw[k * V + m] = g * wv[m];
                    sa += g * wv[m];
                    sb += g * wv[m] * h;
                }
            }
        }
        if (!dx) continue;
        block_sum2(sa, sb, sh);
        const A mgw = center ? sa / A(n) : A(0);
        const A mgwx = sb / A(n);
#pragma unroll
        for (int k = 0; k < ROWS_BWD_VECS; ++k) {
            const long long vi = threadIdx.x + static_cast<long long>(k) * blockDim.x;
            if (k < items && vi < nvec) {
                A out[V];
#pragma unroll
                for (int m = 0; m < V; ++m) out[m] = r * (gw[k * V + m] - mgw - xh[k * V + m] * mgwx);
                store_vec<V>(dx + row * n + vi * V, out);
            }
        }
    }
    if (!part_a) return;
#pragma unroll
    for (int k = 0; k < ROWS_BWD_VECS; ++k) {
        const long long vi = threadIdx.x + static_cast<long long>(k) * blockDim.x;
        if (k < items && vi < nvec) {
            store_vec<V>(part_a + static_cast<long long>(blockIdx.x) * n + vi * V, pa + k * V);
            store_vec<V>(part_b + static_cast<long long>(blockIdx.x) * n + vi * V, pb + k * V);
        }
    }
}

// --------------------------------------------------------------------------- moments
//
// moments over any axes, on the plan of kernels_cpu.norm.moments_plan: x is rows of length L and
//     row(kk, rr) = (ktab ? ktab[kk] : kk * kstride) + (rtab ? rtab[rr] : rr * rstride);
// row mode (lk = 1): group g = kk holds its rows row(g, rr) whole; column mode (lk = L): group
// g = kk * L + j holds column j of the rows row(kk, rr).  Groups are in the output's order.  A
// group's first element is its shift, shared by all of the group's partial sums, so partials add
// exactly.  Results are in the accumulation type A (float for float/half/bfloat16 data, double
// for double): mean and var, and for the backward the shift and the centred mean cm = Σ(x − shift)/n
// kept apart, so dx can form (x − shift) − cm without rounding the data's offset.

struct MomGeom {
    long long L, kstride, rstride;
    const long long* ktab;
    const long long* rtab;

    __device__ __forceinline__ long long row(long long kk, long long rr) const {
        return (ktab ? ktab[kk] : kk * kstride) + (rtab ? rtab[rr] : rr * rstride);
    }
};

// mean = shift + cm, var = (Σd² − Σd · cm) / (n − correction) (NaN when n <= correction).
template <class A>
__device__ __forceinline__ void moments_store(long long g, A shift, A s1, A s2, long long n, double correction,
                                              A* mean, A* var, A* sh, A* cm) {
    const A c = s1 / A(n);
    const double denom = static_cast<double>(n) - correction;
    A v = static_cast<A>(__int_as_float(0x7fc00000));
    if (denom > 0) {
        v = (s2 - s1 * c) / A(denom);
        if (v < A(0)) v = A(0);  // rounding only: NaN data keeps a NaN variance
    }
    mean[g] = shift + c;
    var[g] = v;
    sh[g] = shift;
    cm[g] = c;
}

// Row mode, block (g, k): shifted sums of chunk k of group g, the rows rc·rper … (rc = k / qsplits)
// restricted to the columns q0 … q0 + qper of each.  The 1-D block is a tx × (blockDim.x / tx) tile
// (tx a power of two): lanes along a row and across rows, so short rows keep every thread busy.
// One chunk per group (gridDim.y == 1): the block stores the group's results; else its partial sums
// go to part[g · gridDim.y + k].
template <class T>
__global__ void moments_rows(const T* x, typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b,
                             typename acc_of<T>::type* mean, typename acc_of<T>::type* var,
                             typename acc_of<T>::type* sh, typename acc_of<T>::type* cm, long long L,
                             long long kstride, const long long* ktab, long long rstride, const long long* rtab,
                             long long rout, long long rper, long long qper, long long qsplits, long long tx,
                             double correction) {
    typedef typename acc_of<T>::type A;
    const MomGeom geo = {L, kstride, rstride, ktab, rtab};
    const long long g = blockIdx.x, k = blockIdx.y;
    const long long rc = k / qsplits;
    const long long q0 = (k - rc * qsplits) * qper, q1 = min(L, q0 + qper);
    const long long r1 = min(rout, (rc + 1) * rper);
    const long long lane = threadIdx.x & (tx - 1), ny = blockDim.x / tx;
    const A shift = static_cast<A>(to_acc(x[geo.row(g, 0) * L]));
    A s1 = 0, s2 = 0;
    for (long long rr = rc * rper + threadIdx.x / tx; rr < r1; rr += ny) {
        const long long base = geo.row(g, rr) * L;
        for (long long q = q0 + lane; q < q1; q += tx) {
            const A d = static_cast<A>(to_acc(x[base + q])) - shift;
            s1 += d;
            s2 += d * d;
        }
    }
    block_sum2(s1, s2, shared_as<A>());
    if (threadIdx.x == 0) {
        if (gridDim.y == 1) {
            moments_store(g, shift, s1, s2, rout * L, correction, mean, var, sh, cm);
        } else {
            part_a[g * gridDim.y + k] = s1;
            part_b[g * gridDim.y + k] = s2;
        }
    }
}

// Groups too small to fill a block (either mode): one thread per group g = kk · lk + j (consecutive
// threads read neighbouring columns in column mode), grid-strided; the group's results stored.
template <class T>
__global__ void moments_small(const T* x, typename acc_of<T>::type* mean, typename acc_of<T>::type* var,
                              typename acc_of<T>::type* sh, typename acc_of<T>::type* cm, long long L, long long lk,
                              long long kstride, const long long* ktab, long long rstride, const long long* rtab,
                              long long groups, long long rout, double correction) {
    typedef typename acc_of<T>::type A;
    const MomGeom geo = {L, kstride, rstride, ktab, rtab};
    const long long lr = L / lk;
    for (long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
         g += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long kk = g / lk, j = g - kk * lk;
        const A shift = static_cast<A>(to_acc(x[geo.row(kk, 0) * L + j]));
        A s1 = 0, s2 = 0;
        for (long long rr = 0; rr < rout; ++rr) {
            const long long base = geo.row(kk, rr) * L + j;
            for (long long q = 0; q < lr; ++q) {
                const A d = static_cast<A>(to_acc(x[base + q])) - shift;
                s1 += d;
                s2 += d * d;
            }
        }
        moments_store(g, shift, s1, s2, rout * lr, correction, mean, var, sh, cm);
    }
}

// Column mode: 2-D blocks, threadIdx.x along the columns j (coalesced), threadIdx.y across rows.
// Block (column tile, u), u = kk · rsplits + k grid-strided over y, sums column j of the rows
// k·rper … of kk.  rsplits == 1: it stores the results of group kk · L + j; else part[u · L + j].
template <class T>
__global__ void moments_cols(const T* x, typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b,
                             typename acc_of<T>::type* mean, typename acc_of<T>::type* var,
                             typename acc_of<T>::type* sh, typename acc_of<T>::type* cm, long long L,
                             long long kstride, const long long* ktab, long long rstride, const long long* rtab,
                             long long kout, long long rout, long long rper, long long rsplits, double correction) {
    typedef typename acc_of<T>::type A;
    const MomGeom geo = {L, kstride, rstride, ktab, rtab};
    const long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (long long u = blockIdx.y; u < kout * rsplits; u += gridDim.y) {
        const long long kk = u / rsplits, k = u - kk * rsplits;
        A shift = 0, s1 = 0, s2 = 0;
        if (j < L) {
            shift = static_cast<A>(to_acc(x[geo.row(kk, 0) * L + j]));
            const long long r1 = min(rout, (k + 1) * rper);
            for (long long rr = k * rper + threadIdx.y; rr < r1; rr += blockDim.y) {
                const A d = static_cast<A>(to_acc(x[geo.row(kk, rr) * L + j])) - shift;
                s1 += d;
                s2 += d * d;
            }
        }
        column_sum2(s1, s2, shared_as<A>());
        if (threadIdx.y == 0 && j < L) {
            if (rsplits == 1) {
                moments_store(kk * L + j, shift, s1, s2, rout, correction, mean, var, sh, cm);
            } else {
                part_a[u * L + j] = s1;
                part_b[u * L + j] = s2;
            }
        }
        __syncthreads();  // the next unit reuses the shared memory
    }
}

// One thread per group g = kk · lk + j: its partial sums part[(kk · splits + k) · lk + j], k < splits,
// added in a fixed order, then the results stored (n elements per group).
template <class T>
__global__ void moments_finalize(const T* x, const typename acc_of<T>::type* part_a,
                                 const typename acc_of<T>::type* part_b, typename acc_of<T>::type* mean,
                                 typename acc_of<T>::type* var, typename acc_of<T>::type* sh,
                                 typename acc_of<T>::type* cm, long long L, long long lk, long long kstride,
                                 const long long* ktab, long long groups, long long splits, long long n,
                                 double correction) {
    typedef typename acc_of<T>::type A;
    const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const long long kk = g / lk, j = g - kk * lk;
    A s1 = 0, s2 = 0;
    for (long long k = 0; k < splits; ++k) {
        s1 += part_a[(kk * splits + k) * lk + j];
        s2 += part_b[(kk * splits + k) * lk + j];
    }
    const long long first = (ktab ? ktab[kk] : kk * kstride) * L + j;
    moments_store(g, static_cast<A>(to_acc(x[first])), s1, s2, n, correction, mean, var, sh, cm);
}

// dx = dmean · inv_n + dvar · two_over_denom · ((x − shift) − cm) with the element's group's values
// (a null dmean or dvar contributes nothing).  2-D blocks: threadIdx.x along the row (i < L),
// threadIdx.y over the rows in (kk, rr) order, kk · rout + rr, grid-strided over y: short rows and few
// rows per kk still fill the block.  Every element is written once.
template <class T>
__global__ void moments_dx(const T* x, const typename acc_of<T>::type* dmean, const typename acc_of<T>::type* dvar,
                           const typename acc_of<T>::type* sh, const typename acc_of<T>::type* cm, T* dx, long long L,
                           long long lk, long long kstride, const long long* ktab, long long rstride,
                           const long long* rtab, long long kout, long long rout, double inv_n,
                           double two_over_denom) {
    typedef typename acc_of<T>::type A;
    const MomGeom geo = {L, kstride, rstride, ktab, rtab};
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= L) return;
    const long long rows = kout * rout;
    for (long long r = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
         r += static_cast<long long>(gridDim.y) * blockDim.y) {
        const long long kk = r / rout, rr = r - kk * rout;
        const long long g = kk * lk + (lk > 1 ? i : 0);
        const A ca = dmean ? dmean[g] * A(inv_n) : A(0);
        const A cb = dvar ? dvar[g] * A(two_over_denom) : A(0);
        const long long o = geo.row(kk, rr) * L + i;
        dx[o] = from_acc<T>(ca + cb * ((static_cast<A>(to_acc(x[o])) - sh[g]) - cm[g]));
    }
}
