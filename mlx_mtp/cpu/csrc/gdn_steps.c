/* The GatedDeltaNet recurrence of T tokens with scalar gating, every step's state returned,
   in the float operations of mlx-lm's one-token step (``_gated_delta_step_ops``), each rounded
   on its own (build with -ffp-contract=off, no -ffast-math).

   Per batch b, value head h (key head h / (Hv / Hk)), state row d (a row is Dk long), token t:
     s      = s * g[t]                        (the decay)
     kv     = sum_i s[i] * k[i]               (from 0, i = 0, 1, ... in order: MLX's CPU sum)
     delta  = (v[d] - kv) * beta[t]
     s      = s + k[i] * delta                (each i)
     y[t,d] = sum_i s[i] * q[i]               (from 0, in order)

   Speed: mlx-lm's ops make 5 passes over the whole state per token. Here a block of ROWS state
   rows is held transposed ([Dk][ROWS], a few KB: it stays in L1) over all T tokens, so the
   state is read once and written once per token (the states the caller keeps). The sums are
   sequential per row, so the vector lanes run ACROSS rows: lane r of every vector sums row r in
   i order, and the ROWS / 8 independent accumulators hide the add latency.

   Layouts (contiguous float32): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
   state [B, Hv, Dv, Dk]; out: y [B, T, Hv, Dv], states [T, B, Hv, Dv, Dk] (gdn_steps_f32) or
   T separate [B, Hv, Dv, Dk] buffers (gdn_steps_f32_each: the lazy MLX op's T outputs). */

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

#define GDN_STEPS_ABI 1
#define ROWS 32

int gdn_steps_abi(void) { return GDN_STEPS_ABI; }

/* dst[c * ld + r] = src[r * ls + c] for r < nr, c < nc: data movement only, no float op. */
static void transpose(const float *src, ptrdiff_t ls, float *dst, ptrdiff_t ld, ptrdiff_t nr,
                      ptrdiff_t nc) {
    ptrdiff_t r0 = 0, c0 = 0;
#ifdef __AVX__
    /* Whole 8 x 8 tiles with AVX shuffles. */
    for (r0 = 0; r0 + 8 <= nr; r0 += 8) {
        for (c0 = 0; c0 + 8 <= nc; c0 += 8) {
            const float *a = src + r0 * ls + c0;
            __m256 x0 = _mm256_loadu_ps(a), x1 = _mm256_loadu_ps(a + ls);
            __m256 x2 = _mm256_loadu_ps(a + 2 * ls), x3 = _mm256_loadu_ps(a + 3 * ls);
            __m256 x4 = _mm256_loadu_ps(a + 4 * ls), x5 = _mm256_loadu_ps(a + 5 * ls);
            __m256 x6 = _mm256_loadu_ps(a + 6 * ls), x7 = _mm256_loadu_ps(a + 7 * ls);
            __m256 t0 = _mm256_unpacklo_ps(x0, x1), t1 = _mm256_unpackhi_ps(x0, x1);
            __m256 t2 = _mm256_unpacklo_ps(x2, x3), t3 = _mm256_unpackhi_ps(x2, x3);
            __m256 t4 = _mm256_unpacklo_ps(x4, x5), t5 = _mm256_unpackhi_ps(x4, x5);
            __m256 t6 = _mm256_unpacklo_ps(x6, x7), t7 = _mm256_unpackhi_ps(x6, x7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
            __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
            __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
            __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
            __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
            __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
            __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
            __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
            float *o = dst + c0 * ld + r0;
            _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
        for (ptrdiff_t r = r0; r < r0 + 8; r++) /* the columns past the last whole tile */
            for (ptrdiff_t c = c0; c < nc; c++)
                dst[c * ld + r] = src[r * ls + c];
    }
#endif
    for (ptrdiff_t r = r0; r < nr; r++) /* the rows past the last whole tile */
        for (ptrdiff_t c = 0; c < nc; c++)
            dst[c * ld + r] = src[r * ls + c];
}

int gdn_steps_f32_each(const float *q, const float *k, const float *v, const float *g,
                       const float *beta, const float *state, float *y, float *const *states,
                       ptrdiff_t B, ptrdiff_t T, ptrdiff_t Hk, ptrdiff_t Hv, ptrdiff_t Dk,
                       ptrdiff_t Dv) {
    if (B < 1 || T < 1 || Hk < 1 || Hv < 1 || Dk < 1 || Dv < 1 || Hv % Hk)
        return 1;
    float *s = aligned_alloc(64, (size_t)Dk * ROWS * sizeof(float));
    if (!s)
        return 2;
    const ptrdiff_t repeat = Hv / Hk;
    const ptrdiff_t head_state = Dv * Dk;
    for (ptrdiff_t b = 0; b < B; b++) {
        for (ptrdiff_t h = 0; h < Hv; h++) {
            const ptrdiff_t kh = h / repeat;
            for (ptrdiff_t d0 = 0; d0 < Dv; d0 += ROWS) {
                const ptrdiff_t nr = Dv - d0 < ROWS ? Dv - d0 : ROWS;
                /* Load the block transposed; padding lanes hold 0 (they are never stored). */
                const float *src = state + (b * Hv + h) * head_state + d0 * Dk;
                memset(s, 0, (size_t)Dk * ROWS * sizeof(float));
                transpose(src, Dk, s, ROWS, nr, Dk);
                for (ptrdiff_t t = 0; t < T; t++) {
                    const ptrdiff_t bt = b * T + t;
                    const float gt = g[bt * Hv + h], bet = beta[bt * Hv + h];
                    const float *kk = k + (bt * Hk + kh) * Dk;
                    const float *qq = q + (bt * Hk + kh) * Dk;
                    const float *vv = v + (bt * Hv + h) * Dv + d0;
                    float kv[ROWS], delta[ROWS], out[ROWS];
                    for (int r = 0; r < ROWS; r++)
                        kv[r] = 0.0f;
                    for (ptrdiff_t i = 0; i < Dk; i++) {
                        const float ki = kk[i];
                        float *si = s + i * ROWS;
                        for (int r = 0; r < ROWS; r++) {
                            const float decayed = si[r] * gt;
                            si[r] = decayed;
                            kv[r] = kv[r] + decayed * ki;
                        }
                    }
                    for (int r = 0; r < ROWS; r++) {
                        const float vr = r < nr ? vv[r] : 0.0f;
                        delta[r] = (vr - kv[r]) * bet;
                        out[r] = 0.0f;
                    }
                    for (ptrdiff_t i = 0; i < Dk; i++) {
                        const float ki = kk[i], qi = qq[i];
                        float *si = s + i * ROWS;
                        for (int r = 0; r < ROWS; r++) {
                            const float updated = si[r] + ki * delta[r];
                            si[r] = updated;
                            out[r] = out[r] + updated * qi;
                        }
                    }
                    float *yy = y + (bt * Hv + h) * Dv + d0;
                    for (ptrdiff_t r = 0; r < nr; r++)
                        yy[r] = out[r];
                    float *dst = states[t] + (b * Hv + h) * head_state + d0 * Dk;
                    transpose(s, ROWS, dst, Dk, Dk, nr);
                }
            }
        }
    }
    free(s);
    return 0;
}

int gdn_steps_f32(const float *q, const float *k, const float *v, const float *g,
                  const float *beta, const float *state, float *y, float *states,
                  ptrdiff_t B, ptrdiff_t T, ptrdiff_t Hk, ptrdiff_t Hv, ptrdiff_t Dk,
                  ptrdiff_t Dv) {
    if (T < 1)
        return 1;
    float **each = malloc((size_t)T * sizeof *each);
    if (!each)
        return 2;
    for (ptrdiff_t t = 0; t < T; t++)
        each[t] = states + t * B * Hv * Dv * Dk;
    const int rc = gdn_steps_f32_each(q, k, v, g, beta, state, y, each, B, T, Hk, Hv, Dk, Dv);
    free(each);
    return rc;
}
