/* Fused soft-attention energy for Show, Attend and Tell:
 *     e[b,l] = sum_a w[a] * tanh(proj[b,l,a] + q[b,a])
 * and its backward. Pure PyTorch materialises (B, L, A) tensors several times per word
 * (add, tanh, outer-product grad, tanh grad, grad accumulation); these loops read proj once
 * forward and once backward, recomputing tanh instead of storing it, and accumulate the grad
 * of proj in place across time steps. Parallel over the batch with OpenMP. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

void attn_energy_fwd(const float *proj, const float *q, const float *w, float *e,
                     long B, long L, long A, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        const float *qb = q + b * A;
        for (long l = 0; l < L; l++) {
            const float *p = proj + (b * L + l) * A;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (long a = 0; a < A; a++) s += w[a] * tanhf(p[a] + qb[a]);
            e[b * L + l] = s;
        }
    }
}

/* ge: (B, L) grad of e. Adds into gproj (B, L, A) and gw (A); writes gq (B, A). */
int attn_energy_bwd(const float *ge, const float *proj, const float *q, const float *w,
                    float *gproj, float *gq, float *gw, long B, long L, long A, int nthreads) {
    float *part = calloc((size_t)nthreads * A, sizeof(float));
    if (!part) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float *gwp = part + (long)omp_get_thread_num() * A;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) {
            const float *qb = q + b * A;
            float *gqb = gq + b * A;
            memset(gqb, 0, A * sizeof(float));
            for (long l = 0; l < L; l++) {
                const float g = ge[b * L + l];
                const float *p = proj + (b * L + l) * A;
                float *gp = gproj + (b * L + l) * A;
#pragma omp simd
                for (long a = 0; a < A; a++) {
                    const float t = tanhf(p[a] + qb[a]);
                    const float d = g * w[a] * (1.f - t * t);
                    gp[a] += d;
                    gqb[a] += d;
                    gwp[a] += g * t;
                }
            }
        }
    }
    for (int k = 0; k < nthreads; k++)
        for (long a = 0; a < A; a++) gw[a] += part[(long)k * A + a];
    free(part);
    return 0;
}
