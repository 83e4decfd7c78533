/* Multi-row products in the order of BLIS's one-row product (x86-64, AVX2 + FMA).

   y[t, n] = x[t, :] . w[n, :] for t < T, n < N (N a multiple of 8: the columns that BLIS
   reduces with its 8-column kernel), w row-major [N, K] as nn.Linear stores
   it. Each output is reduced exactly as BLIS 0.9's one-row product (sgemm with M = 1) reduces it
   on AVX2 (checked bitwise, see mlx_mtp/cpu/row_kernel.py):
     - 8 lanes, lane j summing k = j mod 8 over the first K - K % 8 inputs, each lane a sequential
       fused multiply-add in k order;
     - the lanes added pairwise: ((0+1)+(2+3))+((4+5)+(6+7));
     - then the last K % 8 products added one by one, each rounded (a multiply, then an add).
   Build with -ffp-contract=off so the compiler fuses nothing else (and no -ffast-math).

   Speed: the T rows' accumulators are kept in registers for 2-8 columns at a time while the
   columns' weights stream once, so a T-row product reads the weights about once, like the
   one-row product decode makes. T > 6 rows are split into groups of at most 6 that share
   a column block of weights while it is in cache. Threads, when asked for, split the output
   columns. With 2 or more rows a call holds only 2-4 columns' weight streams, too few for the
   memory system to reach its bandwidth when the weights come from DRAM; those calls also
   prefetch the next columns' rows at the same offset, which makes them faster. A prefetch never
   faults (past the last column it reads nothing the result depends on) and changes no
   arithmetic.

   bf16_dot: the same product with the weights stored as bfloat16 (their 16-bit patterns), each
   widened to float32 exactly (the bits shifted up 16) as it is read and summed in float32: the
   sums of the bf16-valued weights, in the one-row order above, reading half the bytes. Any N.
   Every row count prefetches the next columns' rows (a one-row product from one thread reads
   its weights about 1.4x as fast with it).

   expert_dot: the products of a mixture of experts' verify. Entry i multiplies an input row by
   the weight of expert idx[i] (one [N, K] slice of an [E, N, K] stack); the entries are grouped
   by expert, so each expert's weight streams once for all the rows routed to it, each output in
   the one-row order above (float32 or bfloat16 weights). */

#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_DOT_ABI 2

int row_dot_abi(void) { return ROW_DOT_ABI; }

static inline float lane_sum(__m256 a) {
    __m256 h = _mm256_hadd_ps(a, a); /* 0+1, 2+3, ., . | 4+5, 6+7, ., . */
    h = _mm256_hadd_ps(h, h);        /* (0+1)+(2+3)    | (4+5)+(6+7) */
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* The bfloat16 weights' reads (w points at 16-bit patterns): 8 at a time, and one. */
static inline __m256 widen8(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float widen1(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* R rows x C columns (compile-time): rows x[0..R), columns w[0..C) (each K long, of type WT,
   read 8 at a time by LOAD8 and the last K % 8 one at a time by LOAD1). R x C accumulators stay
   in registers (at most 12 of the 16 ymm); more columns at once keep more weight streams in
   flight, which the memory system needs to reach its bandwidth. LIVE(c, cols): whether column c
   exists (the bf16 kernel takes a last partial group of `cols` < C columns); PREFETCH(R, k):
   whether step k also prefetches the next C columns' rows (more streams in flight, see top). */
#define DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, R, C)                                \
static void NAME##_##R(const float *x, ptrdiff_t ldx, ptrdiff_t K, const void *wv,             \
                       ptrdiff_t cols, float *y, ptrdiff_t ldy) {                               \
    const WT *w = (const WT *)wv;                                                               \
    (void)cols;                                                                                 \
    __m256 a[R][C];                                                                             \
    _Pragma("GCC unroll 8") for (int t = 0; t < R; t++)                                        \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) a[t][c] = _mm256_setzero_ps();     \
    const ptrdiff_t K8 = K - K % 8;                                                             \
    for (ptrdiff_t k = 0; k < K8; k += 8) {                                                     \
        __m256 v[C];                                                                            \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                    \
            v[c] = LIVE(c, cols) ? LOAD8(w + c * K + k) : _mm256_setzero_ps();                 \
        if (PREFETCH(R, k))                                                                     \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                \
                _mm_prefetch((const char *)(w + (c + C) * K + k), _MM_HINT_T0);                 \
        _Pragma("GCC unroll 8") for (int t = 0; t < R; t++) {                                  \
            const __m256 u = _mm256_loadu_ps(x + t * ldx + k);                                  \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                \
                a[t][c] = _mm256_fmadd_ps(u, v[c], a[t][c]);                                    \
        }                                                                                       \
    }                                                                                           \
    _Pragma("GCC unroll 8") for (int t = 0; t < R; t++) {                                      \
        const float *xt = x + t * ldx;                                                          \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                  \
            if (!LIVE(c, cols)) break;                                                          \
            float s = lane_sum(a[t][c]);                                                        \
            const WT *wc = w + c * K;                                                           \
            for (ptrdiff_t k = K8; k < K; k++) s += xt[k] * LOAD1(wc[k]);                       \
            y[t * ldy + c] = s;                                                                 \
        }                                                                                       \
    }                                                                                           \
}

/* float32: every group whole (N % 8 == 0), prefetching at every step from 2 rows on. */
#define AS_IS(v) (v)
#define WHOLE(c, cols) 1
#define FROM_2_ROWS(R, k) ((R) > 1)
/* bfloat16: a last partial group too, prefetching a cache line (32 weights) at a time at any
   row count. */
#define PRESENT(c, cols) ((c) < (cols))
#define EVERY_LINE(R, k) ((k) % 32 == 0)

/* Columns per call by rows (8 / 4 / 4 / 2 / 2 / 2; chosen by measurement on AVX2). */
#define KERNELS(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH)                                          \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 1, 8)                                    \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 2, 4)                                    \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 3, 4)                                    \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 4, 2)                                    \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 5, 2)                                    \
    DOT_KERNEL(NAME, WT, LOAD8, LOAD1, LIVE, PREFETCH, 6, 2)
KERNELS(rows, float, _mm256_loadu_ps, AS_IS, WHOLE, FROM_2_ROWS)
KERNELS(bf16_rows, uint16_t, widen8, widen1, PRESENT, EVERY_LINE)

typedef void (*rows_fn)(const float *, ptrdiff_t, ptrdiff_t, const void *, ptrdiff_t, float *,
                        ptrdiff_t);
static const rows_fn ROWS[2][7] = {
    {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6},
    {0, bf16_rows_1, bf16_rows_2, bf16_rows_3, bf16_rows_4, bf16_rows_5, bf16_rows_6}};
static const int COLS[7] = {0, 8, 4, 4, 2, 2, 2};

#define MAX_ROWS 6
#define BLOCK_BYTES (256 * 1024) /* a column block of weights shared by row groups (an L2) */

/* Columns [n_begin, n_end) of y = x w^T, single-threaded; `wsize` bytes per weight (4: float32
   by rows_*, 2: bfloat16 by bf16_rows_*). */
static void columns(const float *x, ptrdiff_t T, ptrdiff_t ldx, ptrdiff_t K, const void *w,
                    int wsize, ptrdiff_t n_begin, ptrdiff_t n_end, float *y, ptrdiff_t ldy) {
    const ptrdiff_t groups = (T + MAX_ROWS - 1) / MAX_ROWS;
    ptrdiff_t block = n_end - n_begin;
    if (groups > 1) {
        block = BLOCK_BYTES / (K * (ptrdiff_t)wsize + 1);
        block = block < 8 ? 8 : block - block % 8;
    }
    for (ptrdiff_t n0 = n_begin; n0 < n_end; n0 += block) {
        const ptrdiff_t n1 = n0 + block < n_end ? n0 + block : n_end;
        ptrdiff_t t0 = 0;
        for (ptrdiff_t g = 0; g < groups; g++) {
            const ptrdiff_t rows = (T - t0) / (groups - g); /* balanced groups, <= MAX_ROWS */
            const rows_fn f = ROWS[wsize == 2][rows];
            for (ptrdiff_t n = n0; n < n1; n += COLS[rows])
                f(x + t0 * ldx, ldx, K, (const char *)w + n * K * wsize, n1 - n,
                  y + t0 * ldy + n, ldy);
            t0 += rows;
        }
    }
}

typedef struct {
    const float *x;
    const void *w;
    int wsize;
    float *y;
    ptrdiff_t T, ldx, K, n_begin, n_end, ldy;
} job_t;

static void *run_job(void *arg) {
    const job_t *j = (const job_t *)arg;
    columns(j->x, j->T, j->ldx, j->K, j->w, j->wsize, j->n_begin, j->n_end, j->y, j->ldy);
    return NULL;
}

#define MAX_THREADS 64
#define MIN_THREAD_FLOATS (256 * 1024) /* weights per thread below which a thread costs more */

/* x [T, K] (row stride ldx), w [N, K] contiguous, y [T, ldy]: columns [0, N) written, split
   over up to `threads` threads by output columns (each output is computed by one thread, so
   the bytes do not depend on the thread count). Returns 0, or -1 when N is not a multiple
   of 8. */
static int split_columns(const float *x, ptrdiff_t T, ptrdiff_t ldx, ptrdiff_t K, const void *w,
                         int wsize, ptrdiff_t N, float *y, ptrdiff_t ldy, int threads) {
    ptrdiff_t most = (N * K) / MIN_THREAD_FLOATS;
    if (threads > most) threads = (int)most;
    if (threads > N / 8) threads = (int)(N / 8);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        columns(x, T, ldx, K, w, wsize, 0, N, y, ldy);
        return 0;
    }
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const ptrdiff_t groups8 = N / 8;
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job_t){x, w, wsize, y, T, ldx, K, 8 * (groups8 * i / threads),
                          i + 1 == threads ? N : 8 * (groups8 * (i + 1) / threads), ldy};
    }
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&ids[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        else
            run_job(&jobs[i]); /* no thread: this one computes its columns */
    }
    return 0;
}

int row_dot_f32(const float *x, ptrdiff_t T, ptrdiff_t ldx, ptrdiff_t K, const float *w,
                ptrdiff_t N, float *y, ptrdiff_t ldy, int threads) {
    if (N % 8 || T < 0 || K < 0) return -1;
    return split_columns(x, T, ldx, K, w, 4, N, y, ldy, threads);
}

/* y [T, ldy] = x [T, K] (row stride ldx) times w^T, w [N, K] bfloat16 patterns, any N >= 0:
   as row_dot_f32 otherwise. Returns 0, or -1 on a negative size. */
int bf16_dot_f32(const float *x, ptrdiff_t T, ptrdiff_t ldx, ptrdiff_t K, const uint16_t *w,
                 ptrdiff_t N, float *y, ptrdiff_t ldy, int threads) {
    if (T < 0 || K < 0 || N < 0) return -1;
    return split_columns(x, T, ldx, K, w, 2, N, y, ldy, threads);
}

/* ---- grouped expert products -------------------------------------------------------------- */

typedef struct {
    ptrdiff_t expert, first, count; /* entries [first, first + count) of the sorted order */
} group_t;

typedef struct {
    const float *xb; /* the entries' input rows in sorted order, [n, K] */
    const void *w;
    int wsize;
    ptrdiff_t K, N, stride; /* stride: elements from one expert's weight to the next */
    const group_t *groups;
    float *yb; /* the entries' outputs in sorted order, [n, N] */
    ptrdiff_t begin, end; /* a range of the groups' columns laid end to end (group g: g*N..) */
} expert_job_t;

static void *run_expert_job(void *arg) {
    const expert_job_t *j = (const expert_job_t *)arg;
    for (ptrdiff_t p = j->begin; p < j->end;) {
        const ptrdiff_t g = p / j->N, c0 = p % j->N;
        const ptrdiff_t c1 = (g + 1) * j->N <= j->end ? j->N : j->end - g * j->N;
        const group_t *G = &j->groups[g];
        columns(j->xb + G->first * j->K, G->count, j->K, j->K,
                (const char *)j->w + G->expert * j->stride * (ptrdiff_t)j->wsize, j->wsize, c0,
                c1, j->yb + G->first * j->N, j->N);
        p = g * j->N + c1;
    }
    return NULL;
}

/* y [n, N]: entry i is x[i / per_row] (rows of K, stride ldx) times the transpose of expert
   idx[i]'s weight, w + idx[i] * expert_stride elements ([N, K] row-major; float32 when wsize is
   4, bfloat16 patterns when 2; float32 needs N a multiple of 8). Entries are sorted by expert
   (stably), each expert's rows computed in one pass over its weight, and the outputs written
   back in entry order. Threads split the experts' columns laid end to end, in whole groups of
   8 (each output is computed by one thread, so the bytes do not depend on the count). Returns
   0; -1 on a bad size, -2 on an expert index >= E, -3 when memory runs out. */
int expert_dot(const float *x, ptrdiff_t ldx, ptrdiff_t K, const uint32_t *idx, ptrdiff_t n,
               ptrdiff_t per_row, const void *w, int wsize, ptrdiff_t expert_stride, ptrdiff_t E,
               ptrdiff_t N, float *y, int threads) {
    if (n < 0 || K < 0 || N < 0 || E < 1 || per_row < 1 || (wsize != 2 && wsize != 4) ||
        (wsize == 4 && N % 8))
        return -1;
    for (ptrdiff_t i = 0; i < n; i++)
        if ((ptrdiff_t)idx[i] >= E) return -2;
    if (n == 0 || N == 0) return 0;
    ptrdiff_t *start = calloc((size_t)E + 1, sizeof *start);
    ptrdiff_t *order = malloc((size_t)n * sizeof *order);
    group_t *groups = malloc((size_t)n * sizeof *groups);
    float *xb = malloc((size_t)(n * K + n * N) * sizeof *xb);
    int rc = 0;
    if (!start || !order || !groups || !xb) {
        rc = -3;
        goto done;
    }
    float *yb = xb + n * K;
    for (ptrdiff_t i = 0; i < n; i++) start[idx[i] + 1]++;
    for (ptrdiff_t e = 0; e < E; e++) start[e + 1] += start[e];
    ptrdiff_t G = 0;
    for (ptrdiff_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) groups[G++] = (group_t){e, start[e], start[e + 1] - start[e]};
    for (ptrdiff_t i = 0; i < n; i++) { /* stable: an expert's entries keep their order */
        const ptrdiff_t s = start[idx[i]]++;
        order[s] = i;
        memcpy(xb + s * K, x + (i / per_row) * ldx, (size_t)K * sizeof *xb);
    }
    const ptrdiff_t total = G * N;
    ptrdiff_t most = total * K / MIN_THREAD_FLOATS;
    if (threads > most) threads = (int)most;
    if (threads > total / 8) threads = (int)(total / 8);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    expert_job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    ptrdiff_t edge = 0;
    for (int t = 0; t < threads; t++) {
        ptrdiff_t end = total;
        if (t + 1 < threads) { /* a whole group of 8 columns inside a group */
            end = total * (t + 1) / threads;
            end -= (end % N) % 8;
            if (end < edge) end = edge;
        }
        jobs[t] = (expert_job_t){xb, w, wsize, K, N, expert_stride, groups, yb, edge, end};
        edge = end;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_expert_job, &jobs[t]) == 0;
    run_expert_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_expert_job(&jobs[t]);
    }
    for (ptrdiff_t s = 0; s < n; s++)
        memcpy(y + order[s] * N, yb + s * N, (size_t)N * sizeof *y);
done:
    free(start);
    free(order);
    free(groups);
    free(xb);
    return rc;
}
