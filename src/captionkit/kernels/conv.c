/* An inverted-residual block's 1x1 expansion and depthwise convolution in one pass, float32,
 * channels last (EfficientNet-Lite's MBConv, encoders/efficientnet_lite.py; BatchNorms folded):
 *
 *     e = relu6(x W_e + b_e)              (H, W, M): M = 6 C channels, zero outside the map
 *     y = relu6(depthwise_k,s(e) + b_d)   (Ho, Wo, M)
 *
 * The high-resolution blocks' expanded maps are large (16 -> 96 channels at 130 x 130: 6.5 MB a
 * view), so oneDNN's two convolutions write e to memory and read it back, and on a CPU with
 * small caches (a first-generation EPYC: 512 KB of L2, 8 MB of L3) those blocks ran at a third
 * of its peak. Here the expansion is computed a row at a time into a ring of k rows that the
 * depthwise convolution reads while they are still in cache; e never exists whole.
 *
 * Every output is the same sum wherever it is computed: e[p, m] = (x[p, c] W_e[c, m] added by
 * FMA over c in order, from zero) + b_e[m]; y[q, m] = (e[.] w_d[ky, kx, m] added by FMA over ky,
 * then kx, in order, from zero, a tap outside the map adding 0 as "SAME" padding's zeros do) +
 * b_d[m]. So it depends neither on the thread count nor on how the rows are split (tested); and
 * it is the order oneDNN's convolutions add in: their values bit for bit, every block of
 * EfficientNet-Lite2 (AMD EPYC Zen 4, oneDNN's AVX-512 kernels and, with ONEDNN_MAX_CPU_ISA=AVX2,
 * its AVX2 ones), though nothing promises oneDNN's order on every CPU.
 *
 * AVX2 + FMA intrinsics; elsewhere expand_dw_supported() is 0 and the caller keeps oneDNN. */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int expand_dw_supported(void) { return 1; }

/* e (W, M) <- relu6(x (W, C) W_e + b_e), W_e (C, M) row-major; M a multiple of 24. gemm.c's
 * tile has this loop's shape, but here the bias and ReLU6 are applied as the tile is stored and
 * the last pixels go one at a time: gemm.c's tile for these rows (made to store into e, then a
 * bias-and-ReLU6 pass) took 5.6 ms a view for Lite2's seven blocks against this loop's 4.9
 * (benchmarks/encoder_blocks.py, Zen 4, one thread), its staging of a row's last pixels the
 * larger part. */
static void expand_row(const float *x, long W, long C, const float *we, const float *be, long M, float *e) {
    const __m256 zero = _mm256_setzero_ps(), six = _mm256_set1_ps(6.f);
    for (long m0 = 0; m0 < M; m0 += 24) {
        const __m256 b0 = _mm256_loadu_ps(be + m0), b1 = _mm256_loadu_ps(be + m0 + 8), b2 = _mm256_loadu_ps(be + m0 + 16);
        long p = 0;
        for (; p + 4 <= W; p += 4) {  /* 4 pixels x 24 channels: twelve accumulators */
            const __m256 z = _mm256_setzero_ps();
            __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;
            __m256 c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
            const float *x0 = x + p * C, *x1 = x0 + C, *x2 = x1 + C, *x3 = x2 + C;
            for (long c = 0; c < C; c++) {
                const float *wc = we + c * M + m0;
                __m256 w0 = _mm256_loadu_ps(wc), w1 = _mm256_loadu_ps(wc + 8), w2 = _mm256_loadu_ps(wc + 16);
                __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));  /* in registers (see gemm.c's tile) */
                __m256 b = _mm256_broadcast_ss(x0 + c);
                c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01), c02 = _mm256_fmadd_ps(b, w2, c02);
                b = _mm256_broadcast_ss(x1 + c);
                c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11), c12 = _mm256_fmadd_ps(b, w2, c12);
                b = _mm256_broadcast_ss(x2 + c);
                c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21), c22 = _mm256_fmadd_ps(b, w2, c22);
                b = _mm256_broadcast_ss(x3 + c);
                c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31), c32 = _mm256_fmadd_ps(b, w2, c32);
            }
#define RELU6(v) _mm256_min_ps(_mm256_max_ps(v, zero), six)
            c00 = _mm256_add_ps(c00, b0), c01 = _mm256_add_ps(c01, b1), c02 = _mm256_add_ps(c02, b2);
            c10 = _mm256_add_ps(c10, b0), c11 = _mm256_add_ps(c11, b1), c12 = _mm256_add_ps(c12, b2);
            c20 = _mm256_add_ps(c20, b0), c21 = _mm256_add_ps(c21, b1), c22 = _mm256_add_ps(c22, b2);
            c30 = _mm256_add_ps(c30, b0), c31 = _mm256_add_ps(c31, b1), c32 = _mm256_add_ps(c32, b2);
            float *o = e + p * M + m0;
            _mm256_storeu_ps(o, RELU6(c00)), _mm256_storeu_ps(o + 8, RELU6(c01)), _mm256_storeu_ps(o + 16, RELU6(c02));
            o += M;
            _mm256_storeu_ps(o, RELU6(c10)), _mm256_storeu_ps(o + 8, RELU6(c11)), _mm256_storeu_ps(o + 16, RELU6(c12));
            o += M;
            _mm256_storeu_ps(o, RELU6(c20)), _mm256_storeu_ps(o + 8, RELU6(c21)), _mm256_storeu_ps(o + 16, RELU6(c22));
            o += M;
            _mm256_storeu_ps(o, RELU6(c30)), _mm256_storeu_ps(o + 8, RELU6(c31)), _mm256_storeu_ps(o + 16, RELU6(c32));
        }
        for (; p < W; p++) {  /* the last pixels, one at a time: the same sums */
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0;
            for (long c = 0; c < C; c++) {
                const float *wc = we + c * M + m0;
                const __m256 b = _mm256_broadcast_ss(x + p * C + c);
                c0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(wc), c0);
                c1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(wc + 8), c1);
                c2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(wc + 16), c2);
            }
            c0 = _mm256_add_ps(c0, b0), c1 = _mm256_add_ps(c1, b1), c2 = _mm256_add_ps(c2, b2);
            float *o = e + p * M + m0;
            _mm256_storeu_ps(o, RELU6(c0)), _mm256_storeu_ps(o + 8, RELU6(c1)), _mm256_storeu_ps(o + 16, RELU6(c2));
        }
    }
}

/* y (Wo, M) <- relu6(b_d + sum over ky, kx of rows[ky][ox s - pl + kx] w_d[ky, kx]); rows[ky]
 * (W, M), or the zero row where the input row is outside the map. K is a constant in each
 * caller (3 or 5), so the taps unroll. */
static inline __attribute__((always_inline)) void dw_row(const int K, const float *const *rows, long W, long M,
                                                         const float *wd, const float *bd, int s, int pl,
                                                         long Wo, float *y) {
    const __m256 zero = _mm256_setzero_ps(), six = _mm256_set1_ps(6.f);
    for (long ox = 0; ox < Wo; ox++) {
        const long ix0 = ox * s - pl;
        float *yo = y + ox * M;
        if (ix0 >= 0 && (ox + 3) * s - pl + K <= W) {  /* four columns, every tap inside: one load of a weight for four FMAs */
            for (long m = 0; m < M; m += 8) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int ky = 0; ky < K; ky++) {
                    const float *r = rows[ky] + ix0 * M + m;
                    for (int kx = 0; kx < K; kx++) {
                        const __m256 wv = _mm256_loadu_ps(wd + (ky * K + kx) * M + m);
                        const float *rk = r + kx * M;
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(rk), wv, a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(rk + s * M), wv, a1);
                        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(rk + 2 * s * M), wv, a2);
                        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(rk + 3 * s * M), wv, a3);
                    }
                }
                const __m256 b = _mm256_loadu_ps(bd + m);
                a0 = _mm256_add_ps(a0, b), a1 = _mm256_add_ps(a1, b), a2 = _mm256_add_ps(a2, b), a3 = _mm256_add_ps(a3, b);
                _mm256_storeu_ps(yo + m, RELU6(a0)), _mm256_storeu_ps(yo + M + m, RELU6(a1));
                _mm256_storeu_ps(yo + 2 * M + m, RELU6(a2)), _mm256_storeu_ps(yo + 3 * M + m, RELU6(a3));
            }
            ox += 3;
        } else if (ix0 >= 0 && ix0 + K <= W) {  /* every tap inside */
            for (long m = 0; m < M; m += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int ky = 0; ky < K; ky++) {
                    const float *r = rows[ky] + ix0 * M + m;
                    for (int kx = 0; kx < K; kx++)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(r + kx * M), _mm256_loadu_ps(wd + (ky * K + kx) * M + m), acc);
                }
                _mm256_storeu_ps(yo + m, RELU6(_mm256_add_ps(acc, _mm256_loadu_ps(bd + m))));
            }
        } else {  /* a border column: the taps outside add 0, as inside they add e w */
            for (long m = 0; m < M; m += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int ky = 0; ky < K; ky++)
                    for (int kx = 0; kx < K; kx++) {
                        const long ix = ix0 + kx;
                        const __m256 v = ix >= 0 && ix < W ? _mm256_loadu_ps(rows[ky] + ix * M + m) : zero;
                        acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(wd + (ky * K + kx) * M + m), acc);
                    }
                _mm256_storeu_ps(yo + m, RELU6(_mm256_add_ps(acc, _mm256_loadu_ps(bd + m))));
            }
        }
    }
}

/* y (N, Ho, Wo, M) <- the block's expansion and depthwise convolution of x (N, H, W, C) (see
 * the top of this file). W_e (C, M) row-major, b_e (M), w_d (K, K, M), b_d (M); K 3 or 5;
 * s the stride; pt and pl the zeros above and left of the map ("SAME" padding: below and right
 * as many as Ho and Wo need). Work is split over images and, where there are fewer images than
 * threads, over row ranges of one image. Returns 0, or -1 if a ring could not be allocated. */
int expand_dw(const float *x, long N, long H, long W, long C, const float *we, const float *be,
              const float *wd, const float *bd, long M, int K, int s, int pt, int pl, long Ho, long Wo,
              float *y, int nthreads) {
    if (M % 24 != 0 || (K != 3 && K != 5)) return -2;
    if (N <= 0 || Ho <= 0 || Wo <= 0) return 0;  /* nothing to write */
    const long parts = N >= nthreads ? 1 : (nthreads + N - 1) / N;  /* row ranges an image */
    const long jobs = N * parts;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* K ring rows, then a zero row for taps above and below the map */
        float *ring = malloc((size_t)(K + 1) * W * M * sizeof(float));
        if (!ring) {
#pragma omp atomic write
            failed = 1;
        } else {
            memset(ring + (size_t)K * W * M, 0, (size_t)W * M * sizeof(float));
        }
#pragma omp for schedule(static)
        for (long j = 0; j < jobs; j++) {
            if (!ring) continue;
            const long n = j / parts, part = j % parts;
            const long oy0 = Ho * part / parts, oy1 = Ho * (part + 1) / parts;
            const float *xn = x + n * H * W * C;
            float *yn = y + n * Ho * Wo * M;
            long held[5] = {-1, -1, -1, -1, -1};  /* the input row each ring slot holds */
            for (long oy = oy0; oy < oy1; oy++) {
                const float *rows[5];
                for (int ky = 0; ky < K; ky++) {
                    const long iy = oy * s - pt + ky;
                    if (iy < 0 || iy >= H) {
                        rows[ky] = ring + (size_t)K * W * M;
                        continue;
                    }
                    const long slot = iy % K;
                    float *row = ring + (size_t)slot * W * M;
                    if (held[slot] != iy) {
                        expand_row(xn + iy * W * C, W, C, we, be, M, row);
                        held[slot] = iy;
                    }
                    rows[ky] = row;
                }
                if (K == 3)
                    dw_row(3, rows, W, M, wd, bd, s, pl, Wo, yn + oy * Wo * M);
                else
                    dw_row(5, rows, W, M, wd, bd, s, pl, Wo, yn + oy * Wo * M);
            }
        }
        free(ring);
    }
    return failed ? -1 : 0;
}
#else  /* no AVX2/FMA: the caller keeps oneDNN's convolutions */
int expand_dw_supported(void) { return 0; }
int expand_dw(const float *x, long N, long H, long W, long C, const float *we, const float *be,
              const float *wd, const float *bd, long M, int K, int s, int pt, int pl, long Ho, long Wo,
              float *y, int nthreads) { return -2; }
#endif
