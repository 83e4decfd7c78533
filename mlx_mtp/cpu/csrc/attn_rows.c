/* A verify's attention rows, each in the order of the one-query attention that decode computes,
   reading the KV cache once for all rows (x86-64, AVX2 + FMA).

   Decode's attention on MLX's CPU backend (one query row, no mask: the SDPA fallback) makes, per
   query head, a one-row BLAS product of the scaled query with the keys (cblas_sgemm, M = 1, the
   keys transposed), a softmax over the row (an MLX op), and a one-row product of the
   probabilities with the values (M = 1, N = head_dim, K = keys). With BLIS on AVX2 those
   products reduce each output in a fixed order (checked bitwise by
   mlx_mtp/exactness/row_attention.py, which falls back to decode's own calls where it differs):
     - scores: key columns in whole groups of 8 as the row kernel (row_dot.c): 8 lanes over the
       head dimension, each a sequential fused multiply-add, the lanes added pairwise; the last
       n % 8 columns of a row of n keys by BLIS's other kernels, which a one-row call over those
       keys alone reproduces (that call is made here, through the BLAS MLX is bound to);
     - values: one sequential fused multiply-add per output over the keys in order, from 0.
   Here the w verify rows of every query head of a KV head share one pass over its keys and
   values, each output summed in that order.

   Which keys a row sees: row i sees positions 0..n[i]-1; position s is the base's row s unless
   row i overrides it with a row of `extra` (ov_pos / ov_src, entries ov_start[i]..ov_start[i+1],
   positions increasing). Every position a row sees at or past the base's length, or at or past
   the shortest row's length, must be overridden or shared as below; a full cache's block (the
   base after the block's writes, no overrides), a sliding window's ring (the base after the
   writes, the rows' overwritten entries as overrides) and a draft tree (the base before the
   block, each row's path as overrides) all are. Query rows of a KV head: r = rep * w + i for
   rep < n_rep (GQA: the query heads g * n_rep + rep share KV head g), so q is [G * n_rep, w, D].
   Build with -ffp-contract=off (no fusing but the explicit FMAs). */

#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATTN_ROWS_ABI 1

int attn_rows_abi(void) { return ATTN_ROWS_ABI; }

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef struct {
    ptrdiff_t G, n_rep, w, D;     /* KV heads, query heads per KV head, verify rows, head dim */
    const float *base;            /* [G, base_len, D] at head stride base_stride */
    ptrdiff_t base_len, base_stride;
    const float *extra;           /* [G, E, D] at head stride extra_stride */
    ptrdiff_t E, extra_stride;
    const int32_t *n;             /* keys per row [w] */
    const int32_t *ov_start, *ov_pos, *ov_src; /* overrides, per row */
} layout_t;

/* The key / value row that row i sees at position s of KV head g. */
static const float *seen(const layout_t *L, ptrdiff_t g, ptrdiff_t i, ptrdiff_t s) {
    for (int32_t o = L->ov_start[i]; o < L->ov_start[i + 1]; o++)
        if (L->ov_pos[o] == s) return L->extra + g * L->extra_stride + (ptrdiff_t)L->ov_src[o] * L->D;
        else if (L->ov_pos[o] > s) break;
    return s < L->base_len ? L->base + g * L->base_stride + s * L->D : NULL;
}

static int overridden(const layout_t *L, ptrdiff_t i, ptrdiff_t s) {
    for (int32_t o = L->ov_start[i]; o < L->ov_start[i + 1]; o++)
        if (L->ov_pos[o] == s) return 1;
    return 0;
}

/* Positions where rows may see different rows (overridden somewhere, or past the shortest row),
   sorted; the rest below the longest row are the base's, seen by every row. */
static ptrdiff_t split_positions(const layout_t *L, int32_t *X, ptrdiff_t *min_n, ptrdiff_t *max_n) {
    ptrdiff_t lo = L->n[0], hi = L->n[0], m = 0;
    for (ptrdiff_t i = 1; i < L->w; i++) {
        if (L->n[i] < lo) lo = L->n[i];
        if (L->n[i] > hi) hi = L->n[i];
    }
    for (ptrdiff_t i = 0; i < L->w; i++)
        for (int32_t o = L->ov_start[i]; o < L->ov_start[i + 1]; o++)
            if (L->ov_pos[o] < lo) X[m++] = L->ov_pos[o];
    /* insertion sort and dedupe: a handful of positions */
    for (ptrdiff_t a = 1; a < m; a++)
        for (ptrdiff_t b = a; b > 0 && X[b - 1] > X[b]; b--) {
            int32_t t = X[b]; X[b] = X[b - 1]; X[b - 1] = t;
        }
    ptrdiff_t u = 0;
    for (ptrdiff_t a = 0; a < m; a++)
        if (!u || X[u - 1] != X[a]) X[u++] = X[a];
    *min_n = lo;
    *max_n = hi;
    return u;
}

/* Whether every position a row sees exists (an override, or a base row). */
static int valid(const layout_t *L) {
    if (L->G < 1 || L->n_rep < 1 || L->w < 1 || L->D < 8 || L->D % 8 || L->base_len < 0) return 0;
    for (ptrdiff_t i = 0; i < L->w; i++) {
        if (L->n[i] < 1 || L->ov_start[i + 1] < L->ov_start[i]) return 0;
        for (int32_t o = L->ov_start[i]; o < L->ov_start[i + 1]; o++)
            if (L->ov_pos[o] < 0 || L->ov_pos[o] >= L->n[i] || L->ov_src[o] < 0 ||
                L->ov_src[o] >= L->E || (o > L->ov_start[i] && L->ov_pos[o] <= L->ov_pos[o - 1]))
                return 0;
        for (ptrdiff_t s = L->base_len; s < L->n[i]; s++)
            if (!overridden(L, i, s)) return 0;
    }
    return 1;
}

static inline float lane_sum(__m256 a) { /* ((0+1)+(2+3))+((4+5)+(6+7)), as row_dot.c */
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* ---- scores ----------------------------------------------------------------------------------
   RQ query rows x CK keys of D (a multiple of 8): out[r * ldo + c] = q_r . k_c in the 8-lane
   order; the rows' and keys' registers stay live across the head dimension. */
#define SCORE_KERNEL(RQ, CK)                                                                      \
static void score_##RQ##x##CK(const float *q, ptrdiff_t D, const float *k, float *out,           \
                              ptrdiff_t ldo) {                                                    \
    __m256 a[RQ][CK];                                                                             \
    _Pragma("GCC unroll 4") for (int r = 0; r < RQ; r++)                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < CK; c++) a[r][c] = _mm256_setzero_ps();      \
    for (ptrdiff_t d = 0; d < D; d += 8) {                                                        \
        __m256 kv[CK];                                                                            \
        _Pragma("GCC unroll 4") for (int c = 0; c < CK; c++) kv[c] = _mm256_loadu_ps(k + c * D + d); \
        _Pragma("GCC unroll 4") for (int r = 0; r < RQ; r++) {                                  \
            const __m256 u = _mm256_loadu_ps(q + r * D + d);                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < CK; c++)                                \
                a[r][c] = _mm256_fmadd_ps(u, kv[c], a[r][c]);                                     \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 4") for (int r = 0; r < RQ; r++)                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < CK; c++) out[r * ldo + c] = lane_sum(a[r][c]); \
}
SCORE_KERNEL(1, 1)
SCORE_KERNEL(2, 1)
SCORE_KERNEL(3, 1)
SCORE_KERNEL(4, 1)
SCORE_KERNEL(1, 2)
SCORE_KERNEL(2, 2)
SCORE_KERNEL(3, 2)
SCORE_KERNEL(4, 2)

typedef void (*score_fn)(const float *, ptrdiff_t, const float *, float *, ptrdiff_t);
static const score_fn SCORE[5][3] = {{0, 0, 0},
                                     {0, score_1x1, score_1x2},
                                     {0, score_2x1, score_2x2},
                                     {0, score_3x1, score_3x2},
                                     {0, score_4x1, score_4x2}};

#define KEY_BLOCK_BYTES (64 * 1024) /* keys that stay in cache while every query row passes */

/* Base keys [k0, k1) of KV head g against all its query rows (shared positions). */
static void score_range(const layout_t *L, const float *q, ptrdiff_t g, ptrdiff_t k0,
                        ptrdiff_t k1, float *scores, ptrdiff_t S) {
    const ptrdiff_t R = L->n_rep * L->w, D = L->D;
    const float *qg = q + g * R * D, *kg = L->base + g * L->base_stride;
    float *sg = scores + g * R * S;
    ptrdiff_t block = KEY_BLOCK_BYTES / (D * 4);
    if (block < 2) block = 2;
    for (ptrdiff_t b0 = k0; b0 < k1; b0 += block) {
        const ptrdiff_t b1 = b0 + block < k1 ? b0 + block : k1;
        for (ptrdiff_t r0 = 0; r0 < R; r0 += 4) {
            const int rq = R - r0 < 4 ? (int)(R - r0) : 4;
            ptrdiff_t s = b0;
            for (; s + 2 <= b1; s += 2) SCORE[rq][2](qg + r0 * D, D, kg + s * D, sg + r0 * S + s, S);
            for (; s < b1; s++) SCORE[rq][1](qg + r0 * D, D, kg + s * D, sg + r0 * S + s, S);
        }
    }
}

typedef struct {
    const layout_t *L;
    const float *q;
    float *scores;
    ptrdiff_t S, begin, end; /* keys [begin, end) of every head laid end to end (g * span + s) */
    ptrdiff_t span;
} score_job_t;

static void *run_score_job(void *arg) {
    const score_job_t *j = (const score_job_t *)arg;
    for (ptrdiff_t p = j->begin; p < j->end;) {
        const ptrdiff_t g = p / j->span, s0 = p % j->span;
        const ptrdiff_t s1 = (g + 1) * j->span <= j->end ? j->span : j->end - g * j->span;
        score_range(j->L, j->q, g, s0, s1, j->scores, j->S);
        p = g * j->span + s1;
    }
    return NULL;
}

#define MAX_THREADS 64

/* Run `fn` over `total` units split into `threads` contiguous shares (each output is computed by
   one thread, so the bytes do not depend on the count). */
static void split(void *(*fn)(void *), void *jobs, size_t job_size, int threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, fn, (char *)jobs + t * job_size) == 0;
    fn(jobs);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            fn((char *)jobs + t * job_size);
    }
}

static int clamp_threads(int threads, ptrdiff_t units) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    return threads < 1 ? 1 : threads;
}

/* scores [G * n_rep, w, S] (S >= every n[i]; entries past a row's n[i] are unspecified): row r = rep * w + i
   of KV head g against the keys row i sees, each in decode's order (above). `sgemm`: the BLAS's
   cblas_sgemm, for each row's last n % 8 keys. Returns 0; -1 on an invalid layout, -3 when
   memory runs out. */
int attn_scores(const float *q, const float *base, ptrdiff_t base_len, ptrdiff_t base_stride,
                const float *extra, ptrdiff_t E, ptrdiff_t extra_stride, ptrdiff_t G,
                ptrdiff_t n_rep, ptrdiff_t w, ptrdiff_t D, const int32_t *n,
                const int32_t *ov_start, const int32_t *ov_pos, const int32_t *ov_src,
                float *scores, ptrdiff_t S, void *sgemm, int threads) {
    const layout_t L = {G, n_rep, w, D, base, base_len, base_stride, extra, E, extra_stride,
                        n, ov_start, ov_pos, ov_src};
    if (!valid(&L) || !sgemm) return -1;
    const ptrdiff_t R = n_rep * w;
    for (ptrdiff_t i = 0; i < w; i++)
        if (n[i] > S) return -1;
    /* the base's positions below the longest row's whole groups of 8, for every row */
    ptrdiff_t body = 0;
    for (ptrdiff_t i = 0; i < w; i++)
        if (n[i] - n[i] % 8 > body) body = n[i] - n[i] % 8;
    if (body > base_len) body = base_len;
    if (body > 0) {
        threads = clamp_threads(threads, G * body / 16);
        score_job_t jobs[MAX_THREADS];
        const ptrdiff_t total = G * body;
        for (int t = 0; t < threads; t++)
            jobs[t] = (score_job_t){&L, q, scores, S, total * t / threads,
                                    total * (t + 1) / threads, body};
        split(run_score_job, jobs, sizeof jobs[0], threads);
    }
    /* each row's overridden positions in its groups of 8, and its last n % 8 keys */
    float *tail = malloc((size_t)(8 * D) * sizeof *tail);
    if (!tail) return -3;
    const sgemm_fn gemm = (sgemm_fn)sgemm;
    for (ptrdiff_t g = 0; g < G; g++)
        for (ptrdiff_t i = 0; i < w; i++) {
            const ptrdiff_t whole = n[i] - n[i] % 8, t = n[i] % 8;
            for (int32_t o = ov_start[i]; o < ov_start[i + 1] && ov_pos[o] < whole; o++) {
                const float *k = extra + g * extra_stride + (ptrdiff_t)ov_src[o] * D;
                for (ptrdiff_t rep = 0; rep < n_rep; rep++) {
                    const ptrdiff_t r = rep * w + i;
                    score_1x1(q + (g * R + r) * D, D, k, scores + (g * R + r) * S + ov_pos[o], S);
                }
            }
            if (!t) continue;
            for (ptrdiff_t s = 0; s < t; s++)
                memcpy(tail + s * D, seen(&L, g, i, whole + s), (size_t)D * sizeof *tail);
            for (ptrdiff_t rep = 0; rep < n_rep; rep++) {
                const ptrdiff_t r = rep * w + i;
                gemm(ROW_MAJOR, NO_TRANS, TRANS, 1, (int)t, (int)D, 1.0f, q + (g * R + r) * D,
                     (int)D, tail, (int)D, 0.0f, scores + (g * R + r) * S + whole, (int)t);
            }
        }
    free(tail);
    return 0;
}

/* ---- values ----------------------------------------------------------------------------------
   RV rows x CV groups of 8 outputs (at most 8 accumulators, 4 value and 1 broadcast registers): acc[r][c] = fma(p_r[s], v[s][c], acc[r][c]) for s in
   [s0, s1), the accumulators loaded from and stored to `acc` (exact: float32 in, float32 out). */
#define VALUE_KERNEL(RV, CV)                                                                      \
static void value_##RV##x##CV(const float *const *p, const float *v, ptrdiff_t ldv, ptrdiff_t s0, \
                              ptrdiff_t s1, float *acc, ptrdiff_t lda) {                          \
    __m256 a[RV][CV];                                                                             \
    _Pragma("GCC unroll 4") for (int r = 0; r < RV; r++)                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < CV; c++) a[r][c] = _mm256_loadu_ps(acc + r * lda + 8 * c); \
    for (ptrdiff_t s = s0; s < s1; s++) {                                                         \
        __m256 vv[CV];                                                                            \
        _Pragma("GCC unroll 4") for (int c = 0; c < CV; c++) vv[c] = _mm256_loadu_ps(v + s * ldv + 8 * c); \
        _Pragma("GCC unroll 4") for (int r = 0; r < RV; r++) {                                  \
            const __m256 pb = _mm256_broadcast_ss(p[r] + s);                                      \
            _Pragma("GCC unroll 4") for (int c = 0; c < CV; c++)                                \
                a[r][c] = _mm256_fmadd_ps(pb, vv[c], a[r][c]);                                    \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 4") for (int r = 0; r < RV; r++)                                        \
        _Pragma("GCC unroll 4") for (int c = 0; c < CV; c++) _mm256_storeu_ps(acc + r * lda + 8 * c, a[r][c]); \
}
VALUE_KERNEL(1, 1)
VALUE_KERNEL(2, 1)
VALUE_KERNEL(1, 4)
VALUE_KERNEL(2, 4)

typedef void (*value_fn)(const float *const *, const float *, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                         float *, ptrdiff_t);
static const value_fn VALUE[3][2] = {{0, 0}, {value_1x1, value_1x4}, {value_2x1, value_2x4}};

#define VALUE_CHUNK_BYTES (128 * 1024) /* values that stay in cache while every row passes */

typedef struct {
    const layout_t *L;
    const float *const *probs; /* per query row of every head, [G * R] pointers */
    float *out;                /* [G * R, D], the accumulators */
    const int32_t *X;
    ptrdiff_t nX, min_n, max_n;
    ptrdiff_t begin, end; /* groups of 8 outputs of every head laid end to end (g * D/8 + c) */
} value_job_t;

/* Output columns [c0, c1) (in 8s) of KV head g: every position in order, shared stretches
   through the tiled kernels, the others row by row. */
static void value_columns(const value_job_t *j, ptrdiff_t g, ptrdiff_t c0, ptrdiff_t c1) {
    const layout_t *L = j->L;
    const ptrdiff_t R = L->n_rep * L->w, D = L->D;
    const float *vg = L->base + g * L->base_stride;
    const float *const *pg = j->probs + g * R;
    float *og = j->out + g * R * D;
    ptrdiff_t chunk = VALUE_CHUNK_BYTES / (D * 4);
    if (chunk < 8) chunk = 8;
    ptrdiff_t s = 0, x = 0;
    while (s < j->max_n) {
        /* a shared stretch: [s, next position where rows differ) */
        ptrdiff_t stop = x < j->nX ? j->X[x] : j->min_n;
        if (stop > j->min_n) stop = j->min_n;
        for (ptrdiff_t a = s; a < stop; a += chunk) {
            const ptrdiff_t b = a + chunk < stop ? a + chunk : stop;
            for (ptrdiff_t c = c0; c < c1;) {
                const int cv = c1 - c >= 4 ? 4 : 1;
                for (ptrdiff_t r0 = 0; r0 < R; r0 += 2) {
                    const int rv = R - r0 < 2 ? (int)(R - r0) : 2;
                    VALUE[rv][cv == 4](pg + r0, vg + 8 * c, D, a, b, og + r0 * D + 8 * c, D);
                }
                c += cv;
            }
        }
        if (stop > s) s = stop;
        if (s >= j->max_n) break;
        /* one position where rows differ: each row with its own value row, if it sees one */
        for (ptrdiff_t r = 0; r < R; r++) {
            const ptrdiff_t i = r % L->w;
            if (s >= L->n[i]) continue;
            const float *v = seen(L, g, i, s);
            const __m256 pb = _mm256_broadcast_ss(pg[r] + s);
            for (ptrdiff_t c = c0; c < c1; c++) {
                float *o = og + r * D + 8 * c;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8 * c), _mm256_loadu_ps(o)));
            }
        }
        if (x < j->nX && j->X[x] == s) x++;
        s++;
    }
}

static void *run_value_job(void *arg) {
    const value_job_t *j = (const value_job_t *)arg;
    const ptrdiff_t groups = j->L->D / 8;
    for (ptrdiff_t p = j->begin; p < j->end;) {
        const ptrdiff_t g = p / groups, c0 = p % groups;
        const ptrdiff_t c1 = (g + 1) * groups <= j->end ? groups : j->end - g * groups;
        value_columns(j, g, c0, c1);
        p = g * groups + c1;
    }
    return NULL;
}

/* out [G * n_rep, w, D]: row r = rep * w + i of KV head g is probs[g * R + r] (its n[i]
   probabilities) times the values row i sees, each output one sequential fused multiply-add over
   the positions in order (decode's order, above). Returns 0; -1 on an invalid layout, -3 when
   memory runs out. */
int attn_values(const float *const *probs, const float *base, ptrdiff_t base_len,
                ptrdiff_t base_stride, const float *extra, ptrdiff_t E, ptrdiff_t extra_stride,
                ptrdiff_t G, ptrdiff_t n_rep, ptrdiff_t w, ptrdiff_t D, const int32_t *n,
                const int32_t *ov_start, const int32_t *ov_pos, const int32_t *ov_src,
                float *out, int threads) {
    const layout_t L = {G, n_rep, w, D, base, base_len, base_stride, extra, E, extra_stride,
                        n, ov_start, ov_pos, ov_src};
    if (!valid(&L)) return -1;
    const ptrdiff_t R = n_rep * w;
    int32_t *X = malloc((size_t)(ov_start[w] + 1) * sizeof *X);
    if (!X) return -3;
    ptrdiff_t min_n, max_n;
    const ptrdiff_t nX = split_positions(&L, X, &min_n, &max_n);
    memset(out, 0, (size_t)(G * R * D) * sizeof *out);
    const ptrdiff_t total = G * (D / 8);
    threads = clamp_threads(threads, total);
    value_job_t jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++)
        jobs[t] = (value_job_t){&L, probs, out, X, nX, min_n, max_n, total * t / threads,
                                total * (t + 1) / threads};
    split(run_value_job, jobs, sizeof jobs[0], threads);
    free(X);
    return 0;
}
