/* Fused soft-attention energy for Show, Attend and Tell:
 *     e[b,l] = sum_a w[a] * tanh(proj[b,l,a] + q[b,a])
 * and its backward. Pure PyTorch materialises (B, L, A) tensors several times per word
 * (add, tanh, outer-product grad, tanh grad, grad accumulation); these loops read proj once
 * forward and once backward, recomputing tanh instead of storing it, and accumulate the grad
 * of proj in place across time steps. Parallel over the batch with OpenMP.
 *
 * Two tanh: `tanhf` (glibc's vector version under -ffast-math) for decoding, whose captions
 * must not move, and `tanh_rational` for teacher-forced training (the `fast` argument), where
 * the tanh of every (b, l, a) forward and again backward was the costliest part of the kernel:
 * at the benchmark's sizes on an AVX2 CPU, 2.2 ms -> 0.8 ms a word forward, 2.9 -> 1.3 ms
 * backward. Against float64: tanhf 9.3e-8 at most, tanh_rational 3.0e-7 (a few units in the
 * last place near +-1). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* tanh(x) ~ x P(x^2) / Q(x^2) on |x| <= 8, +-1 (to float32) beyond. P (degree 6) and Q
 * (degree 3) are our own fit: linearised least squares of x P - tanh(x) Q over [0, 8],
 * reweighted towards minimax (Lawson); max error 1.6e-9 in exact arithmetic, 3.0e-7 evaluated
 * in float32 (near |x| = 6, where an ulp of tanh is 6e-8); P(0) = 1 - 8.6e-9 keeps small x
 * accurate relative to x. Straight-line code: vectorises under `omp simd` to FMAs and one divide. */
static inline float tanh_rational(float x) {
    x = fminf(fmaxf(x, -8.0f), 8.0f);
    const float s = x * x;
    float p = -1.1323024127582671e-13f;
    p = p * s + 6.276969643934986e-11f;
    p = p * s + -2.2137287895199982e-08f;
    p = p * s + 1.159938418066546e-05f;
    p = p * s + 0.0031452550540758254f;
    p = p * s + 0.1312066421728817f;
    p = p * s + 0.999999991424731f;
    float q = 0.00026069907145956437f;
    q = q * s + 0.024658619194080317f;
    q = q * s + 0.46453993636357754f;
    q = q * s + 1.0f;
    return x * p / q;
}

/* One location's energy: sum_a w[a] tanh(p[a] + qb[a]). */
static inline float energy_row(const float *p, const float *qb, const float *w, long A, int fast) {
    float s = 0.f;
    if (fast) {
#pragma omp simd reduction(+ : s)
        for (long a = 0; a < A; a++) s += w[a] * tanh_rational(p[a] + qb[a]);
    } else {
#pragma omp simd reduction(+ : s)
        for (long a = 0; a < A; a++) s += w[a] * tanhf(p[a] + qb[a]);
    }
    return s;
}

/* One caption's energies: e (L) for its proj (L, A) and q (A). */
void attn_energy_caption(const float *proj, const float *q, const float *w, float *e, long L, long A, int fast) {
    for (long l = 0; l < L; l++) e[l] = energy_row(proj + l * A, q, w, A, fast);
}

/* e (B, L) <- the energies; q's rows ldq floats apart (a column slice of a wider matrix). */
void attn_energy_fwd(const float *proj, const float *q, long ldq, const float *w, float *e,
                     long B, long L, long A, int nthreads, int fast) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) attn_energy_caption(proj + b * L * A, q + b * ldq, w, e + b * L, L, A, fast);
}

/* What one attention unit of one location adds to the gradients, given its tanh t. */
static inline void accumulate(float g, float t, float wa, float *gp, float *gq, float *gw) {
    const float d = g * wa * (1.f - t * t);
    *gp += d;
    *gq += d;
    *gw += g * t;
}

/* One location's backward for the energy's grad g: adds into gp, gqb and gwp. */
static inline void energy_row_backward(float g, const float *p, const float *qb, const float *w,
                         float *gp, float *gqb, float *gwp, long A, int fast) {
    if (fast) {
#pragma omp simd
        for (long a = 0; a < A; a++) accumulate(g, tanh_rational(p[a] + qb[a]), w[a], gp + a, gqb + a, gwp + a);
    } else {
#pragma omp simd
        for (long a = 0; a < A; a++) accumulate(g, tanhf(p[a] + qb[a]), w[a], gp + a, gqb + a, gwp + a);
    }
}

/* One caption's backward for its energies' grad ge (L): writes gq (A), adds into its gproj
 * (L, A) and into gw (A). */
void attn_energy_caption_bwd(const float *ge, const float *proj, const float *q, const float *w,
                             float *gproj, float *gq, float *gw, long L, long A, int fast) {
    memset(gq, 0, A * sizeof(float));
    for (long l = 0; l < L; l++) energy_row_backward(ge[l], proj + l * A, q, w, gproj + l * A, gq, gw, A, fast);
}

/* gw (A) += the per-thread shares part[k stride .. k stride + A) of nthreads threads. */
void add_thread_shares(float *gw, const float *part, long stride, long A, int nthreads) {
    for (int k = 0; k < nthreads; k++)
        for (long a = 0; a < A; a++) gw[a] += part[(long)k * stride + a];
}

/* ge: (B, L) grad of e. Adds into gproj (B, L, A) and gw (A); writes gq (B, A). q's and gq's
 * rows ldq floats apart. */
int attn_energy_bwd(const float *ge, const float *proj, const float *q, long ldq, const float *w,
                    float *gproj, float *gq, float *gw, long B, long L, long A, int nthreads, int fast) {
    float *part = calloc((size_t)nthreads * A, sizeof(float));
    if (!part) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float *gwp = part + (long)omp_get_thread_num() * A;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++)
            attn_energy_caption_bwd(ge + b * L, proj + b * L * A, q + b * ldq, w, gproj + b * L * A, gq + b * ldq,
                                    gwp, L, A, fast);
    }
    add_thread_shares(gw, part, A, A, nthreads);
    free(part);
    return 0;
}
