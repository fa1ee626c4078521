// A CPU emulator of the CUDA subset the kernels use, for testing them without a GPU.
//
// The kernel sources compile as plain C++ with this header in front (PNN_EMULATE defined): every
// block runs its threads as cooperative fibers (ucontext) on one OS thread.  __syncthreads()
// parks a fiber until every live thread of the block has reached a barrier; warp shuffles park
// it until every live thread of its warp has arrived, so divergent barriers or shuffles are
// reported as deadlocks instead of passing silently.  Dynamic shared memory is filled with 0xff
// bytes (NaN for floats) before each block, so reads of unwritten shared memory show up.
// Blocks run one after another in grid order.  Used only by the tests (_emulator.py).
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace pnn_emu {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    ucontext_t ctx;
    State state = RUNNABLE;
    dim3 tid;
    int linear = 0;
    std::vector<char> stack;
};

inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline Fiber* current = nullptr;
inline const std::function<void()>* body = nullptr;
inline dim3 block_idx, block_dim, grid_dim;
inline uint64_t warp_buffer[32][32];
inline const char* error = nullptr;

inline void park(State s) {
    current->state = s;
    swapcontext(&current->ctx, &scheduler);
}

inline void trampoline() {
    (*body)();
    current->state = DONE;
}

// Run one block of `threads` fibers to completion; returns false on a deadlock.
inline bool run_block(int threads) {
    const size_t stack_size = 64 * 1024;
    if ((int)fibers.size() < threads) fibers.resize(threads);
    for (int t = 0; t < threads; ++t) {
        Fiber& f = fibers[t];
        if (f.stack.size() < stack_size) f.stack.resize(stack_size);
        f.state = RUNNABLE;
        f.linear = t;
        f.tid.x = t % block_dim.x;
        f.tid.y = (t / block_dim.x) % block_dim.y;
        f.tid.z = t / (block_dim.x * block_dim.y);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &scheduler;
        makecontext(&f.ctx, trampoline, 0);
    }
    for (;;) {
        bool ran = false;
        for (int t = 0; t < threads; ++t) {
            if (fibers[t].state != RUNNABLE) continue;
            current = &fibers[t];
            swapcontext(&scheduler, &fibers[t].ctx);
            ran = true;
        }
        bool live = false, released = false;
        // A warp whose live threads all wait at a shuffle goes on.
        for (int w = 0; w * 32 < threads; ++w) {
            bool all = true, any = false;
            for (int t = w * 32; t < threads && t < (w + 1) * 32; ++t) {
                if (fibers[t].state == DONE) continue;
                any = true;
                if (fibers[t].state != AT_WARP) all = false;
            }
            if (any && all) {
                for (int t = w * 32; t < threads && t < (w + 1) * 32; ++t)
                    if (fibers[t].state == AT_WARP) fibers[t].state = RUNNABLE;
                released = true;
            }
        }
        bool all_barrier = true;
        for (int t = 0; t < threads; ++t) {
            if (fibers[t].state == DONE) continue;
            live = true;
            if (fibers[t].state != AT_BARRIER) all_barrier = false;
        }
        if (!live) return true;
        if (released) continue;
        if (all_barrier) {
            for (int t = 0; t < threads; ++t)
                if (fibers[t].state == AT_BARRIER) fibers[t].state = RUNNABLE;
            continue;
        }
        if (!ran) return false;
    }
}

}  // namespace pnn_emu

alignas(16) inline unsigned char pnn_shared[1 << 16];

#define threadIdx (pnn_emu::current->tid)
#define blockIdx (pnn_emu::block_idx)
#define blockDim (pnn_emu::block_dim)
#define gridDim (pnn_emu::grid_dim)

inline void __syncthreads() { pnn_emu::park(pnn_emu::AT_BARRIER); }

template <class V> inline V __shfl_down_sync(unsigned, V v, int offset) {
    static_assert(sizeof(V) <= 8, "shuffle of a value wider than 64 bits");
    const int lane = pnn_emu::current->linear % 32, warp = pnn_emu::current->linear / 32;
    std::memcpy(&pnn_emu::warp_buffer[warp][lane], &v, sizeof(V));
    pnn_emu::park(pnn_emu::AT_WARP);
    V r = v;
    if (lane + offset < 32) std::memcpy(&r, &pnn_emu::warp_buffer[warp][lane + offset], sizeof(V));
    pnn_emu::park(pnn_emu::AT_WARP);
    return r;
}

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }
inline int __float_as_int(float v) { int u; std::memcpy(&u, &v, 4); return u; }
// Threads are fibers on one OS thread and switch only at barriers: a plain update is atomic.
inline int atomicMax(int* address, int value) { const int old = *address; if (value > old) *address = value; return old; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// IEEE half <-> float, round to nearest even (what cvt.rn.f16.f32 does).
inline float pnn_emu_half_to_float(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    unsigned bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            float f = std::ldexp(static_cast<float>(man), -24);
            return sign ? -f : f;
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline unsigned short pnn_emu_float_to_half(float f) {
    const unsigned u = __float_as_uint(f);
    const unsigned short sign = (u >> 16) & 0x8000u;
    const float a = std::fabs(f);
    if (std::isnan(f)) return sign | 0x7e00u;
    if (a >= 65520.0f) return sign | 0x7c00u;
    if (a < std::ldexp(1.0f, -14)) {  // subnormal: a multiple of 2^-24, rounded to nearest even
        const float q = std::nearbyint(a * std::ldexp(1.0f, 24));
        return sign | static_cast<unsigned short>(q);
    }
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    float mant = std::nearbyint((m * 2.0f - 1.0f) * 1024.0f);
    int exp = e - 1 + 15;
    if (mant >= 1024.0f) {
        mant = 0.0f;
        exp += 1;
    }
    if (exp >= 31) return sign | 0x7c00u;
    return sign | static_cast<unsigned short>((exp << 10) | static_cast<unsigned>(mant));
}

inline unsigned short pnn_emu_float_to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    if (std::isnan(f)) return static_cast<unsigned short>((u >> 16) | 0x40u);
    return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

namespace pnn_emu {

// Run a kernel over the grid; throws on a deadlock (divergent barrier or shuffle).
inline void launch(dim3 grid, dim3 block, unsigned shared, const std::function<void()>& kernel) {
    if (shared > sizeof(pnn_shared)) throw std::runtime_error("dynamic shared memory larger than 64 KiB");
    const int threads = block.x * block.y * block.z;
    body = &kernel;
    grid_dim = grid;
    block_dim = block;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                block_idx.x = x;
                block_idx.y = y;
                block_idx.z = z;
                std::memset(pnn_shared, 0xff, sizeof(pnn_shared));
                if (!run_block(threads)) throw std::runtime_error("deadlock: divergent __syncthreads or shuffle");
            }
}

}  // namespace pnn_emu
