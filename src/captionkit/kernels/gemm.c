/* Products of a few rows by a weight matrix, out (M, N) = x (M, K) W^T, for the SAT decoder's
 * per-word matmuls in training (models/sat_recurrence.py): M is the batch (32 at the
 * benchmark's sizes), W up to 2,561 x 2,048, the same W for every word of a step. At M = 32
 * a general sgemm spends much of its time re-packing W for each call (each weight element
 * takes part in only 2 M flops): at the benchmark's four shapes on 2 AVX2 cores (AMD EPYC,
 * caches flushed between calls), MKL's W x^T plus the copy of its transpose ran at 62-88
 * GFLOP/s, this kernel with W packed once a step at 110-127 (the machine's 2048^3 peak: ~140).
 * On 2 AVX-512 cores (AMD EPYC Zen 4, peak ~180) MKL's path ran at 60-100 GFLOP/s, the AVX2
 * tile at 110-160 and the AVX-512 tile below at 155-190.
 *
 * Layout: W packed into panels of NR outputs (24 with AVX2, 48 with AVX-512: three vectors),
 * panel p holding W[p NR + i, k] at packed[(p K + k) NR + i], zero past N (pack_panels). The
 * inner loop takes an MR x NR tile of out: three vector loads of the panel and MR broadcasts
 * of x per k for 3 MR FMAs. AVX2: MR = 4, twelve accumulators, three panel vectors and one
 * broadcast filling its 16 registers; AVX-512: MR = 8, 24 + 3 + 1 of its 32. K is cut into
 * blocks of KC so that a panel's block (12 or 24 KB) stays in L1 while all M rows pass over
 * it. Threads share the panels. Every output is the same sum in either width: its bias or
 * addend, then x[k] W[n, k] added by FMA over k in order (blocks in order, each block's
 * partial sums stored and reloaded as float32). So the result depends neither on the thread
 * count nor on the vector width (both tested bit for bit, the widths where the CPU has both).
 *
 * Written for AVX2 + FMA and AVX-512F (intrinsics); elsewhere gemm_supported() is 0 and the
 * caller keeps PyTorch's matmul. */
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#define NR 48  /* outputs a panel: three 16-float vectors */
#define MR 8   /* rows of x a tile */
#else
#define NR 24  /* outputs a panel: three 8-float vectors */
#define MR 4   /* rows of x a tile */
#endif
#define KC 128 /* inputs a block */
#define MC 64  /* rows of x a pass over a panel (the tile buffer on the stack: MC x NR floats) */

/* packed <- W's panels. W (N, K) with rows ldw apart, or, if transposed, W^T: the matrix
 * whose (n, k) element is w[k ldw + n] (for products with a weight's transpose). */
void pack_panels(const float *w, long ldw, int transposed, long N, long K, float *packed, int nthreads) {
    const long P = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < P; p++) {
        float *dst = packed + p * K * NR;
        const long n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
        if (transposed) {  /* a panel's row k: nn contiguous floats of w's row k */
            for (long k = 0; k < K; k++) {
                memcpy(dst + k * NR, w + k * ldw + n0, nn * sizeof(float));
                memset(dst + k * NR + nn, 0, (NR - nn) * sizeof(float));
            }
        } else {  /* output n's weights are row n of w: spread over the panel's column */
            for (long i = 0; i < nn; i++) {
                const float *src = w + (n0 + i) * ldw;
                for (long k = 0; k < K; k++) dst[k * NR + i] = src[k];
            }
            for (long i = nn; i < NR; i++)
                for (long k = 0; k < K; k++) dst[k * NR + i] = 0.f;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int gemm_supported(void) { return 1; }
int gemm_preferred(void) { return 1; }
int gemm_panel(void) { return NR; }

#if defined(__AVX512F__)
/* c (MR x NR, row-major) += x[0..MR)[0..n) times the panel's first n rows; x's rows ldx apart. */
static inline void tile(const float *x, long ldx, const float *panel, long n, float *c) {
    __m512 acc[MR][3];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 3; j++) acc[r][j] = _mm512_loadu_ps(c + r * NR + 16 * j);
#pragma GCC unroll 2
    for (long k = 0; k < n; k++) {
        const float *wk = panel + k * NR;
        __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2));  /* in registers, as in the AVX2 tile */
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 3; j++) _mm512_storeu_ps(c + r * NR + 16 * j, acc[r][j]);
}
#else

/* c (MR x NR, row-major) += x[0..MR)[0..n) times the panel's first n rows; x's rows ldx apart. */
static inline void tile(const float *x, long ldx, const float *panel, long n, float *c) {
    __m256 c00 = _mm256_loadu_ps(c + 0), c01 = _mm256_loadu_ps(c + 8), c02 = _mm256_loadu_ps(c + 16);
    __m256 c10 = _mm256_loadu_ps(c + 24), c11 = _mm256_loadu_ps(c + 32), c12 = _mm256_loadu_ps(c + 40);
    __m256 c20 = _mm256_loadu_ps(c + 48), c21 = _mm256_loadu_ps(c + 56), c22 = _mm256_loadu_ps(c + 64);
    __m256 c30 = _mm256_loadu_ps(c + 72), c31 = _mm256_loadu_ps(c + 80), c32 = _mm256_loadu_ps(c + 88);
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
#pragma GCC unroll 4  /* ~5-10% faster than the plain loop at the benchmark's shapes */
    for (long k = 0; k < n; k++) {
        const float *wk = panel + k * NR;
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
        /* keep the panel's vectors in registers: left to itself, GCC 12 folds each load into
         * the FMAs as a memory operand, 16 loads for 12 FMAs, and the loop runs load-bound at
         * ~60% of the FMA rate instead of ~80% */
        __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));
        __m256 b = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01), c02 = _mm256_fmadd_ps(b, w2, c02);
        b = _mm256_broadcast_ss(x1 + k);
        c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11), c12 = _mm256_fmadd_ps(b, w2, c12);
        b = _mm256_broadcast_ss(x2 + k);
        c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21), c22 = _mm256_fmadd_ps(b, w2, c22);
        b = _mm256_broadcast_ss(x3 + k);
        c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31), c32 = _mm256_fmadd_ps(b, w2, c32);
    }
    _mm256_storeu_ps(c + 0, c00), _mm256_storeu_ps(c + 8, c01), _mm256_storeu_ps(c + 16, c02);
    _mm256_storeu_ps(c + 24, c10), _mm256_storeu_ps(c + 32, c11), _mm256_storeu_ps(c + 40, c12);
    _mm256_storeu_ps(c + 48, c20), _mm256_storeu_ps(c + 56, c21), _mm256_storeu_ps(c + 64, c22);
    _mm256_storeu_ps(c + 72, c30), _mm256_storeu_ps(c + 80, c31), _mm256_storeu_ps(c + 88, c32);
}
#endif

/* out (M, N) <- start + x (M, K) W^T, W packed by pack_panels; start: bias (N) broadcast over
 * the rows if not NULL, else addend (M, N) if not NULL, else 0. x, addend and out have rows
 * ldx, lda and ldo floats apart. */
void gemm_packed(const float *x, long ldx, long M, long K, const float *packed, long N,
                 const float *bias, const float *addend, long lda, float *out, long ldo, int nthreads) {
    const long P = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (long p = 0; p < P; p++)
        for (long r0 = 0; r0 < M; r0 += MC) {
            const float *panel = packed + p * K * NR;
            const long n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
            const long rows = M - r0 < MC ? M - r0 : MC;
            float c[MC * NR];
            for (long r = 0; r < rows; r++)
                for (long i = 0; i < NR; i++)
                    c[r * NR + i] = i >= nn ? 0.f : bias ? bias[n0 + i] : addend ? addend[(r0 + r) * lda + n0 + i] : 0.f;
            for (long k0 = 0; k0 < K; k0 += KC) {
                const long kn = K - k0 < KC ? K - k0 : KC;
                for (long m = 0; m < rows; m += MR) {
                    if (rows - m >= MR) {
                        tile(x + (r0 + m) * ldx + k0, ldx, panel + k0 * NR, kn, c + m * NR);
                    } else {  /* the last rows: a full tile on a copy, the extra rows zero */
                        float xs[MR * KC] = {0}, cs[MR * NR] = {0};
                        for (long r = 0; r < rows - m; r++) {
                            memcpy(xs + r * KC, x + (r0 + m + r) * ldx + k0, kn * sizeof(float));
                            memcpy(cs + r * NR, c + (m + r) * NR, NR * sizeof(float));
                        }
                        tile(xs, KC, panel + k0 * NR, kn, cs);
                        memcpy(c + m * NR, cs, (rows - m) * NR * sizeof(float));
                    }
                }
            }
            for (long r = 0; r < rows; r++) memcpy(out + (r0 + r) * ldo + n0, c + r * NR, nn * sizeof(float));
        }
}
#else  /* no AVX2/FMA: the caller keeps PyTorch's matmul */
int gemm_supported(void) { return 0; }
int gemm_preferred(void) { return 0; }
int gemm_panel(void) { return NR; }
void gemm_packed(const float *x, long ldx, long M, long K, const float *packed, long N,
                 const float *bias, const float *addend, long lda, float *out, long ldo, int nthreads) {}
#endif
