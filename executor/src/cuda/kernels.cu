// flatpipe's CUDA kernels: a Llama-style decoder over flat [T] tokens with cu_seqlens, fp32.
//
// Compiled at run time with NVRTC (executor/src/cuda/ops.rs), with -DHEAD_DIM=<d> for the
// attention tiles. The same file is compiled on the CPU by executor/tests/cuda_emulated.rs with
// emulate.h (one OS thread per CUDA thread, blocks one after another, __syncthreads as a barrier)
// and checked against the CPU backend's kernels, so its logic is tested on machines without a GPU.
// Rules that keep both compilers happy: no headers, no warp shuffles, no dynamic shared memory,
// every __shared__ array declared at the top of its kernel, block sizes that are powers of two.
//
// Conventions are the CPU backend's (executor/src/kernels.rs): every tensor row-major [T, X];
// RMSNorm eps 1e-5; rotary theta 500000 on the rotate-half layout with positions restarting per
// sequence; grouped-query attention (query head h reads key/value head h / (heads / kv_heads));
// softmax scale 1/sqrt(d); SwiGLU silu(gate) * up.

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif

typedef long long i64;

#define RMS_EPS 1e-5f
#define ROPE_THETA 500000.0f
#define NEG_BIG (-1.0e30f)

// Threads of the row kernels (one block per row).
#define NT_ROW 256
// Attention tiles: BQ query rows x BK keys, NT_ATT threads; accumulators [BQ, HEAD_DIM] live in
// registers, ACC per thread.
#define BQ 16
#define BK 16
#define NT_ATT 128
#define ACC ((BQ * HEAD_DIM + NT_ATT - 1) / NT_ATT)

// Sum of `v` over the block (blockDim.x a power of two, sh[blockDim.x]).
__device__ float block_sum(float v, float* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmaxf(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// ---------------------------------------------------------------------------------------------
// Elementwise

// y += x, n values.
extern "C" __global__ void add_inplace(float* y, const float* x, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] += x[i];
}

// act = silu(gate) * up, n values.
extern "C" __global__ void swiglu_fwd(const float* gate, const float* up, float* act, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = gate[i];
        float s = 1.0f / (1.0f + expf(-g));
        act[i] = g * s * up[i];
    }
}

// dgate = d * up * s (1 + g (1 - s)), dup = d * g * s with s = sigmoid(g).
extern "C" __global__ void swiglu_bwd(const float* d, const float* gate, const float* up,
                                      float* dgate, float* dup, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = gate[i];
        float s = 1.0f / (1.0f + expf(-g));
        dup[i] = d[i] * g * s;
        dgate[i] = d[i] * up[i] * s * (1.0f + g * (1.0f - s));
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x * rstd * g, rstd = 1 / sqrt(mean(x^2) + eps). One block per row.

extern "C" __global__ void rmsnorm_fwd(const float* x, const float* g, float* y, float* xhat,
                                       float* rstd, int T, int H) {
    __shared__ float sh[NT_ROW];
    int t = blockIdx.x;
    if (t >= T) return;
    const float* xr = x + (i64)t * H;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)H + RMS_EPS);
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float xh = xr[c] * r;
        xhat[(i64)t * H + c] = xh;
        y[(i64)t * H + c] = xh * g[c];
    }
    if (threadIdx.x == 0) rstd[t] = r;
}

// dx = rstd * (dy g - xhat * mean(dy g xhat)) (+ residual when non-null). One block per row.
extern "C" __global__ void rmsnorm_dx(const float* dy, const float* xhat, const float* rstd,
                                      const float* g, const float* residual, float* dx, int T,
                                      int H) {
    __shared__ float sh[NT_ROW];
    int t = blockIdx.x;
    if (t >= T) return;
    i64 o = (i64)t * H;
    float dot = 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) dot += dy[o + c] * g[c] * xhat[o + c];
    dot = block_sum(dot, sh) / (float)H;
    float r = rstd[t];
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float v = r * (dy[o + c] * g[c] - xhat[o + c] * dot);
        dx[o + c] = residual ? v + residual[o + c] : v;
    }
}

// dg[c] += sum_t dy[t, c] xhat[t, c]. Grid (ceil(H / blockDim.x), ceil(T / rows)); each block
// sums `rows` rows of its columns, then adds atomically.
extern "C" __global__ void rmsnorm_dg(float* dg, const float* dy, const float* xhat, int T, int H,
                                      int rows) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    int t0 = blockIdx.y * rows;
    int t1 = min(T, t0 + rows);
    float acc = 0.0f;
    for (int t = t0; t < t1; ++t) acc += dy[(i64)t * H + c] * xhat[(i64)t * H + c];
    atomicAdd(dg + c, acc);
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place on x [T, heads * d], rotate-half layout: (x_i, x_{i + d/2}) turned by
// pos * theta^(-2i/d); `inverse` turns back (the backward). pos[t]: position of token t in its
// sequence.
extern "C" __global__ void rope(float* x, const int* pos, int T, int heads, int d, int inverse) {
    int half = d / 2;
    i64 n = (i64)T * heads * half;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        int i = (int)(e % half);
        i64 th = e / half;
        int h = (int)(th % heads);
        int t = (int)(th / heads);
        float f = powf(ROPE_THETA, -2.0f * (float)i / (float)d);
        float ang = (float)pos[t] * f;
        float s = sinf(ang), c = cosf(ang);
        if (inverse) s = -s;
        i64 a = (i64)t * heads * d + (i64)h * d + i;
        float x1 = x[a], x2 = x[a + half];
        x[a] = x1 * c - x2 * s;
        x[a + half] = x1 * s + x2 * c;
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding

// y[t] = table[ids[t]]. One block per token.
extern "C" __global__ void embedding_fwd(const float* table, const unsigned* ids, float* y, int T,
                                         int H) {
    int t = blockIdx.x;
    if (t >= T) return;
    const float* row = table + (i64)ids[t] * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) y[(i64)t * H + c] = row[c];
}

// dtable[ids[t]] += dy[t]. One block per token; repeated ids add atomically.
extern "C" __global__ void embedding_bwd(float* dtable, const float* dy, const unsigned* ids, int T,
                                         int H) {
    int t = blockIdx.x;
    if (t >= T) return;
    float* row = dtable + (i64)ids[t] * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) atomicAdd(row + c, dy[(i64)t * H + c]);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy over logits [T, V]

// lse[t] = log sum_v exp(logits[t, v]); loss[t] = lse[t] - logits[t, labels[t]]. One block per row.
extern "C" __global__ void cross_entropy_fwd(const float* logits, const unsigned* labels,
                                             float* lse, float* loss, int T, int V) {
    __shared__ float sh[NT_ROW];
    int t = blockIdx.x;
    if (t >= T) return;
    const float* row = logits + (i64)t * V;
    float m = NEG_BIG;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, row[v]);
    m = block_max(m, sh);
    float s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) s += expf(row[v] - m);
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
        float l = m + logf(s);
        lse[t] = l;
        loss[t] = l - row[labels[t]];
    }
}

// out[0] = sum_t w_t loss_t, out[1] = sum_t loss_t, in double. One block of NT_ROW threads.
extern "C" __global__ void loss_sums(const float* loss, const float* weights, int T, double* out) {
    __shared__ double sw[NT_ROW];
    __shared__ double sp[NT_ROW];
    int tid = threadIdx.x;
    double w = 0.0, p = 0.0;
    for (int t = tid; t < T; t += blockDim.x) {
        w += (double)weights[t] * (double)loss[t];
        p += (double)loss[t];
    }
    sw[tid] = w;
    sp[tid] = p;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            sw[tid] += sw[tid + s];
            sp[tid] += sp[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0) {
        out[0] = sw[0];
        out[1] = sp[0];
    }
}

// dlogits[t, v] = w_t (exp(logits[t, v] - lse[t]) - [v == labels[t]]).
extern "C" __global__ void cross_entropy_bwd(const float* logits, const float* lse,
                                             const unsigned* labels, const float* weights,
                                             float* dlogits, int T, int V) {
    i64 n = (i64)T * V;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        int t = (int)(e / V);
        int v = (int)(e % V);
        float w = weights[t];
        float d = w * expf(logits[e] - lse[t]);
        if ((unsigned)v == labels[t]) d -= w;
        dlogits[e] = d;
    }
}

// ---------------------------------------------------------------------------------------------
// Varlen causal attention (FlashAttention's interface; a plain tiled kernel, not its speed).
// q [T, heads * d], k, v [T, kv_heads * d]; tiles[4 * i .. 4 * i + 4] = (first token, end token,
// first token of its sequence, end token of its sequence) of the i-th block of at most BQ (= BK)
// rows, never crossing a sequence.

// Loads keys and values [k0, k0 + kn) of key/value head g into shared tiles (zeros past kn).
__device__ void load_kv(float (*Ks)[HEAD_DIM], float (*Vs)[HEAD_DIM], const float* k,
                        const float* v, int k0, int kn, int g, int kv_heads) {
    const int D = HEAD_DIM;
    i64 ldk = (i64)kv_heads * D;
    for (int e = threadIdx.x; e < BK * D; e += NT_ATT) {
        int j = e / D, c = e % D;
        Ks[j][c] = j < kn ? k[(k0 + j) * ldk + g * D + c] : 0.0f;
        Vs[j][c] = j < kn ? v[(k0 + j) * ldk + g * D + c] : 0.0f;
    }
}

// o [T, heads * d] and lse [T, heads]. Grid (tiles, heads).
extern "C" __global__ void attn_fwd(const float* q, const float* k, const float* v, float* o,
                                    float* lse, const int* tiles, int heads, int kv_heads,
                                    float scale) {
    __shared__ float Qs[BQ][HEAD_DIM];
    __shared__ float Ks[BK][HEAD_DIM];
    __shared__ float Vs[BK][HEAD_DIM];
    __shared__ float S[BQ][BK];
    __shared__ float m_s[BQ];
    __shared__ float l_s[BQ];
    __shared__ float alpha[BQ];
    const int D = HEAD_DIM;
    int tid = threadIdx.x;
    int q0 = tiles[4 * blockIdx.x], q1 = tiles[4 * blockIdx.x + 1], a = tiles[4 * blockIdx.x + 2];
    int h = blockIdx.y;
    int g = h / (heads / kv_heads);
    int rows = q1 - q0;
    i64 ldq = (i64)heads * D;
    for (int e = tid; e < BQ * D; e += NT_ATT) {
        int i = e / D, c = e % D;
        Qs[i][c] = i < rows ? q[(q0 + i) * ldq + h * D + c] : 0.0f;
    }
    if (tid < BQ) {
        m_s[tid] = NEG_BIG;
        l_s[tid] = 0.0f;
    }
    float acc[ACC];
    for (int r = 0; r < ACC; ++r) acc[r] = 0.0f;
    __syncthreads();
    for (int k0 = a; k0 < q1; k0 += BK) {
        int kn = min(BK, q1 - k0);
        load_kv(Ks, Vs, k, v, k0, kn, g, kv_heads);
        __syncthreads();
        for (int e = tid; e < BQ * BK; e += NT_ATT) {
            int i = e / BK, j = e % BK;
            float s = NEG_BIG;
            if (i < rows && j < kn && k0 + j <= q0 + i) {
                float dot = 0.0f;
                for (int c = 0; c < D; ++c) dot += Qs[i][c] * Ks[j][c];
                s = dot * scale;
            }
            S[i][j] = s;
        }
        __syncthreads();
        if (tid < BQ) {
            int i = tid;
            float mx = m_s[i];
            for (int j = 0; j < BK; ++j) mx = fmaxf(mx, S[i][j]);
            float corr = expf(m_s[i] - mx);
            float sum = 0.0f;
            for (int j = 0; j < BK; ++j) {
                float p = S[i][j] > 0.5f * NEG_BIG ? expf(S[i][j] - mx) : 0.0f;
                S[i][j] = p;
                sum += p;
            }
            l_s[i] = l_s[i] * corr + sum;
            m_s[i] = mx;
            alpha[i] = corr;
        }
        __syncthreads();
        for (int r = 0; r < ACC; ++r) {
            int e = tid + r * NT_ATT;
            if (e >= BQ * D) break;
            int i = e / D, c = e % D;
            float x = acc[r] * alpha[i];
            for (int j = 0; j < BK; ++j) x += S[i][j] * Vs[j][c];
            acc[r] = x;
        }
        __syncthreads();
    }
    for (int r = 0; r < ACC; ++r) {
        int e = tid + r * NT_ATT;
        if (e >= BQ * D) break;
        int i = e / D, c = e % D;
        if (i < rows) o[(q0 + i) * ldq + h * D + c] = acc[r] / l_s[i];
    }
    if (tid < rows) lse[(i64)(q0 + tid) * heads + h] = m_s[tid] + logf(l_s[tid]);
}

// delta[t, h] = sum_c dout[t, h * d + c] o[t, h * d + c] (FlashAttention-2's D). n = T * heads.
extern "C" __global__ void attn_bwd_delta(const float* dout, const float* o, float* delta, int T,
                                          int heads) {
    const int D = HEAD_DIM;
    i64 n = (i64)T * heads;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const float* a = dout + e * D;
        const float* b = o + e * D;
        float s = 0.0f;
        for (int c = 0; c < D; ++c) s += a[c] * b[c];
        delta[e] = s;
    }
}

// Loads the query-side tiles of query head h: Q and dO rows, their lse and delta.
__device__ void load_q_side(float (*Qs)[HEAD_DIM], float (*dOs)[HEAD_DIM], float* lse_s,
                            float* delta_s, const float* q, const float* dout, const float* lse,
                            const float* delta, int q0, int rows, int h, int heads) {
    const int D = HEAD_DIM;
    i64 ldq = (i64)heads * D;
    for (int e = threadIdx.x; e < BQ * D; e += NT_ATT) {
        int i = e / D, c = e % D;
        bool in = i < rows;
        Qs[i][c] = in ? q[(q0 + i) * ldq + h * D + c] : 0.0f;
        dOs[i][c] = in ? dout[(q0 + i) * ldq + h * D + c] : 0.0f;
    }
    if (threadIdx.x < BQ) {
        int i = threadIdx.x;
        lse_s[i] = i < rows ? lse[(i64)(q0 + i) * heads + h] : 0.0f;
        delta_s[i] = i < rows ? delta[(i64)(q0 + i) * heads + h] : 0.0f;
    }
}

// P[i][j] = exp(s_ij - lse_i) on causal pairs (else 0) and dS[i][j] = P (dP - delta_i) scale,
// dP = dO V^T, for the tile pair (q0, rows) x (k0, kn).
__device__ void probs_and_dscores(float (*P)[BK], float (*dS)[BK], float (*Qs)[HEAD_DIM],
                                  float (*dOs)[HEAD_DIM], float (*Ks)[HEAD_DIM],
                                  float (*Vs)[HEAD_DIM], const float* lse_s,
                                  const float* delta_s, int q0, int rows, int k0, int kn,
                                  float scale) {
    const int D = HEAD_DIM;
    for (int e = threadIdx.x; e < BQ * BK; e += NT_ATT) {
        int i = e / BK, j = e % BK;
        float p = 0.0f, ds = 0.0f;
        if (i < rows && j < kn && k0 + j <= q0 + i) {
            float s = 0.0f, dp = 0.0f;
            for (int c = 0; c < D; ++c) {
                s += Qs[i][c] * Ks[j][c];
                dp += dOs[i][c] * Vs[j][c];
            }
            p = expf(s * scale - lse_s[i]);
            ds = p * (dp - delta_s[i]) * scale;
        }
        P[i][j] = p;
        dS[i][j] = ds;
    }
}

// dq [T, heads * d] = sum over causal keys of dS K. Grid (tiles, heads).
extern "C" __global__ void attn_bwd_dq(const float* q, const float* k, const float* v,
                                       const float* dout, const float* lse, const float* delta,
                                       float* dq, const int* tiles, int heads, int kv_heads,
                                       float scale) {
    __shared__ float Qs[BQ][HEAD_DIM];
    __shared__ float dOs[BQ][HEAD_DIM];
    __shared__ float Ks[BK][HEAD_DIM];
    __shared__ float Vs[BK][HEAD_DIM];
    __shared__ float P[BQ][BK];
    __shared__ float dS[BQ][BK];
    __shared__ float lse_s[BQ];
    __shared__ float delta_s[BQ];
    const int D = HEAD_DIM;
    int tid = threadIdx.x;
    int q0 = tiles[4 * blockIdx.x], q1 = tiles[4 * blockIdx.x + 1], a = tiles[4 * blockIdx.x + 2];
    int h = blockIdx.y;
    int g = h / (heads / kv_heads);
    int rows = q1 - q0;
    load_q_side(Qs, dOs, lse_s, delta_s, q, dout, lse, delta, q0, rows, h, heads);
    float acc[ACC];
    for (int r = 0; r < ACC; ++r) acc[r] = 0.0f;
    __syncthreads();
    for (int k0 = a; k0 < q1; k0 += BK) {
        int kn = min(BK, q1 - k0);
        load_kv(Ks, Vs, k, v, k0, kn, g, kv_heads);
        __syncthreads();
        probs_and_dscores(P, dS, Qs, dOs, Ks, Vs, lse_s, delta_s, q0, rows, k0, kn, scale);
        __syncthreads();
        for (int r = 0; r < ACC; ++r) {
            int e = tid + r * NT_ATT;
            if (e >= BQ * D) break;
            int i = e / D, c = e % D;
            float x = acc[r];
            for (int j = 0; j < BK; ++j) x += dS[i][j] * Ks[j][c];
            acc[r] = x;
        }
        __syncthreads();
    }
    i64 ldq = (i64)heads * D;
    for (int r = 0; r < ACC; ++r) {
        int e = tid + r * NT_ATT;
        if (e >= BQ * D) break;
        int i = e / D, c = e % D;
        if (i < rows) dq[(q0 + i) * ldq + h * D + c] = acc[r];
    }
}

// dk, dv [T, kv_heads * d]: per key tile and key/value head g, the sum over g's query heads and
// the causal query rows of dS^T Q and P^T dO. Grid (tiles, kv_heads).
extern "C" __global__ void attn_bwd_dkdv(const float* q, const float* k, const float* v,
                                         const float* dout, const float* lse, const float* delta,
                                         float* dk, float* dv, const int* tiles, int heads,
                                         int kv_heads,
                                         float scale) {
    __shared__ float Qs[BQ][HEAD_DIM];
    __shared__ float dOs[BQ][HEAD_DIM];
    __shared__ float Ks[BK][HEAD_DIM];
    __shared__ float Vs[BK][HEAD_DIM];
    __shared__ float P[BQ][BK];
    __shared__ float dS[BQ][BK];
    __shared__ float lse_s[BQ];
    __shared__ float delta_s[BQ];
    const int D = HEAD_DIM;
    int tid = threadIdx.x;
    int k0 = tiles[4 * blockIdx.x], k1 = tiles[4 * blockIdx.x + 1], b = tiles[4 * blockIdx.x + 3];
    int g = blockIdx.y;
    int kn = k1 - k0;
    int group = heads / kv_heads;
    load_kv(Ks, Vs, k, v, k0, kn, g, kv_heads);
    float dk_acc[ACC];
    float dv_acc[ACC];
    for (int r = 0; r < ACC; ++r) {
        dk_acc[r] = 0.0f;
        dv_acc[r] = 0.0f;
    }
    __syncthreads();
    for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int q0 = k0; q0 < b; q0 += BQ) {
            int rows = min(BQ, b - q0);
            load_q_side(Qs, dOs, lse_s, delta_s, q, dout, lse, delta, q0, rows, h, heads);
            __syncthreads();
            probs_and_dscores(P, dS, Qs, dOs, Ks, Vs, lse_s, delta_s, q0, rows, k0, kn, scale);
            __syncthreads();
            // BK == BQ: the accumulators [BK, HEAD_DIM] share the forward's thread layout.
            for (int r = 0; r < ACC; ++r) {
                int e = tid + r * NT_ATT;
                if (e >= BK * D) break;
                int j = e / D, c = e % D;
                float xk = dk_acc[r], xv = dv_acc[r];
                for (int i = 0; i < BQ; ++i) {
                    xk += dS[i][j] * Qs[i][c];
                    xv += P[i][j] * dOs[i][c];
                }
                dk_acc[r] = xk;
                dv_acc[r] = xv;
            }
            __syncthreads();
        }
    }
    i64 ldk = (i64)kv_heads * D;
    for (int r = 0; r < ACC; ++r) {
        int e = tid + r * NT_ATT;
        if (e >= BK * D) break;
        int j = e / D, c = e % D;
        if (j < kn) {
            dk[(k0 + j) * ldk + g * D + c] = dk_acc[r];
            dv[(k0 + j) * ldk + g * D + c] = dv_acc[r];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Optimizer

// partial[blockIdx.x] = sum of x^2 over the block's grid-stride share, in double.
extern "C" __global__ void sum_squares(const float* x, i64 n, double* partial) {
    __shared__ double sh[NT_ROW];
    int tid = threadIdx.x;
    double s = 0.0;
    for (i64 i = blockIdx.x * (i64)blockDim.x + tid; i < n; i += (i64)gridDim.x * blockDim.x)
        s += (double)x[i] * (double)x[i];
    sh[tid] = s;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (tid < k) sh[tid] += sh[tid + k];
        __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = sh[0];
}

// AdamW (Loshchilov and Hutter 2019), as AdamW::update on the CPU: g = grad * grad_scale,
// m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p).
extern "C" __global__ void adamw(float* p, const float* grad, float* m, float* v, i64 n, float lr,
                                 float beta1, float beta2, float eps, float wd, float bc1,
                                 float bc2, float grad_scale) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = grad[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float update = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        p[i] -= lr * (update + wd * p[i]);
    }
}

// p[i] = scale * (2 u - 1), u uniform in [0, 1) from splitmix64(seed + i * golden): a fast
// initialisation of large models for timing (not the CPU backend's weights).
extern "C" __global__ void init_uniform(float* p, i64 n, unsigned long long seed, float scale) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) / 16777216.0f;
        p[i] = scale * (2.0f * u - 1.0f);
    }
}
