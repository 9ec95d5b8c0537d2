// qlib's persistent decode kernel: one launch runs a whole llama decode step.
//
// A resident grid (GRID blocks, one per SM, all co-resident) walks the layers as a dataflow:
// a block waits only for the work it reads (the data itself: tagged or counted words),
// never on a grid-wide barrier. Per layer, in every block (roles fixed for the launch):
//   q/k/v task (tasks b, b + GRID, ...: QPB RoPE pairs of one head's rows): wait until every
//       MLP block has added its share into the residual (layer 0: the embedding row, which
//       each block looks up itself), RmsNorm, the pairs' rows (flat_dots), RoPE, q, k and v
//       as tagged words (XCHG, below), k and v into the KV cache at the position too.
//   attention task (blocks < NH x ns: head h, split s): with KV_GROUP (the default), from
//       GROUP_FROM positions on, the GQA x ns blocks of one KV head's query heads split its
//       positions GQA x ns ways, and each scores all GQA heads over its split, so that a key
//       or value row is read once for the group, not once a head (once the splits run on MLP
//       blocks too, ATT_SPREAD deals the blocks to the KV heads in turn and gives those
//       without an MLP task longer splits: they are ready sooner); the heads' q (and the KV
//       head's new k and v, in the split that holds the position) once their words carry
//       this step's tag, scores, softmax and weighted values over the split; with more than
//       one split, each publishes its heads' partial softmaxes (tagged words), and head h's
//       split s gathers head h's, then merges them (the same sums in the same order in every
//       split, so the same output; up to MERGE_DIRECT splits, a thread a dim polls its words
//       of every split and merges them in registers). Then the split's 1 / ns of the rows of
//       wo times the head's output, added into the residual (XRES words; head 0 adds the
//       residual itself).
//   MLP task (the last MLP_BLOCKS blocks, apart from the attention blocks while the heads fit
//       beside them: CHUNK hidden units each): wait until every head has added
//       its share, RmsNorm, the units' gate and up rows, g = silu(gate) * up, and their CHUNK
//       columns of down, added into the next residual (XRES words); with MLP_PAIR two tasks on
//       a cluster of two blocks pool their g and each adds half of the rows of both tasks'
//       columns.
// Then every block: RmsNorm, its rows of the output layer, the argmax as one 64-bit atomicMax
// of (order-preserving float bits, inverted index): the first maximum wins, as torch.argmax.
// The last block to finish writes the token and advances the position (and, given host_out,
// also writes the token and the count of steps done into mapped host memory, so that the host
// learns it without a copy: the greedy loop's launch-ahead, fast_cuda.greedy_step).
//
// A block stages the weights of its next layer's tasks into the other half of its shared memory
// with cp.async (what does not fit, or is not 16-byte aligned, is prefetched into L2) where it
// would wait anyway: after its q/k/v task when it has no attention task, after its wo when it
// has no MLP task, else after its MLP task. Issuing the copies stalls a block for 1.5-4 us
// (tens of KB a block, a few KB in flight per SM at a time): at the layer's start it was the
// critical path's longest hop. So a wait is followed by arithmetic on data already at hand.
// An attention block stages its split's keys and values cached before the step too (they do
// not change during it): short splits score and weigh them from shared memory, and only the
// new position's rows come from L2. In the last layer the free area takes the codes of the
// block's first output rows instead (OUT_STAGE), the rest of its rows prefetched into L2.
//
// XCHG (the default; 0 restores counters): data that one block writes and few read, q / new k,
// v and the splits' partials, goes as 64-bit words of (this step's tag, float), stored and
// loaded whole. A reader polls the words themselves, so no counter is bumped after a release
// fence that first drains the writer's stores: one L2 trip instead of a drain, a flag's trip
// and the data's. XRES (the default; 0 restores float atomics and counters): the residual
// sums, added by many blocks, as words that count their addends (res_add, read_res): a reader
// polls them until the count is complete, and the integer sums make the step bit-reproducible.
// DOWN_COPIES 2 (the default with XRES): the MLP tasks add into two copies of a layer's words by
// turns (half the atomics on each address), which the readers add as integers: the same sums.
//
// The sums a layer accumulates (residual after attention, after the MLP) and the XRES=0
// counters live in two sets, chosen by the parity of a step counter; a launch zeroes the other set for
// the next launch, so nothing is reset from the host and the launch replays from a CUDA graph.
//
// Weights are the GGUF blocks as they are in the file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0; the K-quants expanded to T_X8, 12 bits a weight), dequantized exactly (d * q (+ m) in
// float32) and accumulated in float32: the numerics
// of qlib's fast CUDA path, summed in another order (the atomics' order varies run to run, so
// the last bits do). wo and down come re-laid as slabs: slab j holds columns [j w, j w + w) of
// every row, contiguous (w = HD for wo, 32 for down). Activations written by other blocks are
// read with ld.global.cg (L2, never a stale L1 line). Model sizes come in as macros, so every
// loop bound is a constant.

#ifndef DIM
#error "compile with -DDIM=... -DNFF=... -DNH=... -DNKV=... -DHD=... -DNL=... -DVOCAB=... -DMAXSEQ=... -DEPS=... -DNEOX=... and the launch shape macros"
#endif

#define WARPS (THREADS / 32)
static_assert(THREADS % 32 == 0 && THREADS >= HD, "THREADS: whole warps, at least a head's HD");
#define GQA (NH / NKV)
#define CHUNK 16                     // hidden units per MLP task (half a quant block of down)
static_assert(SMAXPOS >= THREADS + 2 * (QPB > CHUNK ? QPB : CHUNK), "flat_dots' scratch: in S");
#define NMLP_T (NFF / CHUNK)         // MLP tasks per layer
#define MAXCH ((NMLP_T + MLP_BLOCKS - 1) / MLP_BLOCKS)  // MLP tasks per MLP block
#define MLP_FIRST (GRID - MLP_BLOCKS)  // the MLP blocks are the last ones, apart from attention
#define NS_FREE (MLP_FIRST / NH)  // attention splits a head that leave the MLP blocks free
#define PAIRS_G ((GQA + 2) * HD / 2)  // RoPE pairs of one KV head's q, k and v rows
#define QKV_T (NKV * PAIRS_G / QPB)   // q/k/v tasks per layer, QPB pairs each
#define MAXQ ((QKV_T + GRID - 1) / GRID)  // q/k/v tasks per block
#ifndef DOWN_COPIES
#define DOWN_COPIES 2  // copies of a layer's residual words that the MLP tasks add into (> 1 needs XRES)
#endif
// one set of residual sums: res(l) and mid(l), then DOWN_COPIES - 1 more copies of res(l)
#define ACC_N ((2 * NL + 1 + (DOWN_COPIES - 1) * NL) * DIM)
#define NCNT (NL * (NKV + 2 + NH) + 1)  // one set of counters
#ifndef OUT_PREFETCH
#define OUT_PREFETCH 2  // layers before the end at which the output rows are prefetched into L2
#endif
#ifndef KV_STAGE
#define KV_STAGE 1  // an attention split's cached keys and values staged into shared memory
#endif
#ifndef FLAT_DOTS
#define FLAT_DOTS 1  // q/k/v and gate/up rows: all threads share each row's units (flat_dots)
#endif
#ifndef XCHG
#define XCHG 1  // q / new k, v and the splits' partials passed as tagged words, not after a counter
#endif
#define XQKV ((NH + 2 * NKV) * HD)        // tagged words a layer: q, the new k, the new v
#ifndef KV_HALF
#define KV_HALF 0  // the KV cache in IEEE half (torch's float16 cache), else float32
#endif
#ifndef KV_GROUP
#define KV_GROUP 1  // an attention task reads its KV head's rows once for all GQA of its query heads
#endif
#define HPT (KV_GROUP ? GQA : 1)  // query heads an attention task scores at most
#ifndef GROUP_FROM
#define GROUP_FROM 1024  // KV_GROUP: from this many positions (below, a task scores one head)
#endif
#ifndef ATT_SPREAD
#define ATT_SPREAD 6  // KV_GROUP with MLP blocks attending: blocks without MLP tasks take ATT_SPREAD / 4 longer splits
#endif
#ifndef KV_PREFETCH
#define KV_PREFETCH 0  // a split's keys and values that do not fit in shared memory prefetched into L2
#endif
#ifndef MERGE_SERIAL
#define MERGE_SERIAL 8  // up to this many splits a head, a thread a dim merges them all
#endif
#ifndef MERGE_DIRECT
#define MERGE_DIRECT 4  // up to this many splits a head, a thread a dim polls their words and merges
#endif
#ifndef SUM_LATE
#define SUM_LATE 1  // the softmax's block sum reduced behind the values, published by their barrier
#endif
#ifndef EXP_VALUES
#define EXP_VALUES 1  // SUM_LATE: the weights made in the values' loop (no pass over S, no barrier)
#endif
static_assert(!EXP_VALUES || SUM_LATE, "EXP_VALUES needs SUM_LATE");
static_assert(!SUM_LATE || WARPS <= HD, "SUM_LATE: the warps' sums in qv");
#ifndef MAX_REDUX
#define MAX_REDUX 1  // a warp's float max as one redux.sync on order-preserving integer keys
#endif
#ifndef SCORE_UNROLL
#define SCORE_UNROLL 4  // passes of the score loop unrolled (key loads in flight)
#endif
#ifndef WO_G
#define WO_G 2  // threads a row of an attention task's wo rows (where HD allows: else 1)
#endif
#define WO_THREADS (HD % (8 * WO_G) == 0 ? WO_G : 1)
#ifndef VALUE_UNROLL
#define VALUE_UNROLL 3  // passes of the value loop unrolled in a task of GQA heads (one head: 4)
#endif
constexpr int kScoreUnroll = SCORE_UNROLL, kValueUnroll = VALUE_UNROLL;  // (for #pragma unroll)
static_assert(HPT == 1 || XCHG, "KV_GROUP: the splits' partials as tagged words (XCHG)");
#define XPART (NH * NSMAX * HPT * (HD + 2))  // tagged words a layer: the splits' partial softmaxes
static_assert(SMAXPOS >= NSMAX * HPT * (HD + 2), "the splits' partials gathered in S");
#ifndef XRES
#define XRES 1  // the residual sums as fixed-point words that count their addends (res_add)
#endif

#ifndef RES_LEAD
#define RES_LEAD 4  // read_res: every thread polls once the last word has n - n RES_LEAD / 8 addends
#endif
#ifndef RES_LEAD_MID
#define RES_LEAD_MID RES_LEAD  // the same for the MLP tasks' read of the residual after attention
#endif
#ifndef WHERE_SHARED
#define WHERE_SHARED 1  // the staged pieces' addresses in shared memory, not a local array
#endif
#ifndef WHERE_MAX
#define WHERE_MAX 32  // staged pieces a layer at most (persistent.py passes its WHERE_MAX)
#endif

#ifndef ROWB_CONST
#define ROWB_CONST 1  // one layer type (LAYER_TYPES a single bit): types and row sizes as constants
#endif
#ifndef OUT_LANES
#define OUT_LANES 8  // lanes a row of the output layer (0: a warp a row, 4 rows together)
#endif
#ifndef OUT_Q8X
#define OUT_Q8X 0  // a Q8_0 output layer as int8 rows and float32 scales (persistent.py sets it)
#endif
#ifndef Q41_WIDE
#define Q41_WIDE 1  // Q4_1 parts read by 32-bit loads (d and m, then the part's 8 code bytes)
#endif
#ifndef X8_WIDE
#define X8_WIDE 1  // T_X8 parts by wide loads (a, b as one 8-byte load; the 8 codes as one)
#endif
#ifndef X8_NO_B
#define X8_NO_B 0  // every T_X8 block from Q8_0 (b = 0): no b * sum(x) term (persistent.py sets it)
#endif
#ifndef OUT_STAGE
#define OUT_STAGE 1  // OUT_Q8X: a block's first output rows staged into shared memory in the last layer
#endif
#ifndef OUT_Q8X_AHEAD
#define OUT_Q8X_AHEAD 1  // OUT_Q8X: a lane's next row loaded while it works on this one
#endif
#ifndef NORM_FAST
#define NORM_FAST 1  // RmsNorm's factor by rsqrtf, block sums as a tree
#endif
#ifndef FLAT_SHFL
#define FLAT_SHFL 1  // flat_dots: a row's partial sums added by shuffles in groups of lanes first
#endif
#ifndef NORM_LATE
#define NORM_LATE 1  // RmsNorm's factor applied to the dots' results: one barrier before the dots
#endif
#ifndef LATE_EARLY
#define LATE_EARLY 1  // NORM_LATE's factor read right after the norm's barrier, not after the dots
#endif
#ifndef GU_JOINT
#define GU_JOINT 1  // gate/up: a thread's units of a gate row and of the same unit's up row together
#endif
#ifndef MLP_PAIR
#define MLP_PAIR 0  // MLP tasks c, c + 1 on a cluster of two blocks (below; persistent.py sets it)
#endif
#ifndef STAGE0_SPLIT
#define STAGE0_SPLIT 1  // layer 0's staging in two parts, q/k/v's first, the rest after q/k/v
                        // (docs/gpu.md, fortieth session: -1 to -2 us a step on Q4_1)
#endif

// MLP_PAIR: the grid runs as clusters of two blocks, and MLP tasks 2p and 2p + 1 sit on the two
// blocks of one cluster. Each computes its CHUNK units' silu(gate) * up and writes them as tagged
// words into both blocks' shared memory (distributed shared memory; a block polls its own copy),
// then each adds half of the rows of the pair's 2 CHUNK columns of down: half the residual
// atomics a layer, each word with half the addends.
static_assert(!MLP_PAIR || (XRES && GRID % 2 == 0 && MLP_FIRST % 2 == 0 && MLP_BLOCKS % 2 == 0 &&
                            NMLP_T % 2 == 0), "MLP_PAIR: XRES, and even block and task counts");
#define DOWN_ADDERS (MLP_PAIR ? NMLP_T / 2 : NMLP_T)  // addends of a layer's res(l + 1) from down
#define PAIR_HALF ((DIM / 2 + 15) / 16 * 16)          // MLP_PAIR: rank 0's rows of down
// silu(gate) * up: a task's CHUNK floats, or (MLP_PAIR) a pair's 2 CHUNK, then the pair's
// tagged words, two buffers of 2 CHUNK (8 floats' room each)
#define GSM_N (10 * CHUNK)

#define NMARK 12  // stage-time marks per layer
#ifndef NBMARK
#define NBMARK 8  // BLOCK_MARK points a block (persistent.py passes len(BLOCK_POINTS))
#endif

// GGUF's type ids, and T_X8: the K-quants (Q2_K .. Q6_K) as persistent.py expands them, exactly
// (every value is a * q + b as ggml computes it, a * q exact in float32): per 32 elements a0 b0
// a1 b1 (float32: scale and offset of elements 0..15 and 16..31) then 32 int8 codes, 48 bytes.
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_X8 = 20, T_BF16 = 30 };

// LAYER_TYPES, OUT_TYPES: bit masks (1 << type) of the types of the layers' matrices and of the
// output matrix. Only their code is compiled (all seven types' unrolled products made 380 KB
// of code, one type 151 KB: 4-5% faster on the H200).
#define QLIB_CASE(MASK, TT, ...) \
    case TT:                       \
        if constexpr (((MASK) >> TT) & 1) { \
            constexpr int T_ = TT; \
            __VA_ARGS__;           \
        }                          \
        break;
#define QLIB_DISPATCH(MASK, t, ...)                                                          \
    switch (t) {                                                                              \
        QLIB_CASE(MASK, T_F32, __VA_ARGS__) QLIB_CASE(MASK, T_F16, __VA_ARGS__) \
        QLIB_CASE(MASK, T_Q4_0, __VA_ARGS__) QLIB_CASE(MASK, T_Q4_1, __VA_ARGS__)                            \
        QLIB_CASE(MASK, T_Q5_0, __VA_ARGS__) QLIB_CASE(MASK, T_Q5_1, __VA_ARGS__) \
        QLIB_CASE(MASK, T_Q8_0, __VA_ARGS__) QLIB_CASE(MASK, T_X8, __VA_ARGS__) \
        QLIB_CASE(MASK, T_BF16, __VA_ARGS__)                                                \
    }
enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN, W_ATTN_NORM, W_FFN_NORM, W_PER_LAYER };

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned long long usize;
#define NEG_INF __int_as_float(0xff800000)

template <int N>
struct IntC {  // a constant as a type (a generic lambda's code for each N)
    static constexpr int value = N;
};

__device__ __forceinline__ float h2f(u16 u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
}
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }  // p 2-aligned
__device__ __forceinline__ u16 f2h(float f) {  // IEEE half, rounded to nearest even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// The KV cache's element: float32, or (KV_HALF) IEEE half's bits, as torch's float16 cache
#if KV_HALF
typedef u16 kv_t;
__device__ __forceinline__ kv_t to_kv(float x) { return f2h(x); }
__device__ __forceinline__ float from_kv(kv_t x) { return h2f(x); }
typedef uint2 kv4_t;  // four elements of a row
__device__ __forceinline__ float4 kv4(kv4_t u) {
    return make_float4(h2f((u16)u.x), h2f((u16)(u.x >> 16)), h2f((u16)u.y), h2f((u16)(u.y >> 16)));
}
#else
typedef float kv_t;
__device__ __forceinline__ kv_t to_kv(float x) { return x; }
__device__ __forceinline__ float from_kv(kv_t x) { return x; }
typedef float4 kv4_t;
__device__ __forceinline__ float4 kv4(kv4_t u) { return u; }
#endif
__device__ __forceinline__ float bf2f(u16 u) { return __int_as_float((int)u << 16); }
__device__ __forceinline__ float ldf(const u8* p) {  // a float32 at a 2-aligned address
    return __int_as_float((int)((u32)ld16(p) | ((u32)ld16(p + 2) << 16)));
}
// element i of a float row (F32, F16, BF16)
__device__ __forceinline__ float float_elem(int t, const u8* row, int i) {
    return t == T_F32 ? ((const float*)row)[i] : t == T_F16 ? h2f(((const u16*)row)[i])
                                                            : bf2f(((const u16*)row)[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#if MAX_REDUX  // (exact: the keys order as the floats do, NaN aside; one instruction, not five shuffles)
    int k = __float_as_int(v);
    k ^= (k >> 31) & 0x7fffffff;
    k = __reduce_max_sync(0xffffffffu, k);
    return __int_as_float(k ^ ((k >> 31) & 0x7fffffff));
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

// Sum idx of a set (res(l): 2 l, mid(l): 2 l + 1), read from L2 into dst.
__device__ __forceinline__ float* sum_at(float* A, int idx) { return A + (usize)idx * DIM; }
// (all of a thread's loads first, then its stores: one L2 round trip, not one per element)
__device__ __forceinline__ void read_sum(const float* r, float* dst) {
    constexpr int N = (DIM + THREADS - 1) / THREADS;
    float v[N];
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int i = threadIdx.x + k * THREADS;
        v[k] = i < DIM ? __ldcg(r + i) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int i = threadIdx.x + k * THREADS;
        if (i < DIM) dst[i] = v[k];
    }
}

// XRES: a residual sum is a 64-bit word, bits 54-63 the count of addends so far, bits 0-53
// the sum of the addends' fixed-point values (RES_FRAC fraction bits) each offset by 2^RES_BIAS
// so that it is positive; one 64-bit atomic add carries an addend and its count together, so a
// reader polls the words until the count is complete: no counter, no release fence that drains
// the adders' atomics, and an integer sum, the same whatever the atomics' order (bit for bit).
// Addends are saturated to |v| < 2^16 (the fraction keeps 2^-(RES_FRAC + 1) of each; at most
// 1023 addends a sum).
__host__ __device__ constexpr int ceil_log2(int n) { return n <= 1 ? 0 : 1 + ceil_log2((n + 1) / 2); }
constexpr int RES_ADDENDS = (NH > NFF / CHUNK ? NH : NFF / CHUNK);  // the most a sum gets
constexpr int RES_BIAS = 53 - ceil_log2(RES_ADDENDS);
constexpr int RES_FRAC = RES_BIAS - 16;
static_assert(!XRES || RES_ADDENDS < 1024, "XRES: at most 1023 addends a residual sum");
static_assert(DOWN_COPIES == 1 || (DOWN_COPIES <= 8 && XRES), "DOWN_COPIES: 1, or up to 8 with XRES");
__device__ __forceinline__ void res_add(u64* p, float v) {
    v = fminf(fmaxf(v, -65535.f), 65535.f);
    const long long f = __float2ll_rn(v * (float)(1ll << RES_FRAC));  // (exact scaling)
    const u64 add = (1ull << 54) + (u64)(f + (1ll << RES_BIAS));
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(add) : "memory");
}
// dst[i] = residual sum i of the words at r once each has n addends (a thread's loads in flight
// together, polled until all of them are complete). Thread 0 alone polls the last word (the
// adders' last row) until LEAD / 8 of its addends at most are missing (0: none; 8: no such
// wait), then every thread polls its own words: one L2 round trip after the last addend lands,
// where waiting for a complete last word and then reading took two. Every thread polling from
// the start (8) slows the adders' atomics on those lines (+11% a step), as RES_WARP did.
template <int NC = 1, int LEAD = RES_LEAD>
__device__ __forceinline__ void read_res(const u64* const (&r)[NC], const int (&n)[NC], float* dst) {
    constexpr int N = (DIM + THREADS - 1) / THREADS;
    u64 w[NC][N];
    long long spins = 0;
    if constexpr (LEAD < 8) {
        if (threadIdx.x == 0) {  // one word a copy first (the adders' last row): NC loads a poll
            for (;;) {
                bool ok = true;
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    u64 s;
                    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(s) : "l"(r[c] + DIM - 1) : "memory");
                    ok = ok && (int)(s >> 54) >= n[c] - n[c] * LEAD / 8;
                }
                if (ok) break;
                if (++spins > (1ll << 31)) __trap();
            }
        }
        __syncthreads();
    }
    for (;;) {
        bool ok = true;
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int k = 0; k < N; k++) {
                const int i = threadIdx.x + k * THREADS;
                w[c][k] = (u64)n[c] << 54;
                if (i < DIM) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[c][k]) : "l"(r[c] + i) : "memory");
                ok = ok && (int)(w[c][k] >> 54) == n[c];
            }
        if (ok) break;
        if (++spins > (1ll << 31)) __trap();  // seconds: a launch error, never a hang
    }
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int i = threadIdx.x + k * THREADS;
        long long sum = 0;  // the copies' integer sums: the same value however the addends split
#pragma unroll
        for (int c = 0; c < NC; c++)
            sum += (long long)(w[c][k] & ((1ull << 54) - 1)) - ((long long)n[c] << RES_BIAS);
        if (i < DIM) dst[i] = __ll2float_rn(sum) / (float)(1ll << RES_FRAC);  // (exact division)
    }
}
template <int LEAD = RES_LEAD>
__device__ __forceinline__ void read_res(const u64* r, int n, float* dst) {
    const u64* const rr[1] = {r};
    const int nn[1] = {n};
    read_res<1, LEAD>(rr, nn, dst);
}
// Copy k of res(l) (l >= 1): copy 0 among the sums, copy k > 0 after them (NL DIM words each)
template <class W>
__device__ __forceinline__ W* res_copy(W* A, int l, int k) {
    return k == 0 ? A + (usize)2 * l * DIM : A + (usize)((2 + k - 1) * NL + 1 + l - 1) * DIM;
}
// res(l) (l >= 1) as the MLP tasks added it: task c into copy c % DOWN_COPIES
__device__ __forceinline__ void read_layer_res(const u64* A, int l, float* dst) {
    const u64* rr[DOWN_COPIES];
    int nn[DOWN_COPIES];
#pragma unroll
    for (int k = 0; k < DOWN_COPIES; k++) {
        rr[k] = res_copy(A, l, k);
        nn[k] = (DOWN_ADDERS + DOWN_COPIES - 1 - k) / DOWN_COPIES;  // adders a = k (mod DOWN_COPIES)
    }
    read_res<DOWN_COPIES>(rr, nn, dst);
}
// where adder a (MLP task a, or with MLP_PAIR the pair a) adds its share of res(l + 1)
template <class W>
__device__ __forceinline__ W* layer_res_copy(W* A, int l, int a) {
    return res_copy(A, l + 1, a % DOWN_COPIES);
}
__device__ __forceinline__ void add_to(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void add_to(u64* p, float v) { res_add(p, v); }

__host__ __device__ constexpr bool is_float(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
__host__ __device__ constexpr int block_bytes(int t) {  // bytes of 32 elements of a block type
    return t == T_Q8_0 ? 34 : t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22
         : t == T_X8 ? 48 : 24;
}
__device__ __forceinline__ usize row_bytes(int t, int k) {
    return t == T_F32 ? 4 * (usize)k : is_float(t) ? 2 * (usize)k : (usize)(k / 32) * block_bytes(t);
}
// The layers' one type when LAYER_TYPES names one (ROWB_CONST), else -1: then a matrix's type
// and its rows' sizes are constants, not a shared-memory load and a chain of selects and 64-bit
// multiplies at the head of every task.
__host__ __device__ constexpr int only_type(unsigned m, int t = 0) {
    return m == 0 || (m & (m - 1)) ? -1 : (m & 1) ? t : only_type(m >> 1, t + 1);
}
constexpr int LTYPE = ROWB_CONST ? only_type(LAYER_TYPES) : -1;
__device__ __forceinline__ int layer_type(const int* T, int w) { return LTYPE >= 0 ? LTYPE : T[w]; }

// The 8 codes of part p (elements 8p .. 8p+7) of a 4/5-bit block: low nibbles of bytes
// 0..15 are elements 0..15, high nibbles elements 16..31; Q5_* add bit j of qh. The bytes come
// as four 16-bit loads (every block size is even, so they are aligned).
__device__ __forceinline__ void nibbles8(const u8* qs, int p, u32 qh, int five, float* q) {
    const u8* b = qs + 8 * (p & 1);
    const int shift = (p >> 1) * 4;
    u16 w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = ld16(b + 2 * k);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int v = (w[i >> 1] >> (8 * (i & 1) + shift)) & 15;
        if (five) v |= ((qh >> (8 * p + i)) & 1) << 4;
        q[i] = (float)v;
    }
}

// xx[0..8) of a 16-byte-aligned activation run, as two 16-byte loads (lanes of a warp read runs
// 32 bytes apart: 2-way bank conflicts against 8-way for eight float loads)
__device__ __forceinline__ void load8(const float* p, float* xx) {
    const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    xx[0] = a.x; xx[1] = a.y; xx[2] = a.z; xx[3] = a.w;
    xx[4] = b.x; xx[5] = b.y; xx[6] = b.z; xx[7] = b.w;
}

// Byte i of w, a Q8_0 code c stored as c ^ 0x80 (c + 128), as the float c: the float
// with the bits 0x4B0000 (c + 128) is 2^23 + 128 + c exactly (one PRMT and one FADD, no I2F).
__device__ __forceinline__ float code_float(u32 w, int i) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | i)) - 8388736.f;
}

// d * (the dot of the 8 codes of part p of a legacy block with xx[0..8)) (+ m * sum xx): the
// block's dequantized elements 8p .. 8p+7 times xx, as ggml's d * q (+ m).
template <int T>
__device__ __forceinline__ float unit_dot_x(const u8* blk, int p, const float (&xx)[8]) {
    constexpr int has_m = T == T_Q4_1 || T == T_Q5_1;
    constexpr int five = T == T_Q5_0 || T == T_Q5_1;
    constexpr float offset = T == T_Q4_0 ? 8.f : T == T_Q5_0 ? 16.f : 0.f;
    if (T == T_X8) {  // a * sum(q x) + b * sum(x), a and b those of the part's 16 elements
#if X8_WIDE  // 48-byte blocks, 16-aligned: a and b as one 8-byte load, the part's codes as one
        const float2 ab2 = *(const float2*)(blk + 8 * (p >> 1));
        const uint2 cw = *(const uint2*)(blk + 16 + 8 * p);
        const u32 c2[2] = {cw.x ^ 0x80808080u, cw.y ^ 0x80808080u};
        float s = 0.f, sx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {  // (the pairs and sums of the 16-bit loads' version below)
            const u32 c = c2[i >> 1];
            s += code_float(c, 2 * (i & 1)) * xx[2 * i] + code_float(c, 2 * (i & 1) + 1) * xx[2 * i + 1];
            if (!X8_NO_B) sx += xx[2 * i] + xx[2 * i + 1];
        }
        return X8_NO_B ? ab2.x * s : ab2.x * s + ab2.y * sx;
#else
        const u8* ab = blk + 8 * (p >> 1);
        float s = 0.f, sx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u16 w = ld16(blk + 16 + 8 * p + 2 * i);
            s += (float)(signed char)(w & 0xff) * xx[2 * i] + (float)(signed char)(w >> 8) * xx[2 * i + 1];
            sx += xx[2 * i] + xx[2 * i + 1];
        }
        return ldf(ab) * s + ldf(ab + 4) * sx;
#endif
    }
    const float d = h2f(ld16(blk));
    if (T == T_Q8_0) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u16 w = ld16(blk + 2 + 8 * p + 2 * i);
            s += (float)(signed char)(w & 0xff) * xx[2 * i] + (float)(signed char)(w >> 8) * xx[2 * i + 1];
        }
        return d * s;
    }
#if Q41_WIDE
    if (T == T_Q4_1) {  // 20-byte blocks, 4-aligned: d and m as one 32-bit load, the part's 8
                        // code bytes as two (the 16-bit loads were six)
        const u32 dm = *(const u32*)blk;
        const u32* qw = (const u32*)(blk + 4 + 8 * (p & 1));
        const u32 w0 = qw[0], w1 = qw[1];
        const int shift = (p >> 1) * 4;
        float s = 0.f, sx = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 nib = (((i < 4 ? w0 : w1) >> (8 * (i & 3))) >> shift) & 15u;
            const float q = (float)nib;
            s += q * xx[i];
            sx += xx[i];
        }
        return h2f((u16)(dm & 0xffffu)) * s + h2f((u16)(dm >> 16)) * sx;
    }
#endif
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
    return d * (s - offset * sx) + m * sx;
}
// The same with the activations at xp (shared memory, 16-byte aligned)
template <int T>
__device__ __forceinline__ float unit_dot(const u8* blk, int p, const float* xp) {
    float xx[8];
    load8(xp, xx);
    return unit_dot_x<T>(blk, p, xx);
}

// One thread's share of the dot of a row of type T (K elements) with x (shared memory), the
// row dealt in 8-element units (elements, for a float row) to STRIDE threads in turn: units
// seg, seg + STRIDE, ...; the loop is unrolled, so all of a thread's loads are in flight
// together.
template <int K, int T, int STRIDE>
__device__ __forceinline__ float strided_dot(const u8* row, const float* x, int seg) {
    float acc = 0.f;
    if constexpr (is_float(T)) {
#pragma unroll
        for (int j = 0; j < (K + STRIDE - 1) / STRIDE; j++) {
            const int i = seg + STRIDE * j;
            if (i < K) acc += float_elem(T, row, i) * x[i];
        }
    } else {
        constexpr int bb = block_bytes(T);
#pragma unroll
        for (int j = 0; j < (K / 8 + STRIDE - 1) / STRIDE; j++) {
            const int u = seg + STRIDE * j;
            if (u < K / 8) acc += unit_dot<T>(row + bb * (u >> 2), u & 3, x + 8 * u);
        }
    }
    return acc;
}

// One warp: the dots of R rows of one type (in MASK) with x; every lane gets the R sums in out.
template <int K, int R, unsigned MASK>
__device__ __forceinline__ void rows_dot(int t, const u8* const* rows, const float* x, int lane,
                                         float* out) {
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = 0.f;
    QLIB_DISPATCH(MASK, t, {
        _Pragma("unroll") for (int r = 0; r < R; r++) out[r] = strided_dot<K, T_, 32>(rows[r], x, lane);
    })
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(out[r]);
}

template <int K, unsigned MASK>
__device__ __forceinline__ float row_dot(int t, const u8* row, const float* x, int lane) {
    float y;
    rows_dot<K, 1, MASK>(t, &row, x, lane, &y);
    return y;
}

// Every thread of the block: the dots of NR rows with x, THREADS / NR threads a row (a row's
// 8-element units dealt to them in turn), so the block's work is spread evenly whatever NR is;
// the partial sums are added in a fixed order (scratch: THREADS floats). y[r] (shared memory)
// gets row r's dot; row_at(r) and type_at(r) name row r and its type (the rows of a warp share
// a type). Ends with a barrier.
template <int K, int NR, unsigned MASK, class RowAt, class TypeAt>
__device__ __forceinline__ void flat_dots(RowAt row_at, TypeAt type_at, const float* x,
                                          float* scratch, float* y) {
    constexpr int TPR = THREADS / NR;
    static_assert(THREADS % NR == 0, "flat_dots: NR must divide THREADS");
    const int r = threadIdx.x / TPR, seg = threadIdx.x % TPR;
    const u8* row = row_at(r);
    float acc = 0.f;
    QLIB_DISPATCH(MASK, type_at(r), acc = strided_dot<K, T_, TPR>(row, x, seg))
#if FLAT_SHFL
    // a row's threads in aligned groups of G lanes (G: the largest power of two dividing both
    // TPR and 32) add by shuffles first, so NR threads add TPR / G sums, not TPR
    constexpr int G = (TPR & -TPR) < 32 ? (TPR & -TPR) : 32;
#pragma unroll
    for (int o = 1; o < G; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (seg % G == 0) scratch[threadIdx.x / G] = acc;
#else
    constexpr int G = 1;
    scratch[threadIdx.x] = acc;
#endif
    __syncthreads();
    if (threadIdx.x < NR) {
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < TPR / G; k++) sum += scratch[threadIdx.x * (TPR / G) + k];
        y[threadIdx.x] = sum;
    }
    __syncthreads();
}

// GU_JOINT: the dots of an MLP task's CHUNK gate rows and CHUNK up rows (one type T) with x,
// THREADS / CHUNK threads a unit, each taking the unit's gate and up row over the same 8-element
// parts: one load of x serves both rows (with flat_dots every row's threads load it apart). The
// partial sums added in a fixed order (scratch: 2 THREADS / 8 floats); y[u] gets gate row u's
// dot, y[CHUNK + u] up row u's. Ends with a barrier.
template <int K, int T>
__device__ __forceinline__ void gate_up_joint(const u8* gw, const u8* uw, usize rg, usize ru,
                                              const float* x, float* scratch, float* y) {
    constexpr int TPR = THREADS / CHUNK;
    static_assert(THREADS % CHUNK == 0, "GU_JOINT: CHUNK divides THREADS");
    const int u = threadIdx.x / TPR, seg = threadIdx.x % TPR;
    const u8 *g = gw + rg * u, *up = uw + ru * u;
    float ag = 0.f, au = 0.f;
    if constexpr (is_float(T)) {
#pragma unroll
        for (int j = 0; j < (K + TPR - 1) / TPR; j++) {
            const int i = seg + TPR * j;
            if (i < K) {
                ag += float_elem(T, g, i) * x[i];
                au += float_elem(T, up, i) * x[i];
            }
        }
    } else {
        constexpr int bb = block_bytes(T);
#pragma unroll
        for (int j = 0; j < (K / 8 + TPR - 1) / TPR; j++) {
            const int v = seg + TPR * j;
            if (v < K / 8) {
                float xx[8];
                load8(x + 8 * v, xx);
                ag += unit_dot_x<T>(g + bb * (v >> 2), v & 3, xx);
                au += unit_dot_x<T>(up + bb * (v >> 2), v & 3, xx);
            }
        }
    }
    // a unit's threads in aligned groups of G lanes add by shuffles first
    constexpr int G = (TPR & -TPR) < 32 ? (TPR & -TPR) : 32, NG = THREADS / G;
#pragma unroll
    for (int o = 1; o < G; o <<= 1) {
        ag += __shfl_xor_sync(0xffffffffu, ag, o);
        au += __shfl_xor_sync(0xffffffffu, au, o);
    }
    if (seg % G == 0) {
        scratch[threadIdx.x / G] = ag;
        scratch[NG + threadIdx.x / G] = au;
    }
    __syncthreads();
    if (threadIdx.x < 2 * CHUNK) {
        const float* sc = scratch + (threadIdx.x < CHUNK ? 0 : NG) + (threadIdx.x % CHUNK) * (TPR / G);
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < TPR / G; k++) sum += sc[k];
        y[threadIdx.x] = sum;
    }
    __syncthreads();
}

// The output layer's rows [r0, r1) of one block: out[row] = f (W[row] . x) with f NORM_LATE's
// factor from red (1 without it), R rows per warp task
// (their loads overlap); returns (in lane 0) the largest argmax_key of the rows the warp wrote.
__device__ __forceinline__ u64 argmax_key(float v, int idx);
__device__ __forceinline__ float late_factor(const float* red);
template <int K, int R, unsigned MASK>
__device__ __forceinline__ u64 output_rows(int t, const u8* base, const float* x, const float* red,
                                           float* out, int r0, int r1, int warp, int lane) {
    const usize rb = row_bytes(t, K);
    const float f = late_factor(red);
    u64 mine = 0ull;
    for (int row0 = r0 + warp; row0 < r1; row0 += R * WARPS) {
        const u8* rows[R];
#pragma unroll
        for (int r = 0; r < R; r++) rows[r] = base + rb * min(row0 + r * WARPS, r1 - 1);
        float y[R];
        rows_dot<K, R, MASK>(t, rows, x, lane, y);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int row = row0 + r * WARPS;
                if (row < r1) {
                    out[row] = f * y[r];
                    const u64 key = argmax_key(f * y[r], row);
                    mine = key > mine ? key : mine;
                }
            }
        }
    }
    return mine;
}

// A row's LPR lanes' partial dots y added (shuffles); lane seg 0 stores f times the sum as
// out[row] (row < r1) and keeps the larger of mine and its argmax_key.
template <int LPR>
__device__ __forceinline__ void row_out(float y, int row, int r1, int seg, float f, float* out,
                                        u64& mine) {
#pragma unroll
    for (int o = 1; o < LPR; o <<= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
    if (seg == 0 && row < r1) {
        y *= f;
        out[row] = y;
        const u64 key = argmax_key(y, row);
        mine = key > mine ? key : mine;
    }
}
// The warp's largest argmax_key, in every lane.
__device__ __forceinline__ u64 warp_max_key(u64 mine) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, mine, o);
        mine = other > mine ? other : mine;
    }
    return mine;
}

// The same with OUT_LANES lanes a row (32 / OUT_LANES rows of a warp at a time, every lane busy:
// SmolLM2's 72 units a row are 9 a lane, where 32 lanes a row leave 24 of them idle a third of
// the time); returns the warp's largest argmax_key in every lane.
template <int K, unsigned MASK>
__device__ __forceinline__ u64 output_rows_lanes(int t, const u8* base, const float* x, const float* red,
                                                 float* out, int r0, int r1, int warp, int lane) {
    const float f = late_factor(red);
    constexpr int LPR = OUT_LANES, RPW = 32 / LPR;
    static_assert(32 % LPR == 0, "OUT_LANES divides 32");
    const usize rb = row_bytes(t, K);
    const int sub = lane / LPR, seg = lane % LPR;
    u64 mine = 0ull;
    for (int row0 = r0 + warp * RPW; row0 < r1; row0 += RPW * WARPS) {  // (warp-uniform)
        const int row = row0 + sub;
        const u8* rp = base + rb * min(row, r1 - 1);
        float y = 0.f;
        QLIB_DISPATCH(MASK, t, y = strided_dot<K, T_, LPR>(rp, x, seg))
        row_out<LPR>(y, row, r1, seg, f, out, mine);
    }
    return warp_max_key(mine);
}

// OUT_Q8X: the output layer's rows [r0, r1) from a Q8_0 matrix re-laid as int8 rows (codes, K
// bytes a row) and float32 scales (K / 32 a row). Eight lanes a row, lane seg taking the 8-code
// units seg, seg + 8, ... (K / 64 of them): its activations are read from shared memory once
// and held in registers across its rows, and a unit's codes are one 8-byte load. (The block
// layout read each unit by five 2-byte loads and its activations by two shared-memory loads:
// both went through the SM's load pipe, which bounded the rows.) Returns the warp's largest
// argmax_key in every lane.
template <int K>
__device__ __forceinline__ u64 output_rows_q8x(const u8* codes, const float* scales, const float* x,
                                               const float* red, float* out, int r0, int r1,
                                               int warp, int lane, const u8* staged_codes, int rs) {
    constexpr int LPR = 8, RPW = 32 / LPR, UPL = K / 64;
    static_assert(K % 64 == 0, "OUT_Q8X: rows of a multiple of 64");
    const float f = late_factor(red);
    const int sub = lane / LPR, seg = lane % LPR;
    float xr[UPL][8];
#pragma unroll
    for (int j = 0; j < UPL; j++) load8(x + 8 * (seg + 8 * j), xr[j]);
    u64 mine = 0ull;
    uint2 w[UPL];
    float d[UPL];
    auto load_row = [&](int row, uint2(&wv)[UPL], float(&dv)[UPL]) {  // lane's codes and scales
        const usize rr = (usize)min(row, r1 - 1);
        const float* sp = scales + rr * (K / 32) + (seg >> 2);
#pragma unroll
        for (int j = 0; j < UPL; j++) dv[j] = __ldg(sp + 2 * j);
        if ((int)rr < rs) {  // (OUT_STAGE: rows [r0, rs) in shared memory)
            const uint2* cs = (const uint2*)(staged_codes + (rr - r0) * K) + seg;
#pragma unroll
            for (int j = 0; j < UPL; j++) wv[j] = cs[8 * j];
        } else {
            const uint2* cp = (const uint2*)(codes + rr * K) + seg;
#pragma unroll
            for (int j = 0; j < UPL; j++) wv[j] = __ldg(cp + 8 * j);
        }
    };
    load_row(r0 + warp * RPW + sub, w, d);
    for (int row0 = r0 + warp * RPW; row0 < r1; row0 += RPW * WARPS) {  // (warp-uniform)
        const int row = row0 + sub;
#if OUT_Q8X_AHEAD  // the next rows' loads in flight while this row's dots run
        uint2 wn[UPL];
        float dn[UPL];
        load_row(row + RPW * WARPS, wn, dn);
#endif
        float y = 0.f;
#pragma unroll
        for (int j = 0; j < UPL; j++) {
            const u32 a = w[j].x ^ 0x80808080u, b = w[j].y ^ 0x80808080u;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) sum = fmaf(code_float(a, i), xr[j][i], sum);
#pragma unroll
            for (int i = 0; i < 4; i++) sum = fmaf(code_float(b, i), xr[j][4 + i], sum);
            y = fmaf(d[j], sum, y);
        }
#if OUT_Q8X_AHEAD
#pragma unroll
        for (int j = 0; j < UPL; j++) {
            w[j] = wn[j];
            d[j] = dn[j];
        }
#else
        load_row(row + RPW * WARPS, w, d);
#endif
        row_out<LPR>(y, row, r1, seg, f, out, mine);
    }
    return warp_max_key(mine);
}

// Element i of a row (the embedding lookup).
__device__ float row_elem(int t, const u8* row, int i) {
    if (is_float(t)) return float_elem(t, row, i);
    const int b = i / 32, j = i % 32;
    const u8* blk = row + (usize)block_bytes(t) * b;
    if (t == T_X8) return ldf(blk + 8 * (j >> 4)) * (float)(signed char)blk[16 + j] + ldf(blk + 8 * (j >> 4) + 4);
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

// The WARPS partial sums in red added in a fixed order (the same in every thread and block)
__device__ __forceinline__ float warps_total(const float* red) {
#if NORM_FAST  // a pairwise tree (4 dependent adds for 12 warps, not 11)
    float t[WARPS];
#pragma unroll
    for (int i = 0; i < WARPS; i++) t[i] = red[i];
#pragma unroll
    for (int w = 1; w < WARPS; w <<= 1)
#pragma unroll
        for (int i = 0; i + w < WARPS; i += 2 * w) t[i] += t[i + w];
    return t[0];
#else
    float s = 0.f;
    for (int i = 0; i < WARPS; i++) s += red[i];
    return s;
#endif
}

// A warp's reduced value w into red[warp], between the barriers that free and publish red
// (without FREE, the caller knows red free: only the publishing barrier)
template <bool FREE = true>
__device__ __forceinline__ void warp_into(float w, float* red) {
    if constexpr (FREE) __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = w;
    __syncthreads();
}

__device__ float block_sum(float v, float* red) {
    warp_into(warp_sum(v), red);
    return warps_total(red);
}

__device__ __forceinline__ u64 argmax_key(float v, int idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // order-preserving
    return ((u64)b << 32) | (u64)(0xffffffffu - (u32)idx);
}


// N block maxima (MAX) or sums at once, in place: red holds N x WARPS floats; the sums in
// warps_total's order (block_sum's)
template <int N, bool MAX>
__device__ void block_reduce_n(float (&v)[N], float* red) {
    float w[N];
#pragma unroll
    for (int i = 0; i < N; i++) w[i] = MAX ? warp_max(v[i]) : warp_sum(v[i]);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int i = 0; i < N; i++) red[i * WARPS + (threadIdx.x >> 5)] = w[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (MAX) {
            v[i] = NEG_INF;
            for (int k = 0; k < WARPS; k++) v[i] = fmaxf(v[i], red[i * WARPS + k]);
        } else {
            v[i] = warps_total(red + i * WARPS);
        }
    }
}

// RmsNorm's factor 1 / rms from the sum of squares of DIM elements
__device__ __forceinline__ float rms_factor(float ss) {
#if NORM_FAST  // one rsqrt (as the fused kernels' approximate 1 / sqrt), not a division, a
               // square root and a reciprocal in IEEE arithmetic on the critical path
    return rsqrtf(ss * (1.0f / (float)DIM) + EPS);
#else
    return 1.0f / sqrtf(ss / (float)DIM + EPS);
#endif
}

// xs = RmsNorm(v) * w, v in shared memory (every thread reads all of it after the barrier).
__device__ void rmsnorm_shared(const float* v, const float* w, float* xs, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < DIM; i += THREADS) ss += v[i] * v[i];
    const float r = rms_factor(block_sum(ss, red));
    for (int i = threadIdx.x; i < DIM; i += THREADS) xs[i] = v[i] * r * w[i];
    __syncthreads();
}

// NORM_LATE: RmsNorm(v) * w times a row is r (W_row . (v * w)), r = 1 / rms(v): xs = v * w
// (each thread its own elements of v, as the residual's readers wrote them), the sum of squares'
// warp partials into red, one barrier; the dots start at once and norm_factor(red) scales their
// results, where rmsnorm_shared puts two barriers, the tree and the rsqrt before the first load.
__device__ void norm_products(const float* v, const float* w, float* xs, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < DIM; i += THREADS) {
        ss += v[i] * v[i];
        xs[i] = v[i] * w[i];
    }
    // (red is free: a barrier stands after its last readers, the residual's wait's or the
    // previous task's)
    warp_into<false>(warp_sum(ss), red);
}
__device__ __forceinline__ float norm_factor(const float* red) { return rms_factor(warps_total(red)); }
// RmsNorm before a task's dots: xs normalized (factor 1 after), or NORM_LATE's products (the
// factor to apply after, from red: read it after the dots, before red is used again)
__device__ __forceinline__ void norm_for_dots(const float* v, const float* w, float* xs, float* red) {
#if NORM_LATE
    norm_products(v, w, xs, red);
#else
    rmsnorm_shared(v, w, xs, red);
#endif
}
__device__ __forceinline__ float late_factor(const float* red) {
#if NORM_LATE
    return norm_factor(red);
#else
    return 1.0f;
#endif
}

// -- one thread's dot of elements [e0, e0 + W) of a row with v (W a multiple of 8, e0 of W) --
template <int W, int T>
__device__ __forceinline__ float slab_dot_t(const u8* row, int e0, const float* v) {
    float acc = 0.f;
    if (is_float(T)) {
#pragma unroll 8
        for (int i = 0; i < W; i++) acc += float_elem(T, row, e0 + i) * v[i];
        return acc;
    }
    constexpr int bb = block_bytes(T);
#pragma unroll
    for (int k = 0; k < W / 8; k++) {
        const int u = e0 / 8 + k;
        acc += unit_dot<T>(row + bb * (u >> 2), u & 3, v + 8 * k);
    }
    return acc;
}

// dst[i] += slab row i . v (+ base[i] where base is given) for rows r0 <= i < r1, with
// atomics (float, or XRES words); row i at slab + sb (i - r0), its elements [e0, e0 + W).
// G adjacent threads a row, each on W / G of its elements (a G-th of the dependent chain),
// their sums added by shuffles in a fixed order.
template <int W, int G = 1, class Dst>
__device__ __forceinline__ void slab_rows_add(int t, const u8* slab, usize sb, int e0,
                                              const float* v, const float* base, Dst* dst,
                                              int r0 = 0, int r1 = DIM) {
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0 && W % (8 * G) == 0, "slab_rows_add: G");
    QLIB_DISPATCH(LAYER_TYPES, t, {
        if constexpr (G == 1) {
            for (int i = r0 + threadIdx.x; i < r1; i += THREADS) {
                float y = slab_dot_t<W, T_>(slab + sb * (i - r0), e0, v);
                if (base) y += base[i];
                add_to(dst + i, y);
            }
        } else {
            constexpr int WG = W / G;
            const int g = threadIdx.x % G;
            for (int i0 = r0; i0 < r1; i0 += THREADS / G) {  // (block-uniform: whole warps shuffle)
                const int i = i0 + threadIdx.x / G;
                float y = i < r1 ? slab_dot_t<WG, T_>(slab + sb * (i - r0), e0 + g * WG, v + g * WG) : 0.f;
                _Pragma("unroll") for (int o = 1; o < G; o <<= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
                if (i < r1 && g == 0) {
                    if (base) y += base[i];
                    add_to(dst + i, y);
                }
            }
        }
    })
}

// -- staging, counters ------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Copy pieces src[i] (bytes[i], multiples of 16, 16-aligned), i0 <= i < i1, into a staging
// area of `cap` bytes in order from byte `off` with cp.async, as one commit group; where[i] is
// the piece's copy, or src[i] itself (prefetched into L2, pieces before NOPF) where it does not
// fit or is not 16-aligned. Returns the offset after the last copy.
template <int N, int NOPF = N>
__device__ __forceinline__ int stage(const u8* const (&src)[N], const int (&bytes)[N], u8* area,
                                     int cap, const u8** where, int i0, int i1, int off) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (i < i0 || i >= i1) continue;
        if (bytes[i] > 0 && off + bytes[i] <= cap && !(((usize)src[i] | bytes[i]) & 15)) {
            where[i] = area + off;
            for (int j = threadIdx.x * 16; j < bytes[i]; j += THREADS * 16) cp_async16(area + off + j, src[i] + j);
            off += bytes[i];
        } else {
            where[i] = src[i];
            if (i < NOPF)
                for (int j = threadIdx.x * 128; j < bytes[i]; j += THREADS * 128) prefetch_l2(src[i] + j);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    return off;
}
// This layer's staging (issued during the layer before) has landed: every commit group.
__device__ __forceinline__ void staged() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
}

// Wait until *c >= target (thread 0 polls with acquire loads; the block's barrier after it
// orders every thread's later reads). A count that never comes (a bug) traps after seconds.
__device__ __forceinline__ void wait_count(const u32* c, u32 target) {
    if (threadIdx.x == 0) {
        u32 seen;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
            if (++spins > (1ll << 31)) __trap();  // seconds: a launch error, never a hang
        } while (seen < target);
    }
    __syncthreads();
}
// The block's writes so far (ordered by the barrier) become visible, then *c grows by 1.
__device__ __forceinline__ void signal(u32* c) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}
// As signal, adding n.
__device__ __forceinline__ void signal_n(u32* c, u32 n) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(c), "r"(n) : "memory");
}
// As signal, returning the count before (thread 0's value; acquire: the writes of every earlier
// arrival are visible to this block after its next barrier).
__device__ __forceinline__ u32 arrive(u32* c) {
    u32 old = 0;
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    return old;
}

// MLP_PAIR: a barrier of both blocks of the cluster (every thread), in its two halves
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The word w at p in this block's shared memory and at the same address in the other block's
__device__ __forceinline__ void put_both(u64* p, u64 w) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
#pragma unroll
    for (u32 rank = 0; rank < 2; rank++) {
        u32 at;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(at) : "r"(a), "r"(rank));
        asm volatile("st.relaxed.cluster.shared::cluster.u64 [%0], %1;" ::"r"(at), "l"(w) : "memory");
    }
}
// The float of the tagged word at p (this block's shared memory) once it carries tag
__device__ __forceinline__ float get_shared_tagged(const u64* p, u32 tag) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    u64 w;
    long long spins = 0;
    for (;;) {
        asm volatile("ld.relaxed.cluster.shared::cta.u64 %0, [%1];" : "=l"(w) : "r"(a) : "memory");
        if ((u32)(w >> 32) == tag) return __uint_as_float((u32)w);
        if (++spins > (1ll << 31)) __trap();
    }
}

// Tagged words (XCHG): a float and the step's tag in one 64-bit word, stored and loaded whole
// (single-copy atomic), so a reader polls the data itself: no counter, and no release fence
// that drains the writer's earlier stores first. Every launch has its own tag (the step count
// + 1), so words of earlier steps never pass.
__device__ __forceinline__ void put_tagged(u64* p, u32 tag, float v) {
    const u64 w = ((u64)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
// The N floats at p[i] (all loads in flight together), once every word carries tag.
template <int N>
__device__ __forceinline__ void get_tagged(const u64* const (&p)[N], u32 tag, float (&v)[N]) {
    long long spins = 0;
    for (;;) {
        u64 w[N];
        bool ok = true;
#pragma unroll
        for (int i = 0; i < N; i++) {
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[i]) : "l"(p[i]) : "memory");
            ok = ok && (u32)(w[i] >> 32) == tag;
        }
        if (ok) {
#pragma unroll
            for (int i = 0; i < N; i++) v[i] = __uint_as_float((u32)w[i]);
            return;
        }
        if (++spins > (1ll << 31)) __trap();  // seconds: a launch error, never a hang
    }
}

// A head's output from its n splits' partials at P (split j at P + j (HD + 2): its score max,
// its sum of exp, its HD weighted value sums), into out (HD). Up to MERGE_SERIAL splits, a
// thread a dim adds them all; past that, every warp weighs the splits
// itself (lanes j, j + 32, ...), then THREADS / HD parts of the threads each add every
// (THREADS / HD)-th split into scratch (THREADS floats) and a thread a dim adds the parts: the
// same sums in the same order in every split of the head, so every split gets the same output.
// One dim's output from n <= NMAX splits (NMAX 0: any n, by fours); at(j, k) is split j's
// score max (k 0), sum of exp (1) or weighted value sum of the dim (2)
template <int NMAX, class At>
__device__ __forceinline__ float merge_dim(int n, At at) {
    float M = NEG_INF, num = 0.f, den = 0.f;
#pragma unroll(NMAX > 0 ? NMAX : 4)
    for (int j = 0; j < (NMAX > 0 ? NMAX : n); j++)
        if (j < n) M = fmaxf(M, at(j, 0));
#pragma unroll(NMAX > 0 ? NMAX : 4)
    for (int j = 0; j < (NMAX > 0 ? NMAX : n); j++)
        if (j < n) {
            const float w = expf(at(j, 0) - M);
            den += w * at(j, 1);
            num += w * at(j, 2);
        }
    return num / den;
}

__device__ void merge_partials(const float* P, int n, float* scratch, float* out) {
    constexpr int JW = (NSMAX * HPT + 31) / 32, PARTS = THREADS / HD;
    if (n <= MERGE_SERIAL) {  // few splits: a thread a dim, every split in turn
        for (int d = threadIdx.x; d < HD; d += THREADS)
            out[d] = merge_dim<0>(n, [&](int j, int k) { return P[j * (HD + 2) + (k < 2 ? k : 2 + d)]; });
        return;
    }
    const int lane = threadIdx.x & 31;
    float M = NEG_INF;
#pragma unroll
    for (int k = 0; k < JW; k++) {
        const int j = lane + 32 * k;
        if (j < n) M = fmaxf(M, P[j * (HD + 2)]);
    }
    M = warp_max(M);
    float wj[JW], den = 0.f;
#pragma unroll
    for (int k = 0; k < JW; k++) {
        const int j = lane + 32 * k;
        wj[k] = j < n ? expf(P[j * (HD + 2)] - M) : 0.f;
        if (j < n) den += wj[k] * P[j * (HD + 2) + 1];
    }
    den = warp_sum(den);
    const int part = threadIdx.x / HD, d = threadIdx.x % HD;  // (part: one a warp, HD % 32 == 0)
    if (part < PARTS) {
        float num = 0.f;
        int j = part;  // (warp-uniform: splits j, j + PARTS, ... in order, lane j & 31's weight)
#pragma unroll
        for (int k = 0; k < JW; k++)
            for (; j < n && j < 32 * (k + 1); j += PARTS)
                num += __shfl_sync(0xffffffffu, wj[k], j & 31) * P[j * (HD + 2) + 2 + d];
        scratch[part * HD + d] = num;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HD; i += THREADS) {
        float num = 0.f;
        for (int k = 0; k < PARTS; k++) num += scratch[k * HD + i];
        out[i] = num / den;
    }
}

// QLIB_STAGE_TIMES: block 0 (a q/k/v and an attention task each layer) and the first MLP block
// (marks 8-11) record %globaltimer (ns) at NMARK marks a layer, and at the step's start and end.
#ifdef QLIB_STAGE_TIMES
#define MARK(i)                                                  \
    if (threadIdx.x == 0) {                                      \
        u64 now_;                                                \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_)); \
        stage_times[i] = now_;                                   \
    }
// BLOCK_MARK(i): every block's time at NBMARK points of the middle layer (NL / 2): its residual
// in, its q/k/v task done, every head in, its MLP task done, the next layer's staging issued,
// the residual's count seen, its attention task's values done, its head's splits merged.
#define BLOCK_MARK(i)                                                          \
    if (threadIdx.x == 0 && l == NL / 2) {                                     \
        u64 now_;                                                              \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_));               \
        stage_times[NMARK * NL + 2 + NBMARK * b + (i)] = now_;                 \
    }
#else
#define MARK(i)
#define BLOCK_MARK(i)
#endif
// block 0's marks in the output layer: residual in, normalized, its rows done
#define OUT_MARK(k) MARK(NMARK * NL + 2 + NBMARK * GRID + (k))

#if MLP_PAIR
#define QLIB_CLUSTER __cluster_dims__(2, 1, 1)
#else
#define QLIB_CLUSTER
#endif
extern "C" __global__ void QLIB_CLUSTER __launch_bounds__(THREADS, 1) qlib_decode_step(
    const u64* __restrict__ weights,  // per layer W_PER_LAYER pointers (wo, down: slabs; norms: float32)
    const int* __restrict__ types,    // per layer the GGUF type of W_Q .. W_DOWN
    const u8* __restrict__ tok_embd, int emb_type, const u8* __restrict__ out_w, int out_type,
    const float* __restrict__ out_norm, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, kv_t* __restrict__ cache,
    const long long* tok,  // (out_tok may be tok itself: written by the last block, after every read)
    int* pos_p, float* acc, u32* counters, u32* steps, u64* best, long long* out_tok, float* part,
    float* qbuf, float* __restrict__ logits, u64* stage_times, u64* xchg,
    volatile long long* host_out,
    const float* __restrict__ out_sc) {  // OUT_Q8X: the output rows' scales (out_w: their codes)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* xs = (float*)(smem_raw + 2 * WCAP);  // DIM: the normalized input
    float* res_in = xs + DIM;                   // DIM: the residual read at a stage's start
    float* qv = res_in + DIM;                   // HPT x HD: the task's queries, scaled
    float* ovec = qv + HPT * HD;                // HD: the head's output
    float* rope_c = ovec + HD;                  // HD / 2 each: RoPE at this position
    float* rope_s = rope_c + HD / 2;
    float* knew_f = rope_s + HD / 2;            // HD each: the key and value rows at the position
    float* vnew_f = knew_f + HD;                //   (knew, vnew: as the cache holds them)
    float* S = vnew_f + HD;                     // SMAXPOS: the split's scores, then weights
    float* oacc = S + SMAXPOS;                  // WARPS x HPT x HD: the warps' weighted value sums
    float* gsm = oacc + WARPS * HPT * HD;       // GSM_N: silu(gate) * up of an MLP task
    float* red = gsm + GSM_N;                   // WARPS x HPT: block reductions
    int* stypes = (int*)(red + WARPS * HPT);    // NL x 7: the matrices' types (off the global
                                                // loads of the critical path)

    kv_t* knew = (kv_t*)knew_f;
    kv_t* vnew = (kv_t*)vnew_f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int otype = ROWB_CONST ? only_type(OUT_TYPES) : out_type;  // (OUT_TYPES: one bit)
    (void)otype;  // (OUT_Q8X: not read)
    const int pos = *pos_p, L = pos + 1;
    const u32 step_no = __ldcg(steps), par = step_no & 1u;
    const u32 tag = step_no + 1u;  // (the exchange starts zeroed: tag 0 is never a step's)
    (void)tag;
#if XRES  // res(l) = A + 2 l DIM (l >= 1), mid(l) = A + (2 l + 1) DIM: words
    u64* A = (u64*)acc + (usize)par * ACC_N;
#else
    float* A = acc + (usize)par * ACC_N;  // res(l) = sum_at(A, 2 l) (l >= 1), mid(l) = sum_at(A, 2 l + 1)
#endif
    u32* C = counters + par * NCNT;
    u32* qkv_cnt = C;                     // NL x NKV: q/k/v pairs done per KV head
    u32* attn_done = qkv_cnt + NL * NKV;  // NL: attention tasks (head, split) added into mid(l)
    u32* mlp_done = attn_done + NL;       // NL: MLP blocks added into res(l + 1)
    u32* head_cnt = mlp_done + NL;        // NL x NH: splits done per head
    u32* done = head_cnt + NL * NH;       // blocks finished
    const int b = blockIdx.x;
    if (b == 0) MARK(NMARK * NL);
    {  // the other set, for the next launch
#if XRES
        u64* Z = (u64*)acc + (usize)(par ^ 1u) * ACC_N;
#else
        float* Z = acc + (usize)(par ^ 1u) * ACC_N;
#endif
        u32* ZC = counters + (par ^ 1u) * NCNT;
        for (int i = b * THREADS + threadIdx.x; i < ACC_N; i += gridDim.x * THREADS) Z[i] = 0;
        for (int i = b * THREADS + threadIdx.x; i < NCNT; i += gridDim.x * THREADS) ZC[i] = 0u;
        if (b == 0 && threadIdx.x == 0) best[par ^ 1u] = 0ull;
    }
    // RoPE's tables and the embedding row (layer 0's residual) loaded with the types, before one
    // barrier (after it, the tables cost a second round trip: ~1 us a step)
    for (int i = threadIdx.x; i < HD / 2; i += THREADS) {
        rope_c[i] = cos_t[(usize)pos * (HD / 2) + i];
        rope_s[i] = sin_t[(usize)pos * (HD / 2) + i];
    }
    {
        const u8* row = tok_embd + row_bytes(emb_type, DIM) * (usize)tok[0];
        for (int i = threadIdx.x; i < DIM; i += THREADS) res_in[i] = row_elem(emb_type, row, i);
    }
    for (int i = threadIdx.x; i < NL * 7; i += THREADS) stypes[i] = types[i];
    __syncthreads();
    // splits of a head's positions: up to NS_FREE (the blocks before the MLP blocks hold them
    // all) of at least MIN_SPLIT positions; past NS_FREE x SPLIT positions, splits of SPLIT
    // on up to NSMAX blocks a head (then attention blocks run MLP tasks too)
    int ns = min(NS_FREE, (L + MIN_SPLIT - 1) / MIN_SPLIT);
    if ((L + SPLIT - 1) / SPLIT > ns) ns = min(NSMAX, (L + SPLIT - 1) / SPLIT);
    ns = max(ns, 1);
    // roles: attention task (head h, split s) on blocks < NH ns; MLP tasks on the last
    // MLP_BLOCKS blocks; q/k/v tasks b, b + grid, ... on every block
    const bool att = b < NH * ns, mlp = b >= MLP_FIRST && b < MLP_FIRST + MLP_BLOCKS;
    const int mb = b - MLP_FIRST;  // the MLP block's index
    // KV_GROUP, from GROUP_FROM positions: the GQA x ns blocks of a KV head's query heads
    // split its positions GQA x ns ways, each scoring all GQA heads (split sg); head h's split
    // s then merges head h's partials and adds its share of wo, as without (split sg = s of
    // head h alone)
    const bool grouped = HPT > 1 && L >= GROUP_FROM;
    const int nsg = grouped ? HPT * ns : ns;  // splits of the positions
    // ATT_SPREAD, grouped, when MLP blocks attend too: the attention blocks dealt to the KV
    // heads in turn (block b: KV head b % NKV, its split b / NKV), so that every KV head gets
    // its share of the blocks without an MLP task, whose splits are ATT_SPREAD / 4 times longer
    // (they stage the next layer before the MLP, the others after it)
    const bool spread = ATT_SPREAD && grouped && NH * ns > MLP_FIRST &&
                        (L * ATT_SPREAD / (4 * nsg) + 2) * HPT <= SMAXPOS;
    const int member = spread ? b / NKV : 0;
    const int h = !att ? 0 : spread ? (b % NKV) * GQA + member / ns : b / ns;
    const int s = !att ? 0 : spread ? member % ns : b % ns, kvh = h / GQA;
    const int each = (L + nsg - 1) / nsg;  // positions a split, equal splits
    int t0, t1;
    if (spread) {
        const int nf = min(nsg, max(0, MLP_FIRST - kvh + NKV - 1) / NKV);  // the KV head's fast splits
        const long long u = nf * ATT_SPREAD + (nsg - nf) * 4;
        auto at = [&](int j) { return (int)(L * (long long)(min(j, nf) * ATT_SPREAD + max(0, j - nf) * 4) / u); };
        t0 = at(member);
        t1 = at(member + 1);
    } else {
        t0 = min(L, (grouped ? (h % GQA) * ns + s : s) * each);
        t1 = min(L, t0 + each);
    }
    const int len = spread ? t1 - t0 : each;  // (the stride of a head's scores in S)
    const int tc = max(t0, min(t1, pos));  // cached before the step: [t0, tc)
    // the split's rows of wo (every split of a head merges the head's partials, then adds its
    // own rows): multiples of 4 rows, so that a slab piece stays 16-byte aligned
    const int wo_rows = ((DIM + ns - 1) / ns + 3) / 4 * 4;
    const int wo_r0 = min(DIM, s * wo_rows), wo_r1 = min(DIM, wo_r0 + wo_rows);

    // this block's rows of the output layer, prefetched into L2 during the last layers
    constexpr int OUT_RB = (VOCAB + GRID - 1) / GRID;
    const int out_r0 = min(VOCAB, b * OUT_RB), out_r1 = min(VOCAB, out_r0 + OUT_RB);
    // OUT_STAGE (OUT_Q8X): the codes of its first rows [out_r0, out_rs), staged into the free
    // area during the last layer (the rest read from L2)
    const int out_rs = OUT_STAGE && OUT_Q8X ? min(out_r1, out_r0 + WCAP / DIM) : out_r0;
    u8* const out_area = smem_raw + (NL & 1) * WCAP;  // (the area layer NL would have)
    constexpr int P_QKV = 2, P_WO = 2 + 2 * MAXQ, P_MLP = P_WO + 1, P_KV = P_MLP + 3 * MAXCH;
    constexpr int NP = P_KV + 2;
#if WHERE_SHARED
    // The staged pieces' addresses (the same in every thread) in shared memory. As a local array
    // indexed by the layer's parity they lived on the stack: every task began with a load from
    // L1, or from L2 once the staging's traffic had evicted the line.
    static_assert(NP <= WHERE_MAX, "WHERE_MAX: the staged pieces of a layer");
    __shared__ const u8* where[2][WHERE_MAX];
#else
    const u8* where[2][NP];
#endif
    // layer l's pieces [i0, i1) from byte off of its area (returns the offset after them)
    auto stage_layer = [&](int l, int i0, int i1, int off) {
        const u64* W = weights + (usize)l * W_PER_LAYER;
        const int* T = stypes + l * 7;
        const u8* src[NP];
        int bytes[NP];
        src[0] = (const u8*)W[W_ATTN_NORM];
        src[1] = (const u8*)W[W_FFN_NORM];
        bytes[0] = bytes[1] = DIM * 4;
#pragma unroll
        for (int k = 0; k < MAXQ; k++) {  // q/k/v task: QPB RoPE pairs of one head's rows
            const int task = b + k * gridDim.x;
            const int pr = task * QPB, g = pr / PAIRS_G, r = pr % PAIRS_G;
            const int seg = r / (HD / 2), i0 = r % (HD / 2);
            const int which = seg < GQA ? W_Q : seg == GQA ? W_K : W_V;
            const int head = seg < GQA ? g * GQA + seg : g;
            const int rb = (int)row_bytes(layer_type(T, which), DIM);
            const u8* base = (const u8*)W[which] + (usize)head * HD * rb;
            const bool mine = task < QKV_T;
            src[P_QKV + 2 * k] = base + (usize)(NEOX ? i0 : 2 * i0) * rb;
            src[P_QKV + 2 * k + 1] = base + (usize)(i0 + HD / 2) * rb;
            bytes[P_QKV + 2 * k] = mine ? (NEOX ? QPB : 2 * QPB) * rb : 0;
            bytes[P_QKV + 2 * k + 1] = mine && NEOX ? QPB * rb : 0;
        }
        const int sbo = (int)row_bytes(layer_type(T, W_O), HD);
        src[P_WO] = (const u8*)W[W_O] + ((usize)h * DIM + wo_r0) * sbo;
        bytes[P_WO] = att ? (wo_r1 - wo_r0) * sbo : 0;
        const int rbg = (int)row_bytes(layer_type(T, W_GATE), DIM), rbu = (int)row_bytes(layer_type(T, W_UP), DIM);
        const int sbd = (int)row_bytes(layer_type(T, W_DOWN), 32);
#pragma unroll
        for (int ci = 0; ci < MAXCH; ci++) {
            const int c = mb + ci * MLP_BLOCKS;
            const bool mine = mlp && c < NMLP_T;
            src[P_MLP + 3 * ci] = (const u8*)W[W_GATE] + (usize)c * CHUNK * rbg;
            src[P_MLP + 3 * ci + 1] = (const u8*)W[W_UP] + (usize)c * CHUNK * rbu;
            // down: the pair's slab; its rows [dr0, dr1): with MLP_PAIR this block's half
            const int dr0 = MLP_PAIR && (c & 1) ? PAIR_HALF : 0, dr1 = MLP_PAIR && !(c & 1) ? PAIR_HALF : DIM;
            src[P_MLP + 3 * ci + 2] = (const u8*)W[W_DOWN] + ((usize)(c / 2) * DIM + dr0) * sbd;
            bytes[P_MLP + 3 * ci] = mine ? CHUNK * rbg : 0;
            bytes[P_MLP + 3 * ci + 1] = mine ? CHUNK * rbu : 0;
            bytes[P_MLP + 3 * ci + 2] = mine ? (dr1 - dr0) * sbd : 0;
        }
        // the split's keys and values cached before this step (rows [t0, tc)): staged last, so
        // into shared memory where they fit beside the weights (short splits), else into L2
        const kv_t* kc = cache + (usize)l * 2 * NKV * MAXSEQ * HD + ((usize)kvh * MAXSEQ + t0) * HD;
        src[P_KV] = (const u8*)kc;
        src[P_KV + 1] = (const u8*)(kc + (usize)NKV * MAXSEQ * HD);
        bytes[P_KV] = bytes[P_KV + 1] = att ? (tc - t0) * HD * (int)sizeof(kv_t) : 0;
#if !KV_STAGE
        if (att && i1 > P_KV) {
            for (int j = threadIdx.x * 128; j < bytes[P_KV]; j += THREADS * 128) {
                prefetch_l2(src[P_KV] + j);
                prefetch_l2(src[P_KV + 1] + j);
            }
        }
        bytes[P_KV] = bytes[P_KV + 1] = 0;
#endif
        return stage<NP, KV_PREFETCH ? NP : P_KV>(src, bytes, smem_raw + (l & 1) * WCAP, WCAP,
                                                  where[l & 1], i0, i1, off);
    };

#if MLP_PAIR
    // the pair's tagged words, two buffers by turns (an address computed where it is used)
#define MBOX ((u64*)(gsm + 2 * CHUNK))
    for (int i = threadIdx.x; i < 4 * CHUNK; i += THREADS) MBOX[i] = 0ull;
    cluster_arrive();  // (zeroed, and the other block started, before either writes)
#endif
#if STAGE0_SPLIT  // the norms and q/k/v rows now (the first task), the rest after q/k/v
    const int off0 = stage_layer(0, 0, P_WO, 0);
#else
    stage_layer(0, 0, NP, 0);
#endif
#if MLP_PAIR
    cluster_wait();
#endif
    for (int l = 0; l < NL; l++) {
        const int* T = stypes + l * 7;
        kv_t* kc = cache + (usize)l * 2 * NKV * MAXSEQ * HD;  // [NKV][MAXSEQ][HD]
        kv_t* vc = kc + (usize)NKV * MAXSEQ * HD;
        const u8** wp = where[l & 1];
        // the other staging area is free (layer l - 1 is done with it): the next layer into it
        auto stage_next = [&]() {
            __syncthreads();
            if (l + 1 < NL) {
                stage_layer(l + 1, 0, NP, 0);
            } else {  // (OUT_STAGE: the output rows' codes that fit, else nothing)
                const u8* o0 = out_w + (usize)DIM * out_r0;
                for (int j = threadIdx.x * 16; j < (out_rs - out_r0) * DIM; j += THREADS * 16)
                    cp_async16(out_area + j, o0 + j);
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
            BLOCK_MARK(4)
        };
        if (l == NL - OUT_PREFETCH) {
#if OUT_Q8X
            const usize rb = DIM;  // (the codes; then the scales)
            const u8* sc0 = (const u8*)(out_sc + (usize)out_r0 * (DIM / 32));
            for (usize j = threadIdx.x * 128; j < (usize)(out_r1 - out_r0) * DIM / 8; j += THREADS * 128)
                prefetch_l2(sc0 + j);
#else
            const usize rb = row_bytes(otype, DIM);
#endif
            const u8* o0 = out_w + rb * out_r0;
            for (usize j = threadIdx.x * 128; j < rb * (out_r1 - out_r0); j += THREADS * 128) prefetch_l2(o0 + j);
        }
        // ---- RmsNorm of the residual, q/k/v tasks
        if (l > 0) {  // (layer 0: the embedding row, read at the start)
#if XRES
            BLOCK_MARK(5)
            read_layer_res(A, l, res_in);
#else
            wait_count(mlp_done + l - 1, MLP_BLOCKS);
            BLOCK_MARK(5)
            read_sum(sum_at(A, 2 * l), res_in);
#endif
        }
        if (b == 0) MARK(NMARK * l);
        BLOCK_MARK(0)
        staged();
        norm_for_dots(res_in, (const float*)wp[0], xs, red);
        const float f_qkv = LATE_EARLY ? late_factor(red) : 0.f;  // (off the dots' critical path)
        if (b == 0) MARK(NMARK * l + 1);
#pragma unroll
        for (int k = 0; k < MAXQ; k++) {
            const int task = b + k * gridDim.x;
            if (task >= QKV_T) break;
            const int pr = task * QPB, g = pr / PAIRS_G, r = pr % PAIRS_G;
            const int seg = r / (HD / 2), i0 = r % (HD / 2);
            const int which = seg < GQA ? W_Q : seg == GQA ? W_K : W_V;
            const int head = seg < GQA ? g * GQA + seg : g;
            const int t = layer_type(T, which);
            const usize rb = row_bytes(t, DIM);
            // pair j's two rows (x0, x1) -> RoPE (q, k) -> q, k or v as tagged words (XCHG) or
            // q into qbuf; k or v into the cache
            auto store_pair = [&](int j, float x0, float x1) {
                const int i = i0 + j;
                if (which != W_V) {
                    const float c = rope_c[i], sn = rope_s[i];
                    const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
                    x0 = y0;
                    x1 = y1;
                }
                const int r0 = NEOX ? i : 2 * i, r1 = r0 + (NEOX ? HD / 2 : 1);
#if XCHG  // q, k, v as tagged words for this step's attention; k, v into the cache for later
                u64* X = xchg + (usize)l * XQKV + (which == W_Q ? 0 : which == W_K ? NH * HD
                                                                  : (NH + NKV) * HD) + head * HD;
                put_tagged(X + r0, tag, x0);
                put_tagged(X + r1, tag, x1);
                if (which == W_Q) return;
#endif
#if KV_HALF  // (XCHG=0: q as floats; k, v as halves)
                if (which == W_Q) {
                    qbuf[head * HD + r0] = x0;
                    qbuf[head * HD + r1] = x1;
                    return;
                }
                kv_t* dst = (which == W_K ? kc : vc) + ((usize)head * MAXSEQ + pos) * HD;
                dst[r0] = to_kv(x0);
                dst[r1] = to_kv(x1);
#else
                float* dst = which == W_Q ? qbuf + head * HD
                                          : (which == W_K ? kc : vc) + ((usize)head * MAXSEQ + pos) * HD;
                dst[r0] = x0;
                dst[r1] = x1;
#endif
            };
            const u8 *b0 = wp[P_QKV + 2 * k], *b1 = wp[P_QKV + 2 * k + 1];
#if FLAT_DOTS && THREADS % (2 * QPB) == 0
            {  // row r: pair r / 2's first or second row
                float* y = S + THREADS;
                flat_dots<DIM, 2 * QPB, LAYER_TYPES>(
                    [&](int r) { return NEOX ? (r & 1 ? b1 : b0) + rb * (r >> 1) : b0 + rb * r; },
                    [&](int) { return t; }, xs, S, y);
                if (threadIdx.x < QPB) {
                    const float f = LATE_EARLY ? f_qkv : late_factor(red);
                    store_pair(threadIdx.x, f * y[2 * threadIdx.x], f * y[2 * threadIdx.x + 1]);
                }
            }
#else
            for (int j = warp; j < QPB; j += WARPS) {
                const u8* rows[2] = {NEOX ? b0 + rb * j : b0 + rb * 2 * j,
                                     NEOX ? b1 + rb * j : b0 + rb * (2 * j + 1)};
                float y2[2];
                rows_dot<DIM, 2, LAYER_TYPES>(t, rows, xs, lane, y2);
                const float f = late_factor(red);
                if (lane == 0) store_pair(j, f * y2[0], f * y2[1]);
            }
#endif
#if XCHG
            __syncthreads();
#else
            signal_n(qkv_cnt + l * NKV + g, QPB);
#endif
        }
        if (b == 0) MARK(NMARK * l + 2);
        BLOCK_MARK(1)
#if STAGE0_SPLIT
        if (l == 0) stage_layer(0, P_WO, NP, off0);  // wo, MLP, keys and values
#endif
        if (!att) stage_next();  // (it waits for the heads next)

        // ---- attention: the task's query heads (one, or the KV head's GQA) over the split
        // [t0, t1) of its KV head's positions; then head h's merged output and its share of wo
        if (att) {
#if !XCHG
            const kv_t* kh = kc + (usize)kvh * MAXSEQ * HD;  // (XCHG: the new rows as tagged words)
            const kv_t* vh = vc + (usize)kvh * MAXSEQ * HD;
            wait_count(qkv_cnt + l * NKV + kvh, PAIRS_G);
#endif
#if STAGE0_SPLIT
            if (l == 0) staged();  // (layer 0's second part: the only group in flight)
#endif
            if (b == 0) MARK(NMARK * l + 3);
            const float scale = 1.0f / sqrtf((float)HD);
            // the task's NQ heads (1, or HPT from GROUP_FROM positions): code made for each
            // count, so that a task of one head runs the code it had without KV_GROUP
            u64* PX = xchg + (usize)NL * XQKV + (usize)l * XPART;  // (XCHG: the partials)
            (void)PX;
            auto attend = [&](auto nq_c) {
                constexpr int NQ = decltype(nq_c)::value;
                const int hq0 = NQ > 1 ? kvh * GQA : h;            // the first of the NQ heads
                const int sg = NQ > 1 ? (h % GQA) * ns + s : s;  // the task's split of nsg
                // the heads' q, and the key and value rows at the position when it is in the
                // split (written by this step's q/k/v tasks: read from L2); the rows before it
                // are staged
                if (threadIdx.x < HD) {
                    const int d = threadIdx.x;
                    float qd[NQ], kd = 0.f, vd = 0.f;
#if XCHG
                    const u64* X = xchg + (usize)l * XQKV;
                    if (tc < t1) {
                        const u64* w[NQ + 2];
#pragma unroll
                        for (int i = 0; i < NQ; i++) w[i] = X + (hq0 + i) * HD + d;
                        w[NQ] = X + (NH + kvh) * HD + d;
                        w[NQ + 1] = X + (NH + NKV + kvh) * HD + d;
                        float v[NQ + 2];
                        get_tagged<NQ + 2>(w, tag, v);
#pragma unroll
                        for (int i = 0; i < NQ; i++) qd[i] = v[i];
                        kd = v[NQ];
                        vd = v[NQ + 1];
                    } else {
                        const u64* w[NQ];
#pragma unroll
                        for (int i = 0; i < NQ; i++) w[i] = X + (hq0 + i) * HD + d;
                        get_tagged<NQ>(w, tag, qd);
                    }
#else  // (NQ 1)
                    qd[0] = __ldcg(qbuf + h * HD + d);
                    if (tc < t1) {
                        kd = from_kv(__ldcg(kh + (usize)pos * HD + d));
                        vd = from_kv(__ldcg(vh + (usize)pos * HD + d));
                    }
#endif
#pragma unroll
                    for (int i = 0; i < NQ; i++) qv[i * HD + d] = qd[i] * scale;
                    knew[d] = to_kv(kd);  // (rounded as the cache holds them)
                    vnew[d] = to_kv(vd);
                }
                __syncthreads();
                const kv_t* kst = (const kv_t*)wp[P_KV];  // rows [t0, tc): shared memory, or the cache
                const kv_t* vst = (const kv_t*)wp[P_KV + 1];
                // eight lanes per position, lane sub holding float4s sub, sub + 8, ... of the row: a
                // warp's load reads four whole 128-byte runs of key rows (shared memory: no
                // conflicts), each key row loaded once for the NQ heads; head i's scores at S + i len
                float mx[NQ];
                {
                    const int sub = lane & 7;
                    float4 qr[NQ][HD / 32];
#pragma unroll
                    for (int i = 0; i < NQ; i++) {
                        mx[i] = NEG_INF;
#pragma unroll
                        for (int j = 0; j < HD / 32; j++) qr[i][j] = ((const float4*)(qv + i * HD))[sub + 8 * j];
                    }
#pragma unroll(kScoreUnroll)
                    for (int tb = t0 + 4 * warp; tb < t1; tb += 4 * WARPS) {  // (warp-uniform)
                        const int t = tb + (lane >> 3);
                        const bool ok = t < t1;
                        const int tt = ok ? t : tb;
                        const kv4_t* k4 = (const kv4_t*)(tt < tc ? kst + (usize)(tt - t0) * HD : knew) + sub;
                        float sc[NQ];
#pragma unroll
                        for (int i = 0; i < NQ; i++) sc[i] = 0.f;
#pragma unroll
                        for (int j = 0; j < HD / 32; j++) {
                            const float4 kk = kv4(k4[8 * j]);
#pragma unroll
                            for (int i = 0; i < NQ; i++)
                                sc[i] += qr[i][j].x * kk.x + qr[i][j].y * kk.y + qr[i][j].z * kk.z + qr[i][j].w * kk.w;
                        }
#pragma unroll
                        for (int i = 0; i < NQ; i++) {
#pragma unroll
                            for (int o = 1; o < 8; o <<= 1) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], o);
                            if (ok && sub == 0) S[i * len + t - t0] = sc[i];
                            if (ok) mx[i] = fmaxf(mx[i], sc[i]);
                        }
                    }
                }
                block_reduce_n<NQ, true>(mx, red);
                float sum[NQ];
#pragma unroll
                for (int i = 0; i < NQ; i++) sum[i] = 0.f;
#if !EXP_VALUES
                for (int t = threadIdx.x; t < t1 - t0; t += THREADS) {
#pragma unroll
                    for (int i = 0; i < NQ; i++) {
                        const float p = expf(S[i * len + t] - mx[i]);
                        S[i * len + t] = p;
                        sum[i] += p;
                    }
                }
#if SUM_LATE  // (the sums are needed only after the values: their warp sums go with them)
                __syncthreads();  // S published
#else
                block_reduce_n<NQ, false>(sum, red);  // (its barriers also publish S)
#endif
#endif
#if SUM_LATE
                float* wsum = qv;  // the warps' sums (qv is dead once the scores are in)
#endif
                if (b == 0) MARK(NMARK * l + 4);
                {  // the weighted values as the scores: eight lanes per position, HD / 8 dims each
                    const int sub = lane & 7;
                    float4 o[NQ][HD / 32];
#pragma unroll
                    for (int i = 0; i < NQ; i++)
#pragma unroll
                        for (int j = 0; j < HD / 32; j++) o[i][j] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll(NQ > 1 ? kValueUnroll : 4)
                    for (int tb = t0 + 4 * warp; tb < t1; tb += 4 * WARPS) {
                        const int t = tb + (lane >> 3);
                        float p[NQ];
#pragma unroll
                        for (int i = 0; i < NQ; i++) {
#if EXP_VALUES  // (a position's eight lanes each take its exponential; one lane adds it)
                            p[i] = t < t1 ? expf(S[i * len + t - t0] - mx[i]) : 0.f;
                            if (sub == 0) sum[i] += p[i];
#else
                            p[i] = t < t1 ? S[i * len + t - t0] : 0.f;
#endif
                        }
                        const int tt = t < t1 ? t : tb;
                        const kv4_t* v4 = (const kv4_t*)(tt < tc ? vst + (usize)(tt - t0) * HD : vnew) + sub;
#pragma unroll
                        for (int j = 0; j < HD / 32; j++) {
                            const float4 vv = kv4(v4[8 * j]);
#pragma unroll
                            for (int i = 0; i < NQ; i++) {
                                o[i][j].x += p[i] * vv.x;
                                o[i][j].y += p[i] * vv.y;
                                o[i][j].z += p[i] * vv.z;
                                o[i][j].w += p[i] * vv.w;
                            }
                        }
                    }
#pragma unroll
                    for (int i = 0; i < NQ; i++)
#pragma unroll
                        for (int j = 0; j < HD / 32; j++) {  // the warp's four position groups summed
#pragma unroll
                            for (int off = 8; off < 32; off <<= 1) {
                                o[i][j].x += __shfl_xor_sync(0xffffffffu, o[i][j].x, off);
                                o[i][j].y += __shfl_xor_sync(0xffffffffu, o[i][j].y, off);
                                o[i][j].z += __shfl_xor_sync(0xffffffffu, o[i][j].z, off);
                                o[i][j].w += __shfl_xor_sync(0xffffffffu, o[i][j].w, off);
                            }
                        }
#if SUM_LATE  // (block_reduce_n's order: the warp sums, then warps_total after the barrier below)
#pragma unroll
                    for (int i = 0; i < NQ; i++) {
                        const float w = warp_sum(sum[i]);
                        if (lane == 0) wsum[i * WARPS + warp] = w;
                    }
#endif
                    if (lane < 8)
#pragma unroll
                        for (int i = 0; i < NQ; i++)
#pragma unroll
                            for (int j = 0; j < HD / 32; j++) ((float4*)(oacc + (warp * NQ + i) * HD))[sub + 8 * j] = o[i][j];
                }
                __syncthreads();
#if SUM_LATE
#pragma unroll
                for (int i = 0; i < NQ; i++) sum[i] = warps_total(wsum + i * WARPS);
#endif
#if XCHG
                // the heads' partials (max, sum, HD weighted values) as tagged words at split sg
                // of each head's nsg; one split of one head (nsg 1): the output itself
                for (int k = threadIdx.x; k < NQ * HD; k += THREADS) {
                    const int i = k / HD, d = k % HD;
                    float v = 0.f;
                    for (int w = 0; w < WARPS; w++) v += oacc[(w * NQ + i) * HD + d];
                    if (nsg == 1)
                        ovec[d] = v / sum[0];
                    else
                        put_tagged(PX + ((usize)(hq0 + i) * NSMAX * HPT + sg) * (HD + 2) + 2 + d, tag, v);
                }
                if (nsg > 1 && threadIdx.x < NQ) {
                    u64* P = PX + ((usize)(hq0 + threadIdx.x) * NSMAX * HPT + sg) * (HD + 2);
                    float m = mx[0], z = sum[0];
#pragma unroll
                    for (int i = 1; i < NQ; i++)
                        if (threadIdx.x == i) m = mx[i], z = sum[i];
                    put_tagged(P, tag, m);
                    put_tagged(P + 1, tag, z);
                }
#else
                for (int d = threadIdx.x; d < HD; d += THREADS) {
                    float v = 0.f;
                    for (int w = 0; w < WARPS; w++) v += oacc[w * HD + d];
                    ovec[d] = ns == 1 ? v / sum[0] : v;
                }
                if (b == 0) MARK(NMARK * l + 5);
                if (ns > 1) {  // publish the partial; once all are in, every split merges them
                    float* P = part + ((usize)h * NSMAX + s) * (HD + 2);
                    for (int d = threadIdx.x; d < HD; d += THREADS) P[2 + d] = ovec[d];
                    if (threadIdx.x == 0) {
                        P[0] = mx[0];
                        P[1] = sum[0];
                    }
                    signal(head_cnt + l * NH + h);
                    wait_count(head_cnt + l * NH + h, ns);
                    const float* P0 = part + (usize)h * NSMAX * (HD + 2);
                    for (int i = threadIdx.x; i < ns * (HD + 2); i += THREADS) S[i] = __ldcg(P0 + i);
                    __syncthreads();
                    merge_partials(S, ns, oacc, ovec);
                }
#endif
            };
            if (grouped)
                attend(IntC<HPT>{});
            else
                attend(IntC<1>{});
#if XCHG
            if (b == 0) MARK(NMARK * l + 5);
            BLOCK_MARK(6)
            const u64* PH = PX + (usize)h * NSMAX * HPT * (HD + 2);  // head h's partials
#if MERGE_DIRECT
            if (nsg > 1 && nsg <= MERGE_DIRECT) {  // a thread a dim: its words of every split, merged
                if (threadIdx.x < HD) {                // at once (merge_partials' serial sums)
                    const u64* w[3 * MERGE_DIRECT];
#pragma unroll
                    for (int j = 0; j < MERGE_DIRECT; j++) {  // (splits past nsg: split nsg - 1 again)
                        const u64* P = PH + min(j, nsg - 1) * (HD + 2);
                        w[3 * j] = P;
                        w[3 * j + 1] = P + 1;
                        w[3 * j + 2] = P + 2 + threadIdx.x;
                    }
                    float v[3 * MERGE_DIRECT];
                    get_tagged<3 * MERGE_DIRECT>(w, tag, v);
                    ovec[threadIdx.x] = merge_dim<MERGE_DIRECT>(nsg, [&](int j, int k) { return v[3 * j + k]; });
                }
            } else
#endif
            if (nsg > 1) {  // head h's nsg partials gathered into S (free after the values), merged
                const int n = nsg * (HD + 2);
                if (n <= THREADS) {  // (a word a thread: as before KV_GROUP, measured equal)
                    if (threadIdx.x < n) {
                        const u64* const w1[1] = {PH + threadIdx.x};
                        float v1[1];
                        get_tagged<1>(w1, tag, v1);
                        S[threadIdx.x] = v1[0];
                    }
                } else {
                    constexpr int K = (NSMAX * HPT * (HD + 2) + THREADS - 1) / THREADS;
                    const u64* w[K];  // a thread's words, all loads in flight together
#pragma unroll
                    for (int k = 0; k < K; k++) w[k] = PH + min(threadIdx.x + k * THREADS, n - 1);
                    float v[K];
                    get_tagged<K>(w, tag, v);
#pragma unroll
                    for (int k = 0; k < K; k++)
                        if (threadIdx.x + k * THREADS < n) S[threadIdx.x + k * THREADS] = v[k];
                }
                __syncthreads();
                merge_partials(S, nsg, oacc, ovec);
            }
#endif
            __syncthreads();
            if (b == 0) MARK(NMARK * l + 6);
            BLOCK_MARK(7)
            const int to = layer_type(T, W_O);
            slab_rows_add<HD, WO_THREADS>(to, wp[P_WO], row_bytes(to, HD), 0, ovec, h == 0 ? res_in : nullptr,
                              A + (usize)(2 * l + 1) * DIM, wo_r0, wo_r1);
#if XRES
            __syncthreads();
#else
            signal(attn_done + l);
#endif
            if (b == 0) MARK(NMARK * l + 7);
            if (!mlp) stage_next();  // (it waits for the next layer's residual next)
        }

        // ---- MLP tasks: RmsNorm, gate and up of CHUNK units, SwiGLU, their share of down
        if (mlp) {
#if XRES
            read_res<RES_LEAD_MID>(A + (usize)(2 * l + 1) * DIM, NH, res_in);
            if (b == MLP_FIRST) MARK(NMARK * l + 8);
            BLOCK_MARK(2)
#else
            wait_count(attn_done + l, NH * ns);
            if (b == MLP_FIRST) MARK(NMARK * l + 8);
            BLOCK_MARK(2)
            read_sum(sum_at(A, 2 * l + 1), res_in);
#endif
#if STAGE0_SPLIT
            if (l == 0) {  // layer 0's second part (layer 1's may be in flight after it)
                asm volatile("cp.async.wait_group 1;" ::: "memory");
                __syncthreads();
            }
#endif
            norm_for_dots(res_in, (const float*)wp[1], xs, red);
            const float f_mlp = LATE_EARLY ? late_factor(red) : 0.f;
            if (b == MLP_FIRST) MARK(NMARK * l + 9);
            const int tg = layer_type(T, W_GATE), tu = layer_type(T, W_UP), td = layer_type(T, W_DOWN);
            const usize rg = row_bytes(tg, DIM), ru = row_bytes(tu, DIM), sbd = row_bytes(td, 32);
#pragma unroll
            for (int ci = 0; ci < MAXCH; ci++) {
                const int c = mb + ci * MLP_BLOCKS;
                if (c >= NMLP_T) break;
                const u8 *gw = wp[P_MLP + 3 * ci], *uw = wp[P_MLP + 3 * ci + 1];
                // unit u's silu(gate) * up: into gsm[u], or (MLP_PAIR) as a tagged word into
                // both blocks of the pair, a buffer by turns
                const u32 mtag = (tag * NL + l) * MAXCH + ci;
                auto publish = [&](int u, float a, float up) {
                    const float g = a / (1.0f + expf(-a)) * up;
#if MLP_PAIR
                    put_both(MBOX + 2 * CHUNK * (ci & 1) + CHUNK * (c & 1) + u,
                             ((u64)mtag << 32) | __float_as_uint(g));
#else
                    gsm[u] = g;
#endif
                };
#if FLAT_DOTS
                {  // rows 0 .. CHUNK - 1: gate, CHUNK .. 2 CHUNK - 1: up
                    float* y = S + THREADS;
#if GU_JOINT
                    if (tg == tu) {
                        QLIB_DISPATCH(LAYER_TYPES, tg, (gate_up_joint<DIM, T_>(gw, uw, rg, ru, xs, S, y)))
                    } else
#endif
                    flat_dots<DIM, 2 * CHUNK, LAYER_TYPES>(
                        [&](int r) { return r < CHUNK ? gw + rg * r : uw + ru * (r - CHUNK); },
                        [&](int r) { return r < CHUNK ? tg : tu; }, xs, S, y);
                    if (threadIdx.x < CHUNK) {
                        const float f = LATE_EARLY ? f_mlp : late_factor(red);
                        publish(threadIdx.x, f * y[threadIdx.x], f * y[CHUNK + threadIdx.x]);
                    }
                }
#else
                for (int u = warp; u < CHUNK; u += WARPS) {
                    float ab[2];
                    if (tg == tu) {
                        const u8* rows[2] = {gw + rg * u, uw + ru * u};
                        rows_dot<DIM, 2, LAYER_TYPES>(tg, rows, xs, lane, ab);
                    } else {
                        ab[0] = row_dot<DIM, LAYER_TYPES>(tg, gw + rg * u, xs, lane);
                        ab[1] = row_dot<DIM, LAYER_TYPES>(tu, uw + ru * u, xs, lane);
                    }
                    const float f = late_factor(red);
                    if (lane == 0) publish(u, f * ab[0], f * ab[1]);
                }
#endif
#if MLP_PAIR  // the pair's 2 CHUNK values, once both blocks' words are in
                if (threadIdx.x < 2 * CHUNK)
                    gsm[threadIdx.x] = get_shared_tagged(MBOX + 2 * CHUNK * (ci & 1) + threadIdx.x, mtag);
#endif
                __syncthreads();
                if (b == MLP_FIRST && ci == 0) MARK(NMARK * l + 10);
#if MLP_PAIR  // this block's half of the rows, the pair's 2 CHUNK columns
                slab_rows_add<2 * CHUNK>(td, wp[P_MLP + 3 * ci + 2], sbd, 0, gsm,
                                         c < 2 ? res_in : nullptr, layer_res_copy(A, l, c >> 1),
                                         (c & 1) ? PAIR_HALF : 0, (c & 1) ? DIM : PAIR_HALF);
#else
                slab_rows_add<CHUNK>(td, wp[P_MLP + 3 * ci + 2], sbd, CHUNK * (c & 1), gsm,
                                     c == 0 ? res_in : nullptr, layer_res_copy(A, l, c));
#endif
                __syncthreads();
            }
#if XRES
            __syncthreads();
#else
            signal(mlp_done + l);
#endif
            if (b == MLP_FIRST) MARK(NMARK * l + 11);
            BLOCK_MARK(3)
            if (att) stage_next();
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");

    // ---- every block: the output layer and the argmax
#if XRES
    read_layer_res(A, NL, res_in);
#else
    wait_count(mlp_done + NL - 1, MLP_BLOCKS);
    read_sum(sum_at(A, 2 * NL), res_in);
#endif
    if (b == 0) OUT_MARK(0);
    norm_for_dots(res_in, out_norm, xs, red);
    if (b == 0) OUT_MARK(1);
#if OUT_Q8X
    const u64 mine = output_rows_q8x<DIM>(out_w, out_sc, xs, red, logits, out_r0, out_r1, warp, lane,
                                          out_area, out_rs);
#elif OUT_LANES
    const u64 mine = output_rows_lanes<DIM, OUT_TYPES>(otype, out_w, xs, red, logits, out_r0, out_r1, warp, lane);
#else
    const u64 mine = output_rows<DIM, 4, OUT_TYPES>(otype, out_w, xs, red, logits, out_r0, out_r1, warp, lane);
#endif
#ifdef QLIB_STAGE_TIMES
    if (b == 0) {
        __syncthreads();
        OUT_MARK(2);
    }
#endif
    {  // the block's largest key (its warps' through S, free now): one atomicMax a block on the
       // one word, not one a warp (12 x 132 atomics queued on one address)
        u64* keys = (u64*)S;  // (8-aligned: 2 DIM + 5 HD floats after a 16-aligned start)
        if (lane == 0) keys[warp] = mine;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 top = 0ull;
#pragma unroll
            for (int w = 0; w < WARPS; w++) top = keys[w] > top ? keys[w] : top;
            if (top) atomicMax(best + par, top);
        }
    }
    const u32 old = arrive(done);  // (its release orders thread 0's atomicMax before the count)
    if (threadIdx.x == 0 && old == gridDim.x - 1) {  // the last block: every argmax is in
        u64 key;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(key) : "l"(best + par) : "memory");
        const long long token = (long long)(0xffffffffu - (u32)(key & 0xffffffffu));
        *out_tok = token;
        *pos_p = pos + 1;
        if (host_out)  // mapped host memory: the count of steps done (mod 2^32) and the token as
                       // one word, one 8-byte store (no fence between two words), in the slot of
                       // this step's parity (so a host one step behind reads it)
            host_out[step_no & 1u] = (long long)(((u64)(step_no + 1u) << 32) | (u32)token);
        MARK(NMARK * NL + 1);
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(steps) : "memory");
    }
}
