// Shared device code of the CUDA C kernels (backend "cupy").
//
// The launcher (_runtime.py) pastes this header in place of `#include "common.cuh"` before
// compiling, so the source handed to NVRTC is self-contained and CuPy's compile cache keys on
// the whole text.  No CUDA header is included: half and bfloat16 are handled as 16-bit storage
// types converted with PTX instructions (sm_80+), so the sources compile with a bare NVRTC.
//
// Conventions shared by every kernel and its launcher (the CI test checks them against the PTX):
//   pointers        -> device pointers (a null pointer is passed as a 64-bit zero)
//   sizes, indices  -> long long
//   flags, codes    -> int
//   float scalars   -> double (converted to the accumulation type inside)
#pragma once

// --------------------------------------------------------------------------- storage types

// 16-bit floating storage; arithmetic always happens in float.
struct __align__(2) pnn_half { unsigned short bits; };
struct __align__(2) pnn_bf16 { unsigned short bits; };

#ifdef PNN_EMULATE  // the CPU emulator of the tests (emulator.h) converts in C++
__device__ __forceinline__ float pnn_half_to_float(unsigned short h) { return pnn_emu_half_to_float(h); }
__device__ __forceinline__ unsigned short pnn_float_to_half(float f) { return pnn_emu_float_to_half(f); }
__device__ __forceinline__ unsigned short pnn_float_to_bf16(float f) { return pnn_emu_float_to_bf16(f); }
#else
__device__ __forceinline__ float pnn_half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short pnn_float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned short pnn_float_to_bf16(float f) {
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
}

#endif

__device__ __forceinline__ float pnn_bf16_to_float(unsigned short b) {
    return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

// The accumulation type of a storage type: float for float/half/bfloat16, double for double.
template <class T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

// Load any storage type as its accumulation type (or wider).
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(pnn_half v) { return pnn_half_to_float(v.bits); }
__device__ __forceinline__ float to_acc(pnn_bf16 v) { return pnn_bf16_to_float(v.bits); }

// Store an accumulated value into a storage type (round to nearest even).
template <class T> struct store_as {
    template <class A> static __device__ __forceinline__ T from(A v) { return static_cast<T>(v); }
};
template <> struct store_as<pnn_half> {
    template <class A> static __device__ __forceinline__ pnn_half from(A v) {
        pnn_half h;
        h.bits = pnn_float_to_half(static_cast<float>(v));
        return h;
    }
};
template <> struct store_as<pnn_bf16> {
    template <class A> static __device__ __forceinline__ pnn_bf16 from(A v) {
        pnn_bf16 h;
        h.bits = pnn_float_to_bf16(static_cast<float>(v));
        return h;
    }
};

template <class T, class A> __device__ __forceinline__ T from_acc(A v) { return store_as<T>::from(v); }

// A parameter value, or `fill` where the parameter is absent (null pointer).
template <class A, class P> __device__ __forceinline__ A param_or(const P* p, long long j, A fill) {
    return p ? static_cast<A>(to_acc(p[j])) : fill;
}

// --------------------------------------------------------------------------- 16-byte vectors
// (the norm and loss kernels' vector loads and stores)

// Elements of T in a 16-byte vector.
template <class T> struct vec_width { static const int value = 16 / sizeof(T); };

struct __align__(16) pnn_vec16 { unsigned int a, b, c, d; };

// Load N consecutive elements at p (16-byte aligned, N·sizeof(P) a multiple of 16) as A.
template <int N, class A, class P> __device__ __forceinline__ void load_vec(const P* p, A* out) {
    const int per = 16 / sizeof(P);
#pragma unroll
    for (int k = 0; k < N / per; ++k) {
        union { pnn_vec16 v; P e[16 / sizeof(P)]; } u;
        u.v = reinterpret_cast<const pnn_vec16*>(p)[k];
#pragma unroll
        for (int m = 0; m < per; ++m) out[k * per + m] = static_cast<A>(to_acc(u.e[m]));
    }
}

// Store N accumulated values at p (16-byte aligned) as T.
template <int N, class T, class A> __device__ __forceinline__ void store_vec(T* p, const A* in) {
    const int per = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < N / per; ++k) {
        union { pnn_vec16 v; T e[16 / sizeof(T)]; } u;
#pragma unroll
        for (int m = 0; m < per; ++m) u.e[m] = from_acc<T>(in[k * per + m]);
        reinterpret_cast<pnn_vec16*>(p)[k] = u.v;
    }
}

// --------------------------------------------------------------------------- math by type

__device__ __forceinline__ float pnn_exp(float v) { return expf(v); }
__device__ __forceinline__ double pnn_exp(double v) { return exp(v); }
__device__ __forceinline__ float pnn_log(float v) { return logf(v); }
__device__ __forceinline__ double pnn_log(double v) { return log(v); }
__device__ __forceinline__ float pnn_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double pnn_tanh(double v) { return tanh(v); }
__device__ __forceinline__ float pnn_expm1(float v) { return expm1f(v); }
__device__ __forceinline__ double pnn_expm1(double v) { return expm1(v); }
__device__ __forceinline__ float pnn_erf(float v) { return erff(v); }
__device__ __forceinline__ double pnn_erf(double v) { return erf(v); }
__device__ __forceinline__ float pnn_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double pnn_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float pnn_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double pnn_rsqrt(double v) { return rsqrt(v); }
__device__ __forceinline__ bool pnn_isnan(float v) { return v != v; }
__device__ __forceinline__ bool pnn_isnan(double v) { return v != v; }

template <class A> __device__ __forceinline__ A pnn_inf() { return static_cast<A>(__int_as_float(0x7f800000)); }

template <class A> __device__ __forceinline__ A sigmoid(A z) {
    // Never exponentiates a large positive value (no overflow to inf / inf).
    if (z >= A(0)) return A(1) / (A(1) + pnn_exp(-z));
    A e = pnn_exp(z);
    return e / (A(1) + e);
}

// --------------------------------------------------------------------------- activations
//
// Runtime codes, as portable_nn/kernel_codes.py defines them (a test checks these against it);
// leaky_relu comes with `slope`, elu with its alpha in `slope`, gelu is the exact (erf) form.

#define PNN_ACT_IDENTITY 0
#define PNN_ACT_RELU 1
#define PNN_ACT_SIGMOID 2
#define PNN_ACT_TANH 3
#define PNN_ACT_GELU 4
#define PNN_ACT_GELU_TANH 5
#define PNN_ACT_SILU 6
#define PNN_ACT_LEAKY_RELU 7
#define PNN_ACT_HARDSWISH 8
#define PNN_ACT_HARDSIGMOID 9
#define PNN_ACT_RELU6 10
#define PNN_ACT_MISH 11
#define PNN_ACT_ELU 12

#define PNN_INV_SQRT2 0.70710678118654752440
#define PNN_INV_SQRT_2PI 0.39894228040143267794
#define PNN_SQRT_2_OVER_PI 0.79788456080286535588
#define PNN_GELU_C 0.044715
// mish: from z = 40 on, tanh(softplus(z)) = 1 and z (1 - tanh^2) < 1e-32 (portable_nn/reference/activations.py)
#define PNN_MISH_CLIP 40.0

// min(max(v, 0), 6), NaN kept (PyTorch's hardtanh(0, 6)).
template <class A> __device__ __forceinline__ A pnn_clip06(A v) {
    v = v < A(0) ? A(0) : v;
    return v > A(6) ? A(6) : v;
}

// (tanh(softplus(z)), 1 - tanh^2(softplus(z))) from n = e^z: with u = n (n + 2), u / (u + 2) and
// 4 (u + 1) / (u + 2)^2, no difference formed; the second is 0 from the clip on.
template <class A> __device__ __forceinline__ void pnn_tanh_softplus(A z, A& t, A& dt) {
    const bool below = z < A(PNN_MISH_CLIP);
    const A n = pnn_exp(below ? z : A(PNN_MISH_CLIP));
    const A u = n * (n + A(2));
    const A d = u + A(2);
    t = u / d;
    dt = below ? A(4) * (u + A(1)) / (d * d) : A(0);
}

template <class A> __device__ __forceinline__ A act_fwd(A z, int code, A slope) {
    switch (code) {
        case PNN_ACT_IDENTITY: return z;
        case PNN_ACT_RELU: return z > A(0) ? z : A(0) * z;  // 0 * NaN keeps NaN, like PyTorch
        case PNN_ACT_SIGMOID: return sigmoid(z);
        case PNN_ACT_TANH: return pnn_tanh(z);
        case PNN_ACT_GELU: return A(0.5) * z * (A(1) + pnn_erf(z * A(PNN_INV_SQRT2)));
        case PNN_ACT_GELU_TANH: return A(0.5) * z * (A(1) + pnn_tanh(A(PNN_SQRT_2_OVER_PI) * (z + A(PNN_GELU_C) * z * z * z)));
        case PNN_ACT_SILU: return z * sigmoid(z);
        case PNN_ACT_HARDSWISH: return z * pnn_clip06(z + A(3)) / A(6);
        case PNN_ACT_HARDSIGMOID: return pnn_clip06(z + A(3)) / A(6);
        case PNN_ACT_RELU6: return pnn_clip06(z);
        case PNN_ACT_MISH: { A t, dt; pnn_tanh_softplus(z, t, dt); return z * t; }
        case PNN_ACT_ELU: return z <= A(0) ? slope * pnn_expm1(z) : z;
        default: return z > A(0) ? z : slope * z;  // PNN_ACT_LEAKY_RELU
    }
}

// act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope, the others as
// portable_nn.ACTIVATIONS lists them; NaN passes the gradient where PyTorch's backward does).
template <class A> __device__ __forceinline__ A act_grad(A z, int code, A slope) {
    switch (code) {
        case PNN_ACT_IDENTITY: return A(1);
        case PNN_ACT_RELU: return z > A(0) ? A(1) : A(0);
        case PNN_ACT_SIGMOID: { A s = sigmoid(z); return s * (A(1) - s); }
        case PNN_ACT_TANH: { A t = pnn_tanh(z); return A(1) - t * t; }
        case PNN_ACT_GELU:
            return A(0.5) * (A(1) + pnn_erf(z * A(PNN_INV_SQRT2))) +
                   z * A(PNN_INV_SQRT_2PI) * pnn_exp(A(-0.5) * z * z);
        case PNN_ACT_GELU_TANH: {
            A t = pnn_tanh(A(PNN_SQRT_2_OVER_PI) * (z + A(PNN_GELU_C) * z * z * z));
            return A(0.5) * (A(1) + t) +
                   A(0.5) * z * (A(1) - t * t) * A(PNN_SQRT_2_OVER_PI) * (A(1) + A(3.0 * PNN_GELU_C) * z * z);
        }
        case PNN_ACT_SILU: { A s = sigmoid(z); return s * (A(1) + z * (A(1) - s)); }
        case PNN_ACT_HARDSWISH: return z <= A(-3) ? A(0) : (z < A(3) ? z / A(3) + A(0.5) : A(1));
        case PNN_ACT_HARDSIGMOID: return (z > A(-3) && z < A(3)) ? A(1.0 / 6.0) : A(0);
        case PNN_ACT_RELU6: return (z <= A(0) || z >= A(6)) ? A(0) : A(1);
        case PNN_ACT_MISH: { A t, dt; pnn_tanh_softplus(z, t, dt); return t + z * sigmoid(z) * dt; }
        case PNN_ACT_ELU: return z <= A(0) ? slope * pnn_exp(z) : A(1);
        default: return z > A(0) ? A(1) : slope;  // PNN_ACT_LEAKY_RELU
    }
}

// --------------------------------------------------------------------------- block reductions
//
// The order of additions depends only on the block's shape, so results are bitwise reproducible
// (no atomics).  Launchers give `sh` at least 2 * blockDim.x values of A (block_reduce_pair needs
// 64) and check that blockDim.x is a power of two >= 32.

// Sum of (a, b) over threadIdx.y of a 2-D block (blockDim.y a power of two), per threadIdx.x.
// Only threads with threadIdx.y == 0 get the totals.  `sh` holds 2 * blockDim.x * blockDim.y values.
template <class A> __device__ void column_sum2(A& a, A& b, A* sh) {
    const int bx = blockDim.x, by = blockDim.y;
    const int tx = threadIdx.x, ty = threadIdx.y;
    A* sa = sh;
    A* sb = sh + bx * by;
    sa[ty * bx + tx] = a;
    sb[ty * bx + tx] = b;
    __syncthreads();
    for (int s = by >> 1; s > 0; s >>= 1) {
        if (ty < s) {
            sa[ty * bx + tx] += sa[(ty + s) * bx + tx];
            sb[ty * bx + tx] += sb[(ty + s) * bx + tx];
        }
        __syncthreads();
    }
    a = sa[tx];
    b = sb[tx];
}

// Reduce the pair (a, b) over the block with merge(a, b, a2, b2) (associative; (ia, ib) its
// identity): warp shuffles, then one warp over the warps' pairs, in a fixed order (reproducible);
// every thread gets the result.  blockDim.x a multiple of 32, at most 1024; `sh` holds 64 values.
// Two barriers instead of block_sum2's log2(blockDim) (the row kernels reduce once per row).
template <class A, class Merge> __device__ void block_reduce_pair(A& a, A& b, A* sh, A ia, A ib, Merge merge) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int round = 0; round < 2; ++round) {
        for (int off = 16; off > 0; off >>= 1) {
            const A a2 = __shfl_down_sync(0xffffffffu, a, off);
            const A b2 = __shfl_down_sync(0xffffffffu, b, off);
            if (lane + off < 32) merge(a, b, a2, b2);
        }
        if (round == 0) {
            if (lane == 0) {
                sh[wid] = a;
                sh[32 + wid] = b;
            }
            __syncthreads();
            if (wid != 0) break;
            a = lane < warps ? sh[lane] : ia;
            b = lane < warps ? sh[32 + lane] : ib;
        } else if (lane == 0) {
            sh[0] = a;
            sh[32] = b;
        }
    }
    __syncthreads();
    a = sh[0];
    b = sh[32];
    __syncthreads();  // sh may be reused right away
}

struct pnn_sum_pair {
    template <class A> __device__ __forceinline__ void operator()(A& a, A& b, A a2, A b2) const {
        a += a2;
        b += b2;
    }
};

// Σ a and Σ b over the block (block_reduce_pair's shapes and cost).
template <class A> __device__ __forceinline__ void block_sum2(A& a, A& b, A* sh) {
    block_reduce_pair(a, b, sh, A(0), A(0), pnn_sum_pair());
}

template <class A> __device__ __forceinline__ A* shared_as() {
    extern __shared__ __align__(16) unsigned char pnn_shared[];
    return reinterpret_cast<A*>(pnn_shared);
}

// Max over a block (same shape rules as block_sum2); NaN wins, like PyTorch's max.
template <class A> __device__ A block_max(A v, A* sh) {
    const int t = threadIdx.x;
    const int n = blockDim.x;
    sh[t] = v;
    __syncthreads();
    for (int s = n >> 1; s > 0; s >>= 1) {
        if (t < s) {
            A o = sh[t + s];
            A m = sh[t];
            sh[t] = (pnn_isnan(m) || m >= o) ? m : o;
        }
        __syncthreads();
    }
    A r = sh[0];
    __syncthreads();
    return r;
}
