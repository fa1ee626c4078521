// Recurrent cells (rnn, lstm, gru): the fused elementwise part of one step, forward and backward.
//
// The launcher computes the two projections with cuBLAS, gi = x Wihᵀ + b_ih and gh = h Whhᵀ + b_hh
// (N, G·H), and one kernel does everything elementwise per (sample, unit).  Gate orders follow
// PyTorch: lstm (i, f, g, o), gru (r, z, n).  `gates` (N, 4·H) keeps what the backward needs:
// rnn the pre-activation, lstm the four activations, gru r, z, n and the hidden projection of the
// n gate (reset_after) or r·h's input (reset_after = 0, where the launcher runs `stage` 1 for r and
// z, a GEMM on r·h, then `stage` 2 for n and h').

#include "common.cuh"

#define KIND_RNN 0
#define KIND_LSTM 1
#define KIND_GRU 2

template <class T>
__global__ void cell_fwd(const T* gi, const T* gh, const T* h, const T* c, T* h_out, T* c_out, T* gates, T* rh,
                         long long N, long long H, int kind, int stage, int code, double slope) {
    typedef typename acc_of<T>::type A;
    const long long total = N * H;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long n = e / H, u = e % H;
        if (kind == KIND_RNN) {
            const A pre = static_cast<A>(to_acc(gi[e])) + static_cast<A>(to_acc(gh[e]));
            gates[n * 4 * H + u] = from_acc<T>(pre);
            h_out[e] = from_acc<T>(act_fwd(pre, code, A(slope)));
        } else if (kind == KIND_LSTM) {
            const long long b = n * 4 * H + u;
            A a[4];
            for (int k = 0; k < 4; ++k) a[k] = static_cast<A>(to_acc(gi[b + k * H])) + static_cast<A>(to_acc(gh[b + k * H]));
            const A ig = sigmoid(a[0]), fg = sigmoid(a[1]), gg = pnn_tanh(a[2]), og = sigmoid(a[3]);
            const A cn = fg * static_cast<A>(to_acc(c[e])) + ig * gg;
            gates[b] = from_acc<T>(ig);
            gates[b + H] = from_acc<T>(fg);
            gates[b + 2 * H] = from_acc<T>(gg);
            gates[b + 3 * H] = from_acc<T>(og);
            c_out[e] = from_acc<T>(cn);
            h_out[e] = from_acc<T>(og * pnn_tanh(cn));
        } else {
            const long long b3 = n * 3 * H + u, b4 = n * 4 * H + u;
            if (stage == 1) {  // reset_after = 0, before the GEMM on r·h: r, z and r·h
                const A r = sigmoid(static_cast<A>(to_acc(gi[b3])) + static_cast<A>(to_acc(gh[b3])));
                const A z = sigmoid(static_cast<A>(to_acc(gi[b3 + H])) + static_cast<A>(to_acc(gh[b3 + H])));
                gates[b4] = from_acc<T>(r);
                gates[b4 + H] = from_acc<T>(z);
                rh[e] = from_acc<T>(r * static_cast<A>(to_acc(h[e])));
                continue;
            }
            A r, z, hn;
            if (stage == 2) {  // gh's n part is W_hn (r·h) + b_hn
                r = static_cast<A>(to_acc(gates[b4]));
                z = static_cast<A>(to_acc(gates[b4 + H]));
                hn = static_cast<A>(to_acc(gh[b3 + 2 * H]));
            } else {
                r = sigmoid(static_cast<A>(to_acc(gi[b3])) + static_cast<A>(to_acc(gh[b3])));
                z = sigmoid(static_cast<A>(to_acc(gi[b3 + H])) + static_cast<A>(to_acc(gh[b3 + H])));
                hn = static_cast<A>(to_acc(gh[b3 + 2 * H]));
                gates[b4] = from_acc<T>(r);
                gates[b4 + H] = from_acc<T>(z);
            }
            const A nn = pnn_tanh(static_cast<A>(to_acc(gi[b3 + 2 * H])) + (stage == 2 ? hn : r * hn));
            gates[b4 + 2 * H] = from_acc<T>(nn);
            gates[b4 + 3 * H] = from_acc<T>(hn);
            h_out[e] = from_acc<T>((A(1) - z) * nn + z * static_cast<A>(to_acc(h[e])));
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
        const A dhv = dh_out ? static_cast<A>(to_acc(dh_out[e])) : A(0);
        if (kind == KIND_RNN) {
            const A pre = static_cast<A>(to_acc(gates[n * 4 * H + u]));
            const A d = dhv * act_grad(pre, code, A(slope));
            dgi[e] = from_acc<T>(d);
            dgh[e] = from_acc<T>(d);
            dh_dir[e] = from_acc<T>(A(0));
        } else if (kind == KIND_LSTM) {
            const long long b = n * 4 * H + u;
            const A ig = static_cast<A>(to_acc(gates[b])), fg = static_cast<A>(to_acc(gates[b + H]));
            const A gg = static_cast<A>(to_acc(gates[b + 2 * H])), og = static_cast<A>(to_acc(gates[b + 3 * H]));
            const A tc = pnn_tanh(static_cast<A>(to_acc(c_new[e])));
            const A dct = (dc_out ? static_cast<A>(to_acc(dc_out[e])) : A(0)) + dhv * og * (A(1) - tc * tc);
            const A d[4] = {dct * gg * ig * (A(1) - ig), dct * static_cast<A>(to_acc(c[e])) * fg * (A(1) - fg),
                            dct * ig * (A(1) - gg * gg), dhv * tc * og * (A(1) - og)};
            for (int k = 0; k < 4; ++k) {
                dgi[b + k * H] = from_acc<T>(d[k]);
                dgh[b + k * H] = from_acc<T>(d[k]);
            }
            dc[e] = from_acc<T>(dct * fg);
            dh_dir[e] = from_acc<T>(A(0));
        } else {
            const long long b3 = n * 3 * H + u, b4 = n * 4 * H + u;
            const A r = static_cast<A>(to_acc(gates[b4])), z = static_cast<A>(to_acc(gates[b4 + H]));
            const A nn = static_cast<A>(to_acc(gates[b4 + 2 * H])), hn = static_cast<A>(to_acc(gates[b4 + 3 * H]));
            const A hv = static_cast<A>(to_acc(h[e]));
            if (stage == 2) {
                const A d_rh = static_cast<A>(to_acc(drh[e]));
                const A dr = d_rh * hv * r * (A(1) - r);
                dgi[b3] = from_acc<T>(dr);
                dgh[b3] = from_acc<T>(dr);
                dh_dir[e] = from_acc<T>(static_cast<A>(to_acc(dh_dir[e])) + d_rh * r);
                continue;
            }
            const A dan = dhv * (A(1) - z) * (A(1) - nn * nn);
            const A daz = dhv * (hv - nn) * z * (A(1) - z);
            dgi[b3 + H] = from_acc<T>(daz);
            dgh[b3 + H] = from_acc<T>(daz);
            dgi[b3 + 2 * H] = from_acc<T>(dan);
            dh_dir[e] = from_acc<T>(dhv * z);
            if (stage == 1) {
                dgh[b3 + 2 * H] = from_acc<T>(dan);
            } else {
                const A dar = dan * hn * r * (A(1) - r);
                dgi[b3] = from_acc<T>(dar);
                dgh[b3] = from_acc<T>(dar);
                dgh[b3 + 2 * H] = from_acc<T>(dan * r);
            }
        }
    }
}
