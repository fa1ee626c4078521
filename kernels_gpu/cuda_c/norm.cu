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

// --------------------------------------------------------------------------- forward

// Row mode, one block per group: statistics (when `train`) then y = act(x̂ · w + b).
template <class T, class PT>
__global__ void norm_fwd_fused(const T* x, const PT* w, const PT* b, T* y, typename acc_of<T>::type* mean,
                               typename acc_of<T>::type* rstd, typename acc_of<T>::type* var, long long nn,
                               long long pp, long long cc, long long qq, long long cg, long long ss, int train,
                               int center, double eps, int code, double slope) {
    typedef typename acc_of<T>::type A;
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
        for (long long e = threadIdx.x; e < n; e += blockDim.x) {
            const A d = static_cast<A>(to_acc(x[geo.offset(i, c, e)])) - shift;
            s1 += d;
            s2 += d * d;
        }
        block_sum2(s1, s2, shared_as<A>());
        A v;
        if (n == 0) {
            mh = 0; ml = 0; v = 0;
        } else if (center) {
            const A cm = s1 / A(n);
            mh = shift; ml = cm; v = (s2 - s1 * cm) / A(n);
            v = v > A(0) ? v : A(0);
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
                                   int center) {
    typedef typename acc_of<T>::type A;
    const NormGeom geo = {nn, pp, cc, qq, 1, 1};
    const long long g = blockIdx.x, k = blockIdx.y;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const long long chunk = (n + splits - 1) / splits;
    const long long lo = k * chunk, hi = min(n, lo + chunk);
    const A shift = (center && n > 0) ? static_cast<A>(to_acc(x[geo.offset(i, c, 0)])) : A(0);
    A s1 = 0, s2 = 0;
    for (long long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const A d = static_cast<A>(to_acc(x[geo.offset(i, c, e)])) - shift;
        s1 += d;
        s2 += d * d;
    }
    block_sum2(s1, s2, shared_as<A>());
    if (threadIdx.x == 0) {
        part_a[(i * splits + k) * cc + c] = s1;
        part_b[(i * splits + k) * cc + c] = s2;
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
                                 int center, int code, double slope) {
    typedef typename acc_of<T>::type A;
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

// One thread per group: merge the partial shifted sums part[((i * chunks + k) * cc + c) * qp + q]
// (k < chunks, q < qp) in a fixed order into mean (hi, lo), rstd and the biased variance.
template <class T>
__global__ void norm_stats_finalize(const T* x, const typename acc_of<T>::type* part_a,
                                    const typename acc_of<T>::type* part_b, typename acc_of<T>::type* mean,
                                    typename acc_of<T>::type* rstd, typename acc_of<T>::type* var, long long nn,
                                    long long pp, long long cc, long long qq, long long chunks, long long qp,
                                    int center, double eps) {
    typedef typename acc_of<T>::type A;
    const long long groups = nn * cc;
    const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    A s1 = 0, s2 = 0;
    for (long long k = 0; k < chunks; ++k) {
        const long long base = ((i * chunks + k) * cc + c) * qp;
        for (long long q = 0; q < qp; ++q) {
            s1 += part_a[base + q];
            s2 += part_b[base + q];
        }
    }
    A mh = 0, ml = 0, v = 0;
    if (n > 0 && center) {
        const A cm = s1 / A(n);
        mh = static_cast<A>(to_acc(x[(i * pp * cc + c) * qq]));
        ml = cm;
        v = (s2 - s1 * cm) / A(n);
        v = v > A(0) ? v : A(0);
    } else if (n > 0) {
        v = s2 / A(n);
    }
    mean[g] = mh;
    mean[groups + g] = ml;
    var[g] = v;
    rstd[g] = A(1) / pnn_sqrt(v + A(eps));
}

// y = act(x̂ · w + b) elementwise; blockIdx.y strides over the nn * pp rows of width cc * qq.
template <class T, class PT>
__global__ void norm_apply(const T* x, const PT* w, const PT* b, T* y, const typename acc_of<T>::type* mean,
                           const typename acc_of<T>::type* rstd, long long nn, long long pp, long long cc,
                           long long qq, long long cg, long long ss, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long width = cc * qq;
    const long long wcol = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (wcol >= width) return;
    const long long groups = nn * cc;
    const long long c = wcol / qq, q = wcol % qq;
    const long long j = c * cg + q / ss;
    const A wj = param_or<A>(w, j, A(1)), bj = param_or<A>(b, j, A(0));
    for (long long rr = blockIdx.y; rr < nn * pp; rr += gridDim.y) {
        const long long g = (rr / pp) * cc + c;
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

// Row mode, one block per group (training): the group sums, then dx.  When cg == 1 the w-free
// sums also go to part[i * cc + c] for the parameter gradients (part_a may be null).
template <class T, class PT>
__global__ void norm_bwd_fused(const T* x, const T* dy, const PT* w, const PT* b,
                               const typename acc_of<T>::type* mean, const typename acc_of<T>::type* rstd, T* dx,
                               typename acc_of<T>::type* part_a, typename acc_of<T>::type* part_b, long long nn,
                               long long pp, long long cc, long long qq, long long cg, long long ss, int center,
                               int need_x, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const NormGeom geo = {nn, pp, cc, qq, cg, ss};
    const long long g = blockIdx.x;
    const long long groups = nn * cc;
    if (g >= groups) return;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const int wfree = cg == 1;
    const A mh = mean[g], ml = mean[groups + g], r = rstd[g];
    A sa = 0, sb = 0;
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        A gw, xh;
        grad_at(x, dy, w, b, geo.offset(i, c, e), geo.param(c, e), mh, ml, r, wfree, code, slope, gw, xh);
        sa += gw;
        sb += gw * xh;
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
                                 long long splits, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const NormGeom geo = {nn, pp, cc, qq, cg, ss};
    const long long g = blockIdx.x, k = blockIdx.y;
    const long long groups = nn * cc;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    const long long chunk = (n + splits - 1) / splits;
    const long long lo = k * chunk, hi = min(n, lo + chunk);
    const A mh = mean[g], ml = mean[groups + g], r = rstd[g];
    A sa = 0, sb = 0;
    for (long long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        A gw, xh;
        grad_at(x, dy, w, b, geo.offset(i, c, e), geo.param(c, e), mh, ml, r, cg == 1, code, slope, gw, xh);
        sa += gw;
        sb += gw * xh;
    }
    block_sum2(sa, sb, shared_as<A>());
    if (threadIdx.x == 0) {
        part_a[(i * splits + k) * cc + c] = sa;
        part_b[(i * splits + k) * cc + c] = sb;
    }
}

// One thread per group: mean(gw) and mean(gw · x̂) from partials laid out as in
// norm_stats_finalize; `apply_w` multiplies partial column q of group c by w[c * cg + q / ss].
template <class T, class PT>
__global__ void norm_bwd_group_finalize(const PT* w, const typename acc_of<T>::type* part_a,
                                        const typename acc_of<T>::type* part_b, typename acc_of<T>::type* mgw,
                                        typename acc_of<T>::type* mgwx, long long nn, long long pp, long long cc,
                                        long long qq, long long cg, long long ss, long long chunks, long long qp,
                                        int apply_w, int center) {
    typedef typename acc_of<T>::type A;
    const long long groups = nn * cc;
    const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const long long i = g / cc, c = g % cc;
    const long long n = pp * qq;
    A sa = 0, sb = 0;
    for (long long k = 0; k < chunks; ++k) {
        const long long base = ((i * chunks + k) * cc + c) * qp;
        for (long long q = 0; q < qp; ++q) {
            const A wj = apply_w ? param_or<A>(w, c * cg + q / ss, A(1)) : A(1);
            sa += part_a[base + q] * wj;
            sb += part_b[base + q] * wj;
        }
    }
    mgw[g] = (center && n > 0) ? sa / A(n) : A(0);
    mgwx[g] = n > 0 ? sb / A(n) : A(0);
}

// dx elementwise (rows in blockIdx.y as in norm_apply); `train` = 0 for running statistics.
template <class T, class PT>
__global__ void norm_bwd_dx(const T* x, const T* dy, const PT* w, const PT* b, const typename acc_of<T>::type* mean,
                            const typename acc_of<T>::type* rstd, const typename acc_of<T>::type* mgw,
                            const typename acc_of<T>::type* mgwx, T* dx, long long nn, long long pp, long long cc,
                            long long qq, long long cg, long long ss, int train, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long width = cc * qq;
    const long long wcol = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (wcol >= width) return;
    const long long groups = nn * cc;
    const long long c = wcol / qq, q = wcol % qq;
    const long long j = c * cg + q / ss;
    for (long long rr = blockIdx.y; rr < nn * pp; rr += gridDim.y) {
        const long long g = (rr / pp) * cc + c;
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
