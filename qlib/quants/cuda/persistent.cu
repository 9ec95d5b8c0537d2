// qlib's persistent decode kernel: one launch runs a whole llama decode step.
//
// A resident grid (one block per SM, all co-resident) walks the layers; the stages of a layer
// are separated by a grid-wide barrier (an atomic counter with a generation word), so no host
// round trip happens between layers. Per layer, five stages:
//   A  RmsNorm(h) (each block, into shared memory) -> q, k, v rows two at a time (a RoPE pair),
//      rotated, k and v written to the KV cache at the position read from device memory;
//   B  attention partials: one warp per (query head, 32 cached positions): scores, their max,
//      exp-sum and the weighted values (flash-decoding's split);
//   C  each block combines the partials of every head into the attention row (shared memory),
//      then wo rows: h[row] += wo[row] . att;
//   D  RmsNorm(h) -> gate and up rows of one index per warp task -> g = silu(gate) * up;
//   E  down rows: h[row] += w2[row] . g.
// Then RmsNorm(h) -> output rows -> logits, and the argmax as one 64-bit atomicMax of
// (order-preserving float bits, inverted index): the first maximum wins, as torch.argmax.
//
// Weights are the GGUF blocks as they are in the file (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0), dequantized exactly (d * q (+ m) in float32) and accumulated in float32: the numerics
// of qlib's fast CUDA path, summed in another order. Activations written by other blocks are
// read with ld.global.cg (L2, never a stale L1 line). Model sizes come in as macros
// (-DDIM=576 ...), so every loop bound is a constant.

#ifndef DIM
#error "compile with -DDIM=... -DNFF=... -DNH=... -DNKV=... -DHD=... -DNL=... -DVOCAB=... -DMAXSEQ=... -DEPS=... -DNEOX=..."
#endif

#define WARPS (THREADS / 32)
#define CH 32  // cached positions per attention task (one per lane)
#define NCMAX ((MAXSEQ + CH - 1) / CH)
#define QKV_PAIRS ((NH + 2 * NKV) * HD / 2)
#define SMEM_FLOATS (NFF > DIM ? (NFF > NH * HD ? NFF : NH * HD) : (DIM > NH * HD ? DIM : NH * HD))

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8 };
enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN, W_ATTN_NORM, W_FFN_NORM, W_PER_LAYER };

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned long long usize;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
}
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }  // p 2-aligned
__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int block_bytes(int t) {
    return t == T_Q8_0 ? 34 : t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : 24;
}
__device__ __forceinline__ usize row_bytes(int t, int k) {
    return t == T_F32 ? 4 * (usize)k : t == T_F16 ? 2 * (usize)k : (usize)(k / 32) * block_bytes(t);
}

// The 8 codes of part p (elements 8p .. 8p+7) of a 4/5-bit block: low nibbles of bytes
// 0..15 are elements 0..15, high nibbles elements 16..31; Q5_* add bit j of qh.
__device__ __forceinline__ void nibbles8(const u8* qs, int p, u32 qh, int five, float* q) {
    const u8* b = qs + 8 * (p & 1);
    const int shift = (p >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int v = (b[i] >> shift) & 15;
        if (five) v |= ((qh >> (8 * p + i)) & 1) << 4;
        q[i] = (float)v;
    }
}

// One lane's share of the dot of a weight row of type T (K elements) with x (shared
// memory): lanes take 8 consecutive elements at a time; the loop is unrolled, so all of a
// lane's loads are in flight together.
template <int K, int T>
__device__ __forceinline__ float partial(const u8* row, const float* x, int lane) {
    float acc = 0.f;
    if (T == T_F32 || T == T_F16) {
#pragma unroll
        for (int it = 0; it < (K + 31) / 32; it++) {
            const int i = lane + 32 * it;
            if (i < K) acc += (T == T_F32 ? ((const float*)row)[i] : h2f(((const u16*)row)[i])) * x[i];
        }
        return acc;
    }
    constexpr int bb = T == T_Q8_0 ? 34 : T == T_Q4_0 ? 18 : T == T_Q4_1 ? 20 : T == T_Q5_0 ? 22 : 24;
    constexpr int has_m = T == T_Q4_1 || T == T_Q5_1;
    constexpr int five = T == T_Q5_0 || T == T_Q5_1;
    constexpr float offset = T == T_Q4_0 ? 8.f : T == T_Q5_0 ? 16.f : 0.f;
#pragma unroll
    for (int it = 0; it < (K / 8 + 31) / 32; it++) {
        const int u = lane + 32 * it;
        if (u >= K / 8) break;
        const int b = u >> 2, p = u & 3;
        const u8* blk = row + bb * b;
        const float d = h2f(ld16(blk));
        const float* xx = x + 32 * b + 8 * p;
        if (T == T_Q8_0) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u16 w = ld16(blk + 2 + 8 * p + 2 * i);
                s += (float)(signed char)(w & 0xff) * xx[2 * i] +
                     (float)(signed char)(w >> 8) * xx[2 * i + 1];
            }
            acc += d * s;
        } else {
            const float m = has_m ? h2f(ld16(blk + 2)) : 0.f;
            const u8* after = blk + (has_m ? 4 : 2);
            u32 qh = 0;
            if (five) qh = (u32)ld16(after) | ((u32)ld16(after + 2) << 16);
            float q[8];
            nibbles8(after + (five ? 4 : 0), p, qh, five, q);
            float s = 0.f, sx = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                s += q[i] * xx[i];
                sx += xx[i];
            }
            acc += d * (s - offset * sx) + m * sx;
        }
    }
    return acc;
}

// One warp: the dots of R rows of one type with x; every lane gets the R sums in out.
template <int K, int R>
__device__ __forceinline__ void rows_dot(int t, const u8* const* rows, const float* x, int lane,
                                         float* out) {
#define QLIB_ROWS(TT)                                                       \
    {                                                                       \
        _Pragma("unroll") for (int r = 0; r < R; r++) out[r] =              \
            partial<K, TT>(rows[r], x, lane);                               \
    }                                                                       \
    break;
    switch (t) {
        case T_F32: QLIB_ROWS(T_F32)
        case T_F16: QLIB_ROWS(T_F16)
        case T_Q4_0: QLIB_ROWS(T_Q4_0)
        case T_Q4_1: QLIB_ROWS(T_Q4_1)
        case T_Q5_0: QLIB_ROWS(T_Q5_0)
        case T_Q5_1: QLIB_ROWS(T_Q5_1)
        default: QLIB_ROWS(T_Q8_0)
    }
#undef QLIB_ROWS
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(out[r]);
}

template <int K>
__device__ __forceinline__ float row_dot(int t, const u8* row, const float* x, int lane) {
    float y;
    rows_dot<K, 1>(t, &row, x, lane, &y);
    return y;
}

// out[row] (+)= W[row] . x for every row < N, R rows per warp task (their loads overlap).
// ARGMAX: also returns (in lane 0) the largest argmax_key of the rows this warp wrote.
__device__ __forceinline__ u64 argmax_key(float v, int idx);
template <int K, int N, int R, bool ARGMAX = false>
__device__ __forceinline__ u64 gemv_rows(int t, const u8* base, const float* x, float* out,
                                         int accumulate, int gwarp, int nwarps, int lane) {
    const usize rb = row_bytes(t, K);
    u64 mine = 0ull;
    for (int row0 = gwarp; row0 < N; row0 += R * nwarps) {
        const u8* rows[R];
#pragma unroll
        for (int r = 0; r < R; r++) rows[r] = base + rb * min(row0 + r * nwarps, N - 1);
        float y[R];
        rows_dot<K, R>(t, rows, x, lane, y);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int row = row0 + r * nwarps;
                if (row < N) {
                    out[row] = accumulate ? ldcg(out + row) + y[r] : y[r];
                    if (ARGMAX) {
                        const u64 key = argmax_key(y[r], row);
                        mine = key > mine ? key : mine;
                    }
                }
            }
        }
    }
    return mine;
}

// Element i of a row (the embedding lookup).
__device__ float row_elem(int t, const u8* row, int i) {
    if (t == T_F32) return ((const float*)row)[i];
    if (t == T_F16) return h2f(((const u16*)row)[i]);
    const int b = i / 32, j = i % 32;
    const u8* blk = row + (usize)block_bytes(t) * b;
    const float d = h2f(ld16(blk));
    if (t == T_Q8_0) return d * (float)(signed char)blk[2 + j];
    const int has_m = t == T_Q4_1 || t == T_Q5_1;
    const int five = t == T_Q5_0 || t == T_Q5_1;
    const u8* after = blk + (has_m ? 4 : 2);
    int v;
    if (five) {
        const u32 qh = (u32)ld16(after) | ((u32)ld16(after + 2) << 16);
        v = ((after[4 + (j & 15)] >> ((j >> 4) * 4)) & 15) | (((qh >> j) & 1) << 4);
    } else {
        v = (after[j & 15] >> ((j >> 4) * 4)) & 15;
    }
    const float offset = t == T_Q4_0 ? 8.f : t == T_Q5_0 ? 16.f : 0.f;
    return d * ((float)v - offset) + (has_m ? h2f(ld16(blk + 2)) : 0.f);
}

// Grid-wide barrier on a 64-bit counter that only grows: thread 0 of each block adds 1 with
// release semantics (the block's writes, ordered by the bar.sync before it, become visible
// first) and spins with acquire loads until every block of this barrier has arrived. Barrier b
// of a launch waits for base + (b + 1) * gridDim.x, base being the count when the launch began
// (launches on one stream run one after the other, so every earlier launch has added all its
// arrivals; a block that starts late sees at most gridDim.x - 1 of this launch's).
__device__ __forceinline__ void arrive_and_wait(u64* count, u64 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(count) : "memory");
        u64 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(count) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// QLIB_STAGE_TIMES: block 0 records %globaltimer (ns) after every stage's barrier.
#ifdef QLIB_STAGE_TIMES
#define MARK(i)                                                          \
    if (blockIdx.x == 0 && threadIdx.x == 0) {                           \
        u64 now_;                                                        \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_));         \
        stage_times[i] = now_;                                           \
    }
#else
#define MARK(i)
#endif

__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < WARPS; i++) s += red[i];  // the same order in every thread and block
    return s;
}

// xs = RmsNorm(h) * w over n elements (h from global memory, written by other blocks).
template <int N>
__device__ void rmsnorm_to_shared(const float* h, const float* w, float* xs, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < N; i += THREADS) {
        const float v = ldcg(h + i);
        xs[i] = v;
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, red) / (float)N + EPS);
    for (int i = threadIdx.x; i < N; i += THREADS) xs[i] = xs[i] * r * w[i];
    __syncthreads();
}

__device__ __forceinline__ u64 argmax_key(float v, int idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // order-preserving
    return ((u64)b << 32) | (u64)(0xffffffffu - (u32)idx);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) qlib_decode_step(
    const u64* __restrict__ weights,  // per layer W_PER_LAYER pointers (norms: float32)
    const int* __restrict__ types,    // per layer the GGUF type of W_Q .. W_DOWN
    const u8* __restrict__ tok_embd, int emb_type, const u8* __restrict__ out_w, int out_type,
    const float* __restrict__ out_norm, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, float* __restrict__ cache, const long long* __restrict__ tok,
    const int* __restrict__ pos_p, float* h, float* q, float* part, float* g,
    float* __restrict__ logits, u64* best, u64* bar, u64* stage_times) {
    extern __shared__ float smem[];
    float* xs = smem;                       // SMEM_FLOATS: the normalized input of a stage
    float* red = smem + SMEM_FLOATS;        // WARPS: block reductions
    float* qsh = red + WARPS;               // WARPS x HD: each warp's query head (stage B)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gwarp = blockIdx.x * WARPS + warp, nwarps = gridDim.x * WARPS;
    const int pos = *pos_p, L = pos + 1, nc = (L + CH - 1) / CH;
    // this launch's barriers: base + gridDim.x, base + 2 gridDim.x, ... (see arrive_and_wait)
    constexpr u64 BARRIERS = 5 * NL;
    u64 base;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(base) : "l"(bar) : "memory");
    base -= base % (BARRIERS * gridDim.x);
    u64 next = base + gridDim.x;
#define GRID_SYNC()              \
    arrive_and_wait(bar, next);  \
    next += gridDim.x;

    // the embedding row: every block keeps it in shared memory, block 0 also writes h
    {
        const u8* row = tok_embd + row_bytes(emb_type, DIM) * (usize)tok[0];
        for (int i = threadIdx.x; i < DIM; i += THREADS) {
            const float v = row_elem(emb_type, row, i);
            xs[i] = v;
            if (blockIdx.x == 0) h[i] = v;
        }
        if (blockIdx.x == 0 && threadIdx.x == 0) *best = 0ull;
        __syncthreads();
    }
    MARK(0);

    for (int l = 0; l < NL; l++) {
        const u64* W = weights + (usize)l * W_PER_LAYER;
        const int* T = types + l * 7;
        float* kc = cache + (usize)l * 2 * NKV * MAXSEQ * HD;
        float* vc = kc + (usize)NKV * MAXSEQ * HD;

        // ---- A: RmsNorm, q/k/v pairs, RoPE, KV write
        if (l == 0) {  // xs holds the embedding row: normalize it in place
            float ss = 0.f;
            for (int i = threadIdx.x; i < DIM; i += THREADS) ss += xs[i] * xs[i];
            const float r = 1.0f / sqrtf(block_sum(ss, red) / (float)DIM + EPS);
            const float* w = (const float*)W[W_ATTN_NORM];
            for (int i = threadIdx.x; i < DIM; i += THREADS) xs[i] = xs[i] * r * w[i];
            __syncthreads();
        } else {
            rmsnorm_to_shared<DIM>(h, (const float*)W[W_ATTN_NORM], xs, red);
        }
        for (int task = gwarp; task < QKV_PAIRS; task += nwarps) {
            int which, pair = task;
            if (pair < NH * HD / 2) {
                which = W_Q;
            } else if ((pair -= NH * HD / 2) < NKV * HD / 2) {
                which = W_K;
            } else {
                pair -= NKV * HD / 2;
                which = W_V;
            }
            const int head = pair / (HD / 2), i = pair % (HD / 2);
            const int r0 = head * HD + (NEOX ? i : 2 * i), r1 = r0 + (NEOX ? HD / 2 : 1);
            const int t = T[which];
            const u8* base = (const u8*)W[which];
            const usize rb = row_bytes(t, DIM);
            const u8* rows[2] = {base + rb * r0, base + rb * r1};
            float y2[2];
            rows_dot<DIM, 2>(t, rows, xs, lane, y2);
            float x0 = y2[0], x1 = y2[1];
            if (lane == 0) {
                if (which != W_V) {
                    const float c = cos_t[(usize)pos * (HD / 2) + i], s = sin_t[(usize)pos * (HD / 2) + i];
                    const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
                    x0 = y0;
                    x1 = y1;
                }
                if (which == W_Q) {
                    q[r0] = x0;
                    q[r1] = x1;
                } else {
                    float* dst = (which == W_K ? kc : vc) + ((usize)head * MAXSEQ + pos) * HD;
                    dst[r0 - head * HD] = x0;
                    dst[r1 - head * HD] = x1;
                }
            }
        }
        GRID_SYNC()
        MARK(1 + 5 * l + 0);

        // ---- B: attention partials, one warp per (query head, CH positions)
        for (int task = gwarp; task < NH * nc; task += nwarps) {
            const int hq = task / nc, c = task % nc, kvh = hq / (NH / NKV);
            float* qw = qsh + warp * HD;  // this warp's query head, scaled
            for (int d = lane; d < HD; d += 32) qw[d] = ldcg(q + hq * HD + d) * (1.0f / sqrtf((float)HD));
            __syncwarp();
            const int t = c * CH + lane;
            float s = NEG_INF;
            if (t < L) {
                const float4* k = (const float4*)(kc + ((usize)kvh * MAXSEQ + t) * HD);
                float acc = 0.f;
#pragma unroll
                for (int d4 = 0; d4 < HD / 4; d4++) {
                    const float4 kk = __ldcg(k + d4);
                    acc += qw[4 * d4] * kk.x + qw[4 * d4 + 1] * kk.y + qw[4 * d4 + 2] * kk.z +
                           qw[4 * d4 + 3] * kk.w;
                }
                s = acc;
            }
            __syncwarp();
            const float m = warp_max(s);
            const float p = t < L ? expf(s - m) : 0.f;
            const float lsum = warp_sum(p);
            float o[HD / 32];
#pragma unroll
            for (int j = 0; j < HD / 32; j++) o[j] = 0.f;
            const int n = min(CH, L - c * CH);
            const float* v0 = vc + ((usize)kvh * MAXSEQ + c * CH) * HD;
#pragma unroll
            for (int tt = 0; tt < CH; tt++) {  // p is 0 past the live length: rows clamped
                const float pt = __shfl_sync(0xffffffffu, p, tt);
                const float* vr = v0 + (usize)min(tt, n - 1) * HD;
#pragma unroll
                for (int j = 0; j < HD / 32; j++) o[j] += pt * ldcg(vr + lane + 32 * j);
            }
            float* dst = part + ((usize)hq * NCMAX + c) * (HD + 2);
            if (lane == 0) {
                dst[0] = m;
                dst[1] = lsum;
            }
#pragma unroll
            for (int j = 0; j < HD / 32; j++) dst[2 + lane + 32 * j] = o[j];
        }
        GRID_SYNC()
        MARK(1 + 5 * l + 1);

        // ---- C: combine the partials (every block), wo rows, residual
        for (int e = threadIdx.x; e < NH * HD; e += THREADS) {
            const int hq = e / HD, d = e % HD;
            const float* pp = part + (usize)hq * NCMAX * (HD + 2);
            float M = NEG_INF;
#pragma unroll 4
            for (int c = 0; c < nc; c++) M = fmaxf(M, ldcg(pp + (usize)c * (HD + 2)));
            float num = 0.f, den = 0.f;
#pragma unroll 4
            for (int c = 0; c < nc; c++) {
                const float* pc = pp + (usize)c * (HD + 2);
                const float w = expf(ldcg(pc) - M);
                den += w * ldcg(pc + 1);
                num += w * ldcg(pc + 2 + d);
            }
            xs[e] = num / den;
        }
        __syncthreads();
        gemv_rows<NH * HD, DIM, 1>(T[W_O], (const u8*)W[W_O], xs, h, 1, gwarp, nwarps, lane);
        GRID_SYNC()
        MARK(1 + 5 * l + 2);

        // ---- D: RmsNorm, gate and up, SwiGLU
        rmsnorm_to_shared<DIM>(h, (const float*)W[W_FFN_NORM], xs, red);
        {
            const int tg = T[W_GATE], tu = T[W_UP];
            const u8 *bg = (const u8*)W[W_GATE], *bu = (const u8*)W[W_UP];
            const usize rg = row_bytes(tg, DIM), ru = row_bytes(tu, DIM);
            for (int j = gwarp; j < NFF; j += nwarps) {
                float ab[2];
                if (tg == tu) {
                    const u8* rows[2] = {bg + rg * j, bu + ru * j};
                    rows_dot<DIM, 2>(tg, rows, xs, lane, ab);
                } else {
                    ab[0] = row_dot<DIM>(tg, bg + rg * j, xs, lane);
                    ab[1] = row_dot<DIM>(tu, bu + ru * j, xs, lane);
                }
                if (lane == 0) g[j] = ab[0] / (1.0f + expf(-ab[0])) * ab[1];
            }
        }
        GRID_SYNC()
        MARK(1 + 5 * l + 3);

        // ---- E: down rows, residual
        for (int i = threadIdx.x; i < NFF; i += THREADS) xs[i] = ldcg(g + i);
        __syncthreads();
        gemv_rows<NFF, DIM, 1>(T[W_DOWN], (const u8*)W[W_DOWN], xs, h, 1, gwarp, nwarps, lane);
        GRID_SYNC()
        MARK(1 + 5 * l + 4);
    }

    // ---- the output layer and the argmax
    rmsnorm_to_shared<DIM>(h, out_norm, xs, red);
    const u64 mine =  // 4 rows per warp task: their loads overlap
        gemv_rows<DIM, VOCAB, 4, true>(out_type, out_w, xs, logits, 0, gwarp, nwarps, lane);
    if (lane == 0 && mine) atomicMax(best, mine);
    MARK(1 + 5 * NL);
}
