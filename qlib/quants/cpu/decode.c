/* qlib CPU decode step in one C call: a list of prepared steps (the GEMVs of kernels.c and
 * kquants.c, the decode attention of attn.c, a mixture of experts' routing with its chosen
 * experts' GEMVs and their weighted sum, y += x of n floats: a projection's bias), built once
 * by ops' plans, run in order.
 *
 * mode 0: each step is its kernel's entry point (qlib_qgemm_ex with m = 1, qlib_kgemm,
 *         qlib_attn_decode_kv), one after the other: what the Python loop of prepared calls
 *         does, without its ~4 us of ctypes per call.
 * mode 1: ONE OpenMP parallel region for the whole list; each step is its kernel's in-region
 *         twin (qlib_qgemv_region, qlib_kgemv_region, qlib_attn_decode_region), which shares
 *         its loop out over the team and ends with a barrier, instead of a fork and a join
 *         per call; each thread quantizes a GEMV's input row itself (no barrier before the
 *         loop), the SwiGLU of the down GEMV's input is split over the team (scalar expf,
 *         ~8 us a layer alone); the scratch is allocated once per call of the list.
 * Both compute every output element with the same code in the same order as the separate
 * calls (the same row groups, the same attention pieces), so the results are bit-identical.
 * In mode 1 each thread also prefetches, before a step, the first groups of its share of the
 * next GEMV into L2 (qlib_decode_prefetch_groups), so that no GEMV starts on a cold read.
 * The position and the RoPE rows are read through pointers at each run (ops.DecodePosition).
 * Returns 0, or -1 (a step's arguments, out of memory: nothing is run then in mode 1). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

enum { STEP_QGEMV = 1, STEP_KGEMV = 2, STEP_ATTN = 3, STEP_MOE = 4, STEP_ADD = 5 };
/* kernels.c's and kquants.c's QLIB_PANELS: a Q4_0 / Q4_1 / Q8_0 / Q4_K weight as 16-row panels */
enum { PANELS = 64 };
/* the most experts a STEP_MOE routes over */
enum { MAX_EXPERTS = 256 };

/* one step; ops.DecodeStepC mirrors it field for field */
typedef struct qlib_step {
    int kind, type;
    const void *w;                  /* codes (planes) or GGUF blocks */
    const void *d, *m;              /* planes: f16 scales, Q4_1 minimums */
    int n, k;                       /* GEMV: rows, row length */
    const float *x;                 /* GEMV input, or the attention's qkv */
    float *y;                       /* GEMV output, or the attention's output */
    const float *norm;              /* RmsNorm weight or NULL */
    float eps;
    int swiglu, accumulate;
    void *kc, *vc;                  /* attention: the caches of the layer */
    const int *pos;                 /* attention: the position (read at each run) */
    const float *const *cos_row;    /* attention: the RoPE rows of the position */
    const float *const *sin_row;
    int n_head, n_kv, head_dim, max_seq, neox, kv_f16, split;
    /* a mixture of experts' FFN (STEP_MOE): x the router's logits (n experts), y the residual
     * (k floats, +=); expert e's GEMV steps are experts[first[e] .. first[e + 1]), its output
     * outs[e]; the token's n_used experts (ascending) and their weights go into chosen and
     * weights */
    const struct qlib_step *experts;
    const int *first;
    float *const *outs;
    int *chosen;
    float *weights;
    int n_used;
} qlib_step;

int qlib_qgemm_ex(int type, const uint8_t *codes, const uint16_t *dw, const uint16_t *mw,
                  int n, int k, const float *x, int m, float *y, const float *norm_w,
                  float eps, int swiglu, int accumulate);
int qlib_kgemm(int type, const uint8_t *w, int n, int k, const float *x, int m, float *y,
               const float *norm_w, float eps, int swiglu, int accumulate);
int qlib_attn_decode_kv(float *qkv, void *kc, void *vc, int pos, int n_head, int n_kv, int d,
                        int max_seq, const float *cos, const float *sin, int neox, float *out,
                        int kv_f16, int split);
int qlib_float_type(int type);
size_t qlib_qgemv_scratch(int k);
size_t qlib_qgemv_m_row_bytes(int type, int k);
size_t qlib_kgemv_scratch(int k);
size_t qlib_attn_region_floats(int pos, int n_head, int n_kv, int d, int split, int nth,
                               int max_threads, int kv_f16);
void qlib_qgemv_region(int type, const uint8_t *codes, const uint16_t *dw, const uint16_t *mw,
                       int n, int k, const float *x, float *y, const float *norm_w, float eps,
                       int swiglu, int accumulate, uint8_t *scratch, float *shared);
void qlib_kgemv_region(int type, const uint8_t *w, int n, int k, const float *x, float *y,
                       const float *norm_w, float eps, int swiglu, int accumulate,
                       uint8_t *scratch, float *shared);
void qlib_attn_decode_region(float *qkv, void *kc, void *vc, int pos, int n_head, int n_kv,
                             int d, int max_seq, const float *cos, const float *sin, int neox,
                             float *out, int kv_f16, int split, int max_threads, float *buf);

size_t qlib_kgemv_row_bytes(int type, int k);
size_t qlib_panel_bytes(int type, int k);

/* Where a region run's time goes (tools/cpu_decode_profile.py; NULL, the default: nothing
 * kept): thread 0 adds each step's seconds into qlib_decode_times[i], read after the step's
 * closing barrier (the next step's prefetch of its first groups included). */
static double *qlib_decode_times;
void qlib_decode_set_times(double *times) { qlib_decode_times = times; }

/* Groups of 4 rows of the next GEMV that each thread prefetches before a step (an A/B hook,
 * qlib_decode_set_prefetch; 0: none). */
int qlib_decode_prefetch_groups = 8;
void qlib_decode_set_prefetch(int groups) { qlib_decode_prefetch_groups = groups; }

/* The first qlib_decode_prefetch_groups groups of thread t's share of GEMV s into L2: the
 * static schedule's contiguous ranges (the first items % nth threads one item more), the codes
 * and, for the planes, their scales and minimums; for panels (type & PANELS) as many rows'
 * panels.
 * A hint only: nothing depends on it. */
static void prefetch_share(const qlib_step *s, int t, int nth) {
    const int groups = qlib_decode_prefetch_groups;
    if (groups <= 0 || (s->kind != STEP_QGEMV && s->kind != STEP_KGEMV)) return;
    if (s->kind == STEP_KGEMV && (s->type & PANELS)) return; /* Q4_K panels: one stream, none */
    const int panels = s->kind == STEP_QGEMV && (s->type & PANELS);
    const int rows_per = panels ? 16 : 4, items = (s->n + rows_per - 1) / rows_per;
    const int q = items / nth, r = items % nth;
    const int first = t * q + (t < r ? t : r), count = q + (t < r);
    const int want = (4 * groups + rows_per - 1) / rows_per;
    const int rows = rows_per * (count < want ? count : want), j = rows_per * first;
    if (rows <= 0) return;
    size_t row_bytes;
    if (panels) {
        row_bytes = qlib_panel_bytes(s->type, s->k) / 16; /* codes, d and m of a row */
    } else if (s->kind == STEP_QGEMV) {
        row_bytes = s->type == 8 ? (size_t)s->k : (size_t)s->k / 2; /* Q8_0 : Q4_*, Q5_* */
        const size_t planes = sizeof(uint16_t) * (size_t)(s->k / 32);
        const size_t mplanes = qlib_qgemv_m_row_bytes(s->type, s->k); /* minimums, qh words */
        for (size_t off = 0; off < planes * rows; off += 64)
            _mm_prefetch((const char *)s->d + planes * j + off, _MM_HINT_T1);
        if (s->m)
            for (size_t off = 0; off < mplanes * rows; off += 64)
                _mm_prefetch((const char *)s->m + mplanes * j + off, _MM_HINT_T1);
    } else {
        row_bytes = qlib_kgemv_row_bytes(s->type, s->k);
        if (!row_bytes) return; /* float rows: not prefetched here */
    }
    const char *w = (const char *)s->w + row_bytes * j;
    for (size_t off = 0; off < row_bytes * rows; off += 64) _mm_prefetch(w + off, _MM_HINT_T1);
}

/* the checks of the kernels' entry points (ops checked the shapes at plan time) */
static int step_ok(const qlib_step *s) {
    switch (s->kind) {
    case STEP_QGEMV: { /* planes, or Q4_0 / Q4_1 / Q8_0 / IQ4_NL / MXFP4H (61) / NVFP4H (62) /
                        * Q1_0H (63) panels (| PANELS), n % 16 == 0 */
        const int t = s->type & ~PANELS;
        if (s->type & PANELS)
            return s->k % 64 == 0 && s->n % 16 == 0 &&
                   (t == 2 || t == 3 || t == 8 || t == 20 || (t >= 61 && t <= 63));
        return s->k % 64 == 0 && (t == 2 || t == 3 || t == 6 || t == 7 || t == 8);
    }
    case STEP_KGEMV: /* GGUF blocks (Q2_K..Q6_K, IQ4_XS), X4 / X3 blocks (60, 59), or Q4_K / IQ4_XS
                      * panels (| PANELS) */
        if (s->type == (12 | PANELS) || s->type == (23 | PANELS))
            return s->k % 256 == 0 && s->n % 16 == 0;
        return qlib_float_type(s->type) ? s->k % 64 == 0
                                        : ((s->type >= 10 && s->type <= 14) || s->type == 23 ||
                                           s->type == 60 || s->type == 59) &&
                                              s->k % 256 == 0;
    case STEP_ATTN:
        return s->head_dim % 16 == 0 && s->head_dim <= 128 && s->n_head % s->n_kv == 0;
    case STEP_ADD:
        return s->n >= 0;
    case STEP_MOE: /* its experts' steps: GEMVs only */
        if (s->n < 1 || s->n > MAX_EXPERTS || s->n_used < 1 || s->n_used > s->n) return 0;
        for (int i = 0; i < s->first[s->n]; i++)
            if (s->experts[i].kind == STEP_ATTN || s->experts[i].kind == STEP_MOE ||
                !step_ok(&s->experts[i]))
                return 0;
        return 1;
    }
    return 0;
}

/* A token's experts from the router's logits (s->x), as llama.moe.route: the softmax over the
 * n experts in float32 (the maximum subtracted, expf, the sum in index order), the n_used
 * largest (the lower index first on ties), each weight over their running sum in that
 * order; written in ascending expert order (the order their outputs are added in). */
static void moe_route(const qlib_step *s) {
    const int n = s->n, used = s->n_used;
    float p[MAX_EXPERTS], top[MAX_EXPERTS];
    unsigned char taken[MAX_EXPERTS] = {0};
    float mx = s->x[0], sum = 0.0f, total = 0.0f;
    for (int i = 1; i < n; i++) mx = s->x[i] > mx ? s->x[i] : mx;
    for (int i = 0; i < n; i++) sum += p[i] = expf(s->x[i] - mx);
    for (int i = 0; i < n; i++) p[i] = p[i] / sum;
    for (int j = 0; j < used; j++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
        taken[best] = 1;
        total += top[best] = p[best];
    }
    for (int i = 0, j = 0; i < n; i++)
        if (taken[i]) s->chosen[j] = i, s->weights[j++] = top[i] / total;
}

/* y[i0 .. i1) += the chosen experts' outputs times their weights, summed in expert order
 * from zero (llama.moe.combine's additions, each product rounded before its add) */
static void moe_combine(const qlib_step *s, int i0, int i1) {
    for (int i = i0; i < i1; i++) {
        float acc = 0.0f;
        for (int j = 0; j < s->n_used; j++) acc = acc + s->outs[s->chosen[j]][i] * s->weights[j];
        s->y[i] = s->y[i] + acc;
    }
}

/* y[i0 .. i1) += x[i0 .. i1) (STEP_ADD) */
static void add_rows(const qlib_step *s, int i0, int i1) {
    for (int i = i0; i < i1; i++) s->y[i] = s->y[i] + s->x[i];
}

static int run_one(const qlib_step *s) {
    switch (s->kind) {
    case STEP_ADD:
        add_rows(s, 0, s->n);
        return 0;
    case STEP_QGEMV:
        return qlib_qgemm_ex(s->type, s->w, s->d, s->m, s->n, s->k, s->x, 1, s->y, s->norm,
                             s->eps, s->swiglu, s->accumulate);
    case STEP_KGEMV:
        return qlib_kgemm(s->type, s->w, s->n, s->k, s->x, 1, s->y, s->norm, s->eps, s->swiglu,
                          s->accumulate);
    case STEP_ATTN:
        return qlib_attn_decode_kv((float *)s->x, s->kc, s->vc, *s->pos, s->n_head, s->n_kv,
                                   s->head_dim, s->max_seq, *s->cos_row, *s->sin_row, s->neox,
                                   s->y, s->kv_f16, s->split);
    case STEP_MOE:
        moe_route(s);
        for (int j = 0; j < s->n_used; j++)
            for (int i = s->first[s->chosen[j]]; i < s->first[s->chosen[j] + 1]; i++)
                if (run_one(&s->experts[i])) return -1;
        moe_combine(s, 0, s->k);
        return 0;
    }
    return -1;
}

/* a step's bytes of scratch: each thread's (GEMV), the team's shared buffer */
static void scratch_need(const qlib_step *s, int nth, size_t *per_thread, size_t *shared) {
    size_t b = 0;
    if (s->kind == STEP_QGEMV) b = qlib_qgemv_scratch(s->k);
    if (s->kind == STEP_KGEMV) b = qlib_kgemv_scratch(s->k);
    if (b > *per_thread) *per_thread = b;
    b = 0;
    if ((s->kind == STEP_QGEMV || s->kind == STEP_KGEMV) && s->swiglu)
        b = sizeof(float) * (size_t)s->k; /* silu(gate) * up, shared by the team */
    if (s->kind == STEP_ATTN)
        b = sizeof(float) * qlib_attn_region_floats(*s->pos, s->n_head, s->n_kv, s->head_dim,
                                                    s->split, nth, nth, s->kv_f16);
    if (b > *shared) *shared = b;
    if (s->kind == STEP_MOE)
        for (int i = 0; i < s->first[s->n]; i++)
            scratch_need(&s->experts[i], nth, per_thread, shared);
}

/* step s by thread t of the region's team (every in-region kernel ends with a barrier) */
static void region_step(const qlib_step *s, int t, int team, int nth, uint8_t *mine,
                        float *buf) {
    switch (s->kind) {
    case STEP_QGEMV:
        qlib_qgemv_region(s->type, s->w, s->d, s->m, s->n, s->k, s->x, s->y, s->norm, s->eps,
                          s->swiglu, s->accumulate, mine, buf);
        break;
    case STEP_KGEMV:
        qlib_kgemv_region(s->type, s->w, s->n, s->k, s->x, s->y, s->norm, s->eps, s->swiglu,
                          s->accumulate, mine, buf);
        break;
    case STEP_ATTN:
        qlib_attn_decode_region((float *)s->x, s->kc, s->vc, *s->pos, s->n_head, s->n_kv,
                                s->head_dim, s->max_seq, *s->cos_row, *s->sin_row, s->neox, s->y,
                                s->kv_f16, s->split, nth, buf);
        break;
    case STEP_ADD: {
        const int per = (s->n + team - 1) / team, i0 = t * per;
        add_rows(s, i0 < s->n ? i0 : s->n, i0 + per < s->n ? i0 + per : s->n);
#pragma omp barrier
        break;
    }
    case STEP_MOE: { /* the routing on thread 0, the chosen experts' GEMVs, the weighted sum */
        if (t == 0) moe_route(s);
#pragma omp barrier
        const qlib_step *order[s->first[s->n] + 1]; /* the chosen experts' steps in order */
        int count = 0;
        for (int j = 0; j < s->n_used; j++)
            for (int i = s->first[s->chosen[j]]; i < s->first[s->chosen[j] + 1]; i++)
                order[count++] = &s->experts[i];
        for (int i = 0; i < count; i++) {
            if (i + 1 < count) prefetch_share(order[i + 1], t, team);
            region_step(order[i], t, team, nth, mine, buf);
        }
        const int per = (s->k + team - 1) / team, i0 = t * per;
        moe_combine(s, i0 < s->k ? i0 : s->k, i0 + per < s->k ? i0 + per : s->k);
#pragma omp barrier
        break;
    }
    }
}

int qlib_decode_run(const qlib_step *steps, int count, int mode) {
    for (int i = 0; i < count; i++)
        if (!step_ok(&steps[i])) return -1;
    if (mode == 0) {
        for (int i = 0; i < count; i++)
            if (run_one(&steps[i])) return -1;
        return 0;
    }
    const int nth = omp_get_max_threads();
    size_t per_thread = 64, shared = 16; /* bytes: each thread's GEMV scratch, the team's buffer */
    for (int i = 0; i < count; i++) scratch_need(&steps[i], nth, &per_thread, &shared);
    per_thread = (per_thread + 63) / 64 * 64, shared = (shared + 63) / 64 * 64;
    uint8_t *scratch = aligned_alloc(64, per_thread * nth + shared);
    if (!scratch) return -1;
    float *buf = (float *)(scratch + per_thread * nth);
    double *const times = qlib_decode_times;
#pragma omp parallel num_threads(nth)
    {
        /* a team smaller than asked (OMP_DYNAMIC) only shares the same loops out differently */
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        uint8_t *mine = scratch + per_thread * t;
        double last = times && t == 0 ? omp_get_wtime() : 0.0;
        for (int i = 0; i < count; i++) {
            if (i + 1 < count) prefetch_share(&steps[i + 1], t, team);
            region_step(&steps[i], t, team, nth, mine, buf);
            if (times && t == 0) {
                const double now = omp_get_wtime();
                times[i] += now - last;
                last = now;
            }
        }
    }
    free(scratch);
    return 0;
}
