/* Products of a few rows by a weight matrix, out (M, N) = x (M, K) W^T, for the SAT decoder's
 * per-word matmuls in training (models/sat_recurrence.py): M is the batch (32 at the
 * benchmark's sizes), W up to 2,561 x 2,048, the same W for every word of a step. At M = 32
 * a general sgemm spends much of its time re-packing W for each call (each weight element
 * takes part in only 2 M flops): at the benchmark's four shapes on 2 AVX2 cores (AMD EPYC,
 * caches flushed between calls), MKL's W x^T plus the copy of its transpose ran at 62-88
 * GFLOP/s, this kernel with W packed once a step at 110-127 (the machine's 2048^3 peak: ~140).
 *
 * Layout: W packed into panels of NR = 24 outputs, panel p holding W[p NR + i, k] at
 * packed[(p K + k) NR + i], zero past N (pack_panels). The inner loop takes a 4 x 24 tile of
 * out: three vector loads of the panel and four broadcasts of x per k for twelve FMAs, the
 * twelve accumulators, three panel vectors and one broadcast filling AVX2's 16 registers.
 * K is cut into blocks of KC so that a panel's block (12 KB) stays in L1 while all M rows
 * pass over it. Threads share the panels. Sums run over k in order within a block and blocks
 * in order, so the result does not depend on the thread count.
 *
 * Written for AVX2 + FMA (intrinsics); elsewhere gemm_supported() is 0 and the caller keeps
 * PyTorch's matmul. On AVX-512 CPUs, where MKL's own kernels use 512-bit vectors, the caller
 * keeps PyTorch's too (gemm_preferred()): this kernel is compiled and tested there but not
 * measured. */
#include <string.h>
#include <omp.h>

#define NR 24  /* outputs a panel: three 8-float vectors */
#define MR 4   /* rows of x a tile */
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
#ifdef __AVX512F__
int gemm_preferred(void) { return 0; }
#else
int gemm_preferred(void) { return 1; }
#endif

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
void gemm_packed(const float *x, long ldx, long M, long K, const float *packed, long N,
                 const float *bias, const float *addend, long lda, float *out, long ldo, int nthreads) {}
#endif
