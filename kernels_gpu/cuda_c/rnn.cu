// Recurrent cells and sequences (rnn, lstm, gru): the fused elementwise part of one step,
// forward and backward.
//
// Gate orders follow PyTorch: lstm (i, f, g, o), gru (r, z, n).  The per-unit math (gate
// nonlinearities, state update and their derivatives) lives in the device functions below and is
// shared by the cell kernels (cell_fwd / cell_bwd, one step of rnn_cell / lstm_cell / gru_cell)
// and the sequence kernels (seq_fwd / seq_bwd, one time step of one layer direction of rnn / lstm
// / gru, launched once per step between cuBLAS products).
//
// Cells: the launcher computes the two projections with cuBLAS, gi = x Wihᵀ + b_ih and
// gh = h Whhᵀ + b_hh (N, G·H), and one kernel does everything elementwise per (sample, unit).
// `gates` (N, 4·H) keeps what the backward needs: rnn the pre-activation, lstm the four
// activations, gru r, z, n and the hidden projection of the n gate (reset_after) or r·h's input
// (reset_after = 0, where the launcher runs `stage` 1 for r and z, a GEMM on r·h, then `stage` 2
// for n and h').

#include "common.cuh"

// The cell families: portable_nn/kernel_codes.py's CELL_FAMILIES (a test checks the numbers).
#define KIND_RNN 0
#define KIND_LSTM 1
#define KIND_GRU 2

// --------------------------------------------------------------------------- per-unit math

template <class A> struct LstmUnit { A i, f, g, o, c, h; };

// One LSTM unit from its four gate pre-activations and the entering cell state c.
template <class A> __device__ __forceinline__ LstmUnit<A> lstm_unit(A ai, A af, A ag, A ao, A c) {
    LstmUnit<A> s;
    s.i = sigmoid(ai);
    s.f = sigmoid(af);
    s.g = pnn_tanh(ag);
    s.o = sigmoid(ao);
    s.c = s.f * c + s.i * s.g;
    s.h = s.o * pnn_tanh(s.c);
    return s;
}

// The gradients d[0..3] of an LSTM unit's gate pre-activations, given the gradients dh, dc of the
// states it produced; returns the gradient of the entering cell state.
template <class A>
__device__ __forceinline__ A lstm_unit_grad(A i, A f, A g, A o, A c_prev, A c_new, A dh, A dc, A* d) {
    const A tc = pnn_tanh(c_new);
    const A dct = dc + dh * o * (A(1) - tc * tc);
    d[0] = dct * g * i * (A(1) - i);
    d[1] = dct * c_prev * f * (A(1) - f);
    d[2] = dct * i * (A(1) - g * g);
    d[3] = dh * tc * o * (A(1) - o);
    return dct * f;
}

// The GRU state update h' = (1 − z) n + z h.
template <class A> __device__ __forceinline__ A gru_blend(A n, A z, A h) { return (A(1) - z) * n + z * h; }

// Gradients of the z and n pre-activations of a GRU unit from dh' (the r path depends on the form).
template <class A> __device__ __forceinline__ void gru_unit_grad(A z, A n, A h_prev, A dh, A& daz, A& dan) {
    dan = dh * (A(1) - z) * (A(1) - n * n);
    daz = dh * (h_prev - n) * z * (A(1) - z);
}

// σ'(a) from σ(a).
template <class A> __device__ __forceinline__ A sigmoid_slope(A s) { return s * (A(1) - s); }

// A bias entry, or 0 for an absent (null) bias.
template <class T> __device__ __forceinline__ typename acc_of<T>::type bias_at(const T* b, long long j) {
    typedef typename acc_of<T>::type A;
    return b ? static_cast<A>(to_acc(b[j])) : A(0);
}

template <class T> __device__ __forceinline__ typename acc_of<T>::type ld(const T* p, long long j) {
    return static_cast<typename acc_of<T>::type>(to_acc(p[j]));
}

// --------------------------------------------------------------------------- cells

template <class T>
__global__ void cell_fwd(const T* gi, const T* gh, const T* h, const T* c, T* h_out, T* c_out, T* gates, T* rh,
                         long long N, long long H, int kind, int stage, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * H;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long n = e / H, u = e % H;
        if (kind == KIND_RNN) {
            const A pre = ld(gi, e) + ld(gh, e);
            gates[n * 4 * H + u] = from_acc<T>(pre);
            h_out[e] = from_acc<T>(act_fwd(pre, code, A(slope)));
        } else if (kind == KIND_LSTM) {
            const long long b = n * 4 * H + u;
            A a[4];
            for (int k = 0; k < 4; ++k) a[k] = ld(gi, b + k * H) + ld(gh, b + k * H);
            const LstmUnit<A> s = lstm_unit(a[0], a[1], a[2], a[3], ld(c, e));
            gates[b] = from_acc<T>(s.i);
            gates[b + H] = from_acc<T>(s.f);
            gates[b + 2 * H] = from_acc<T>(s.g);
            gates[b + 3 * H] = from_acc<T>(s.o);
            c_out[e] = from_acc<T>(s.c);
            h_out[e] = from_acc<T>(s.h);
        } else {
            const long long b3 = n * 3 * H + u, b4 = n * 4 * H + u;
            if (stage == 1) {  // reset_after = 0, before the GEMM on r·h: r, z and r·h
                const A r = sigmoid(ld(gi, b3) + ld(gh, b3));
                const A z = sigmoid(ld(gi, b3 + H) + ld(gh, b3 + H));
                gates[b4] = from_acc<T>(r);
                gates[b4 + H] = from_acc<T>(z);
                rh[e] = from_acc<T>(r * ld(h, e));
                continue;
            }
            A r, z, hn;
            if (stage == 2) {  // gh's n part is W_hn (r·h) + b_hn
                r = ld(gates, b4);
                z = ld(gates, b4 + H);
                hn = ld(gh, b3 + 2 * H);
            } else {
                r = sigmoid(ld(gi, b3) + ld(gh, b3));
                z = sigmoid(ld(gi, b3 + H) + ld(gh, b3 + H));
                hn = ld(gh, b3 + 2 * H);
                gates[b4] = from_acc<T>(r);
                gates[b4 + H] = from_acc<T>(z);
            }
            const A nn = pnn_tanh(ld(gi, b3 + 2 * H) + (stage == 2 ? hn : r * hn));
            gates[b4 + 2 * H] = from_acc<T>(nn);
            gates[b4 + 3 * H] = from_acc<T>(hn);
            h_out[e] = from_acc<T>(gru_blend(nn, z, ld(h, e)));
        }
    }
}

// Gradients of the gate pre-activations: dgi (N, G·H) and dgh (N, G·H), the direct part of dh
// (dh_dir) and, for lstm, dc.  dh_out / dc_out may be null (zero cotangents).  gru reset_after = 0
// runs stage 1 (dgi and dgh for z and n; dgh's n part is the gradient of W_hn (r·h) + b_hn), a GEMM
// d(r·h) = dgh_n W_hn on the host, then stage 2 (r's gradients and r·d(r·h) into dh_dir).
template <class T>
__global__ void cell_bwd(const T* gates, const T* h, const T* c, const T* c_new, const T* dh_out, const T* dc_out,
                         const T* drh, T* dgi, T* dgh, T* dh_dir, T* dc, long long N, long long H, int kind, int stage,
                         int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * H;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long n = e / H, u = e % H;
        const A dhv = dh_out ? ld(dh_out, e) : A(0);
        if (kind == KIND_RNN) {
            const A d = dhv * act_grad(ld(gates, n * 4 * H + u), code, A(slope));
            dgi[e] = from_acc<T>(d);
            dgh[e] = from_acc<T>(d);
            dh_dir[e] = from_acc<T>(A(0));
        } else if (kind == KIND_LSTM) {
            const long long b = n * 4 * H + u;
            A d[4];
            const A dcp = lstm_unit_grad(ld(gates, b), ld(gates, b + H), ld(gates, b + 2 * H), ld(gates, b + 3 * H),
                                         ld(c, e), ld(c_new, e), dhv, dc_out ? ld(dc_out, e) : A(0), d);
            for (int k = 0; k < 4; ++k) {
                dgi[b + k * H] = from_acc<T>(d[k]);
                dgh[b + k * H] = from_acc<T>(d[k]);
            }
            dc[e] = from_acc<T>(dcp);
            dh_dir[e] = from_acc<T>(A(0));
        } else {
            const long long b3 = n * 3 * H + u, b4 = n * 4 * H + u;
            const A r = ld(gates, b4), z = ld(gates, b4 + H), nn = ld(gates, b4 + 2 * H), hn = ld(gates, b4 + 3 * H);
            const A hv = ld(h, e);
            if (stage == 2) {
                const A d_rh = ld(drh, e);
                const A dr = d_rh * hv * sigmoid_slope(r);
                dgi[b3] = from_acc<T>(dr);
                dgh[b3] = from_acc<T>(dr);
                dh_dir[e] = from_acc<T>(ld(dh_dir, e) + d_rh * r);
                continue;
            }
            A daz, dan;
            gru_unit_grad(z, nn, hv, dhv, daz, dan);
            dgi[b3 + H] = from_acc<T>(daz);
            dgh[b3 + H] = from_acc<T>(daz);
            dgi[b3 + 2 * H] = from_acc<T>(dan);
            dh_dir[e] = from_acc<T>(dhv * z);
            if (stage == 1) {
                dgh[b3 + 2 * H] = from_acc<T>(dan);
            } else {
                const A dar = dan * hn * sigmoid_slope(r);
                dgi[b3] = from_acc<T>(dar);
                dgh[b3] = from_acc<T>(dar);
                dgh[b3 + 2 * H] = from_acc<T>(dan * r);
            }
        }
    }
}

// --------------------------------------------------------------------------- sequences
//
// One time step t of one layer direction.  Layouts (rows n of the batch, units u):
//   gi      GI[t] (N, gi_stride): x_t W_ihᵀ of every direction of the layer (one GEMM for all T
//           steps); this direction's gates start at column gi_col.  Biases are added here.
//   gh      (N, gh_stride) = h_prev W_hhᵀ (gh_stride = G·H), or, for the GRU with reset_after = 0,
//           h_prev W_hh,rzᵀ (gh_stride = 2·H) with ghn (N, H) = (r·h_prev) W_hnᵀ for stage 2.
//   h_prev, h_next, c_prev, c_next (N, H): the states entering and leaving the step.
//   gates   (N, GW·H) saved for the backward: rnn the pre-activation (GW = 1); lstm i, f, g, o;
//           gru r, z, n and (reset_after) h W_hnᵀ + b_hn (GW = 4).
//   rh      (N, H) r·h_prev (GRU reset_after = 0: the second GEMM's input, kept for dW_hn).
//   y       Y[t] (N, y_stride): the layer's outputs, this direction's at column y_col.
//   lengths (N,) int64 or null: step t of row n is active when t < lengths[n].  An inactive step
//           carries the states over and writes a zero output.
// GRU reset_after = 0 runs stage 1 (r, z, r·h), the host GEMM for ghn, then stage 2 (n, h').
template <class T>
__global__ void seq_fwd(const T* gi, const T* gh, const T* ghn, const T* b_ih, const T* b_hh, const T* h_prev,
                        const T* c_prev, T* h_next, T* c_next, T* gates, T* rh, T* y, const long long* lengths,
                        long long t, long long N, long long H, long long gi_stride, long long gi_col,
                        long long gh_stride, long long y_stride, long long y_col, int kind, int stage, int code,
                        double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * H;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long n = e / H, u = e % H;
        const bool active = !lengths || t < lengths[n];
        const long long g0 = n * gi_stride + gi_col + u;  // gate 0 of unit u in GI[t]
        const long long h0 = n * gh_stride + u;           // gate 0 of unit u in gh
        const A hp = ld(h_prev, e);
        A hnew;
        if (kind == KIND_RNN) {
            const A pre = ld(gi, g0) + ld(gh, h0) + bias_at(b_ih, u) + bias_at(b_hh, u);
            gates[e] = from_acc<T>(pre);
            hnew = act_fwd(pre, code, A(slope));
        } else if (kind == KIND_LSTM) {
            A a[4];
            for (int k = 0; k < 4; ++k)
                a[k] = ld(gi, g0 + k * H) + ld(gh, h0 + k * H) + bias_at(b_ih, k * H + u) + bias_at(b_hh, k * H + u);
            const A cp = ld(c_prev, e);
            const LstmUnit<A> s = lstm_unit(a[0], a[1], a[2], a[3], cp);
            const long long b = n * 4 * H + u;
            gates[b] = from_acc<T>(s.i);
            gates[b + H] = from_acc<T>(s.f);
            gates[b + 2 * H] = from_acc<T>(s.g);
            gates[b + 3 * H] = from_acc<T>(s.o);
            c_next[e] = from_acc<T>(active ? s.c : cp);
            hnew = s.h;
        } else {
            const long long b = n * 4 * H + u;
            A r, z, hn, nn;
            if (stage == 2) {
                r = ld(gates, b);
                z = ld(gates, b + H);
                hn = ld(ghn, e) + bias_at(b_hh, 2 * H + u);
                nn = pnn_tanh(ld(gi, g0 + 2 * H) + bias_at(b_ih, 2 * H + u) + hn);
            } else {
                r = sigmoid(ld(gi, g0) + ld(gh, h0) + bias_at(b_ih, u) + bias_at(b_hh, u));
                z = sigmoid(ld(gi, g0 + H) + ld(gh, h0 + H) + bias_at(b_ih, H + u) + bias_at(b_hh, H + u));
                gates[b] = from_acc<T>(r);
                gates[b + H] = from_acc<T>(z);
                if (stage == 1) {
                    rh[e] = from_acc<T>(r * hp);
                    continue;
                }
                hn = ld(gh, h0 + 2 * H) + bias_at(b_hh, 2 * H + u);
                nn = pnn_tanh(ld(gi, g0 + 2 * H) + bias_at(b_ih, 2 * H + u) + r * hn);
            }
            gates[b + 2 * H] = from_acc<T>(nn);
            gates[b + 3 * H] = from_acc<T>(hn);
            hnew = gru_blend(nn, z, hp);
        }
        h_next[e] = from_acc<T>(active ? hnew : hp);
        y[n * y_stride + y_col + u] = from_acc<T>(active ? hnew : A(0));
    }
}

// Backward of one time step (steps run in the reverse of the forward's order).  The gradient of
// the state leaving the step arrives in two parts, dh_gemm (the previous backward step's GEMM
// dG W_hh, null for the first) and dh_dir (its direct part); the output's gradient DY[t] (N,
// y_stride, column y_col; dy may be null) joins it.  The kernel writes the gate pre-activation
// gradients, input side into DGI[t] (N, gi_stride, column gi_col) and hidden side into dgh (N,
// gh_stride; null when it equals the input side: rnn and lstm with one direction), and replaces
// dh_dir (and dc, in place) with the direct parts for the entering states; the host GEMM then
// writes dh_gemm = dgh W_hh.  An inactive step has zero gate gradients and passes the state
// gradients through.  GRU reset_after = 0: stage 1 (z, n; dghn (N, H) = the gradient of
// (r·h) W_hnᵀ + b_hn), the host GEMM drh = dghn W_hn, stage 2 (r, and r·drh into dh_dir).
template <class T>
__global__ void seq_bwd(const T* gates, const T* h_prev, const T* c_prev, const T* c_new, const T* dy,
                        const T* dh_gemm, T* dh_dir, T* dc, const T* drh, T* dgi, T* dgh, T* dghn,
                        const long long* lengths, long long t, long long N, long long H, long long gi_stride,
                        long long gi_col, long long gh_stride, long long y_stride, long long y_col, int kind,
                        int stage, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * H;
    const int G = kind == KIND_RNN ? 1 : (kind == KIND_LSTM ? 4 : 3);
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long n = e / H, u = e % H;
        const bool active = !lengths || t < lengths[n];
        const long long g0 = n * gi_stride + gi_col + u, h0 = n * gh_stride + u, b = n * 4 * H + u;
        if (stage == 2) {  // GRU reset_after = 0, after drh = dghn W_hn
            if (active) {
                const A r = ld(gates, b);
                const A d_rh = ld(drh, e);
                const A dr = d_rh * ld(h_prev, e) * sigmoid_slope(r);
                dgi[g0] = from_acc<T>(dr);
                dgh[h0] = from_acc<T>(dr);
                dh_dir[e] = from_acc<T>(ld(dh_dir, e) + d_rh * r);
            }
            continue;
        }
        A g = ld(dh_dir, e) + (dh_gemm ? ld(dh_gemm, e) : A(0));
        if (!active) {
            for (int k = 0; k < G; ++k) {
                dgi[g0 + k * H] = from_acc<T>(A(0));
                if (dgh && (stage == 0 || k < 2)) dgh[h0 + k * H] = from_acc<T>(A(0));
            }
            if (dghn) dghn[e] = from_acc<T>(A(0));
            dh_dir[e] = from_acc<T>(g);
            continue;
        }
        if (dy) g += ld(dy, n * y_stride + y_col + u);
        if (kind == KIND_RNN) {
            const A d = g * act_grad(ld(gates, e), code, A(slope));
            dgi[g0] = from_acc<T>(d);
            if (dgh) dgh[h0] = from_acc<T>(d);
            dh_dir[e] = from_acc<T>(A(0));
        } else if (kind == KIND_LSTM) {
            A d[4];
            const A dcp = lstm_unit_grad(ld(gates, b), ld(gates, b + H), ld(gates, b + 2 * H), ld(gates, b + 3 * H),
                                         ld(c_prev, e), ld(c_new, e), g, ld(dc, e), d);
            for (int k = 0; k < 4; ++k) {
                dgi[g0 + k * H] = from_acc<T>(d[k]);
                if (dgh) dgh[h0 + k * H] = from_acc<T>(d[k]);
            }
            dc[e] = from_acc<T>(dcp);
            dh_dir[e] = from_acc<T>(A(0));
        } else {
            const A r = ld(gates, b), z = ld(gates, b + H), nn = ld(gates, b + 2 * H);
            A daz, dan;
            gru_unit_grad(z, nn, ld(h_prev, e), g, daz, dan);
            dgi[g0 + H] = from_acc<T>(daz);
            dgh[h0 + H] = from_acc<T>(daz);
            dgi[g0 + 2 * H] = from_acc<T>(dan);
            dh_dir[e] = from_acc<T>(g * z);
            if (stage == 1) {
                dghn[e] = from_acc<T>(dan);
            } else {
                const A dar = dan * ld(gates, b + 3 * H) * sigmoid_slope(r);
                dgi[g0] = from_acc<T>(dar);
                dgh[h0] = from_acc<T>(dar);
                dgh[h0 + 2 * H] = from_acc<T>(dan * r);
            }
        }
    }
}
