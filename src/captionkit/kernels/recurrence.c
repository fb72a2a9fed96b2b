/* Per-word pieces of the SAT decoder's teacher-forced recurrence (models/sat_recurrence.py)
 * that PyTorch ran as a dozen small element-wise operators a word, forward and backward:
 * the attention's softmax (fused with the energy of attention.c), the context gate and the
 * LSTM cell. Each is one pass over a few (B, x) rows; at the benchmark's sizes the operators'
 * dispatch cost more than their arithmetic. Rows may be strided (`ld*`: a row's length in
 * floats) so that slices of h_proj's output (B, A + 1 + 4H) are read and written in place.
 * Compiled with -ffast-math: expf and tanhf are glibc's vector versions. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

float energy_row(const float *p, const float *qb, const float *w, long A, int fast);
void energy_row_backward(float g, const float *p, const float *qb, const float *w,
                         float *gp, float *gqb, float *gwp, long A, int fast);

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* alpha[b] = softmax_l(w . tanh(proj[b, l] + q[b])): the energies of attention.c's
 * rational tanh, then the softmax over the L locations, per caption. q rows ldq apart. */
void attn_softmax_fwd(const float *proj, const float *q, long ldq, const float *w, float *alpha,
                      long B, long L, long A, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        float *ab = alpha + b * L;
        float m = -INFINITY, s = 0.f;
        for (long l = 0; l < L; l++) {
            ab[l] = energy_row(proj + (b * L + l) * A, q + b * ldq, w, A, 1);
            m = fmaxf(m, ab[l]);
        }
        for (long l = 0; l < L; l++) {
            ab[l] = expf(ab[l] - m);
            s += ab[l];
        }
        const float inv = 1.f / s;
        for (long l = 0; l < L; l++) ab[l] *= inv;
    }
}

/* Backward of attn_softmax_fwd for d_alpha (B, L) (plus g_alpha, the loss's own gradient of
 * alpha, where not NULL): the softmax's backward d_e = alpha (d_alpha - alpha . d_alpha), then
 * the energy's. Adds into gproj (B, L, A) and gw (A); writes gq (B, A), rows ldq apart. */
int attn_softmax_bwd(const float *d_alpha, const float *g_alpha, const float *alpha,
                     const float *proj, const float *q, long ldq, const float *w,
                     float *gproj, float *gq, float *gw, long B, long L, long A, int nthreads) {
    float *part = calloc((size_t)nthreads * A + (size_t)B * L, sizeof(float));
    if (!part) return -1;
    float *de = part + (size_t)nthreads * A;  /* (B, L) */
#pragma omp parallel num_threads(nthreads)
    {
        float *gwp = part + (long)omp_get_thread_num() * A;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) {
            const float *ab = alpha + b * L, *dab = d_alpha + b * L;
            const float *gab = g_alpha ? g_alpha + b * L : NULL;
            float *deb = de + b * L, dot = 0.f;
            for (long l = 0; l < L; l++) {
                deb[l] = gab ? dab[l] + gab[l] : dab[l];
                dot += ab[l] * deb[l];
            }
            float *gqb = gq + b * ldq;
            memset(gqb, 0, A * sizeof(float));
            for (long l = 0; l < L; l++)
                energy_row_backward(ab[l] * (deb[l] - dot), proj + (b * L + l) * A, q + b * ldq, w,
                                    gproj + (b * L + l) * A, gqb, gwp, A, 1);
        }
    }
    for (int k = 0; k < nthreads; k++)
        for (long a = 0; a < A; a++) gw[a] += part[(long)k * A + a];
    free(part);
    return 0;
}

/* The gate: beta[b] = sigmoid(beta_logit[b * ld]), z[b] = beta[b] zc[b] (D wide). */
void gate_fwd(const float *beta_logit, long ld, const float *zc, float *beta, float *z, long B, long D) {
    for (long b = 0; b < B; b++) {
        const float be = sigmoidf(beta_logit[b * ld]);
        beta[b] = be;
#pragma omp simd
        for (long d = 0; d < D; d++) z[b * D + d] = be * zc[b * D + d];
    }
}

/* Its backward: dz (B, D), the gated context's gradient, becomes the ungated one's (dz beta);
 * g_logit[b * ld] = (dz . zc) beta (1 - beta). */
void gate_bwd(float *dz, const float *zc, const float *beta, float *g_logit, long ld, long B, long D) {
    for (long b = 0; b < B; b++) {
        const float be = beta[b];
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long d = 0; d < D; d++) {
            s += dz[b * D + d] * zc[b * D + d];
            dz[b * D + d] *= be;
        }
        g_logit[b * ld] = s * be * (1.f - be);
    }
}

/* The LSTM cell for one word. Pre-activations, gate order [i f g o], are the sum of three
 * parts: gz (B, 4H) = W_ctx z, gh (rows ldh apart) = W_hh h_{t-1} + bias, gx (B, 4H) the
 * embedding's share. Writes acts (B, 4H) = sigmoid(i), sigmoid(f), tanh(g), sigmoid(o),
 * c (B, H) = sigmoid(f) c_prev + sigmoid(i) tanh(g), tanh_c = tanh(c), h = sigmoid(o) tanh(c). */
void lstm_fwd(const float *gz, const float *gh, long ldh, const float *gx, const float *c_prev,
              float *acts, float *c, float *tanh_c, float *h, long B, long H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        const float *z = gz + b * 4 * H, *y = gh + b * ldh, *x = gx + b * 4 * H;
        float *a = acts + b * 4 * H;
#pragma omp simd
        for (long k = 0; k < 2 * H; k++) a[k] = sigmoidf(z[k] + y[k] + x[k]);
#pragma omp simd
        for (long k = 2 * H; k < 3 * H; k++) a[k] = tanhf(z[k] + y[k] + x[k]);
#pragma omp simd
        for (long k = 3 * H; k < 4 * H; k++) a[k] = sigmoidf(z[k] + y[k] + x[k]);
        const float *i = a, *f = a + H, *g = a + 2 * H, *o = a + 3 * H;
        const float *cp = c_prev + b * H;
        float *cb = c + b * H, *tb = tanh_c + b * H, *hb = h + b * H;
#pragma omp simd
        for (long k = 0; k < H; k++) {
            cb[k] = f[k] * cp[k] + i[k] * g[k];
            tb[k] = tanhf(cb[k]);
            hb[k] = o[k] * tb[k];
        }
    }
}

/* Its backward. dh (B, H) = the gradient of h_t from the next word, plus dh_out (B, H), the
 * loss's own; dc (B, H): c_t's gradient from c_{t+1}, replaced by c_{t-1}'s. Writes the
 * pre-activations' gradient (B, 4H), rows ldg apart. */
void lstm_bwd(const float *dh, const float *dh_out, float *dc, const float *acts, const float *tanh_c,
              const float *c_prev, float *dgates, long ldg, long B, long H, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        const float *i = acts + b * 4 * H, *f = i + H, *g = i + 2 * H, *o = i + 3 * H;
        const float *tc = tanh_c + b * H, *cp = c_prev + b * H, *d1 = dh + b * H, *d2 = dh_out + b * H;
        float *dcb = dc + b * H, *dg = dgates + b * ldg;
#pragma omp simd
        for (long k = 0; k < H; k++) {
            const float dhk = d1[k] + d2[k];
            const float dck = dcb[k] + dhk * o[k] * (1.f - tc[k] * tc[k]);
            dg[k] = dck * g[k] * i[k] * (1.f - i[k]);
            dg[H + k] = dck * cp[k] * f[k] * (1.f - f[k]);
            dg[2 * H + k] = dck * i[k] * (1.f - g[k] * g[k]);
            dg[3 * H + k] = dhk * tc[k] * o[k] * (1.f - o[k]);
            dcb[k] = dck * f[k];
        }
    }
}
