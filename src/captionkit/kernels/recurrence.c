/* Per-word pieces of the SAT decoder's teacher-forced recurrence (models/sat_recurrence.py)
 * that PyTorch ran as a dozen small element-wise operators a word, forward and backward:
 * the attention's softmax (on the energy of attention.c), the context gate and the
 * LSTM cell. Each is one pass over a few (B, x) rows; at the benchmark's sizes the operators'
 * dispatch cost more than their arithmetic. Rows may be strided (`ld*`: a row's length in
 * floats) so that slices of h_proj's output (B, A + 1 + 4H) are read and written in place.
 * Compiled with -ffast-math: expf and tanhf are glibc's vector versions. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <stdint.h>

void attn_energy_fwd(const float *proj, const float *q, long ldq, const float *w, float *e,
                     long B, long L, long A, int nthreads, int fast);
int attn_energy_bwd(const float *ge, const float *proj, const float *q, long ldq, const float *w,
                    float *gproj, float *gq, float *gw, long B, long L, long A, int nthreads, int fast);

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* alpha[b] = softmax_l(w . tanh(proj[b, l] + q[b])): attention.c's energies with its rational
 * tanh, then the softmax over the L locations, per caption. q rows ldq apart. */
void attn_softmax_fwd(const float *proj, const float *q, long ldq, const float *w, float *alpha,
                      long B, long L, long A, int nthreads) {
    attn_energy_fwd(proj, q, ldq, w, alpha, B, L, A, nthreads, 1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        float *ab = alpha + b * L;
        float m = -INFINITY, s = 0.f;
        for (long l = 0; l < L; l++) m = fmaxf(m, ab[l]);
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
 * attention.c's energy backward. Adds into gproj (B, L, A) and gw (A); writes gq (B, A), rows
 * ldq apart. */
int attn_softmax_bwd(const float *d_alpha, const float *g_alpha, const float *alpha,
                     const float *proj, const float *q, long ldq, const float *w,
                     float *gproj, float *gq, float *gw, long B, long L, long A, int nthreads) {
    float *de = malloc((size_t)B * L * sizeof(float));  /* (B, L) */
    if (!de) return -1;
    for (long b = 0; b < B; b++) {
        const float *ab = alpha + b * L, *dab = d_alpha + b * L;
        const float *gab = g_alpha ? g_alpha + b * L : NULL;
        float *deb = de + b * L, dot = 0.f;
        for (long l = 0; l < L; l++) {
            deb[l] = gab ? dab[l] + gab[l] : dab[l];
            dot += ab[l] * deb[l];
        }
        for (long l = 0; l < L; l++) deb[l] = ab[l] * (deb[l] - dot);
    }
    const int rc = attn_energy_bwd(de, proj, q, ldq, w, gproj, gq, gw, B, L, A, nthreads, 1);
    free(de);
    return rc;
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

/* The context's two reads of the annotation vectors a word (z = alpha a forward, d_alpha = a dz
 * backward) are memory-bound: 32 MB a word at the benchmark's sizes. Features come from the
 * feature store as float16 values; kept as float16 here they are half the bytes, and converted
 * to float32 as they are read the products are the float32 ones (a float16 value is a float32
 * value exactly). Only for features that convert exactly (to_half_exact says which), and only
 * where the CPU converts float16 in vectors (x86 F16C: GCC does not vectorise _Float16 loads). */
#if defined(__F16C__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int half_supported(void) { return 1; }

/* dst (n) <- src as float16; returns how many values did not convert exactly. */
long to_half_exact(const float *src, uint16_t *dst, long n, int nthreads) {
    long bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad)
    for (long i = 0; i < n / 8 * 8; i += 8) {
        const __m256 x = _mm256_loadu_ps(src + i);
        const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + i), h);
        bad += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_cvtph_ps(h), x, _CMP_NEQ_UQ)));
    }
    for (long i = n / 8 * 8; i < n; i++) {
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        bad += _cvtsh_ss(dst[i]) != src[i];
    }
    return bad;
}

static inline __m256 load8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* z (B, D) <- sum_l alpha[b, l] f[b, l]: f (B, L, D) float16. */
void context_fwd_half(const float *alpha, const uint16_t *f, float *z, long B, long L, long D, int nthreads) {
    const long D8 = D / 8 * 8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        float *zb = z + b * D;
        memset(zb, 0, D * sizeof(float));
        for (long l = 0; l < L; l++) {
            const float a = alpha[b * L + l];
            const __m256 av = _mm256_set1_ps(a);
            const uint16_t *fl = f + (b * L + l) * D;
            for (long d = 0; d < D8; d += 8)
                _mm256_storeu_ps(zb + d, _mm256_fmadd_ps(av, load8(fl + d), _mm256_loadu_ps(zb + d)));
            for (long d = D8; d < D; d++) zb[d] += a * _cvtsh_ss(fl[d]);
        }
    }
}

/* d_alpha (B, L) <- f[b, l] . dz[b]: f (B, L, D) float16. */
void context_bwd_half(const float *dz, const uint16_t *f, float *d_alpha, long B, long L, long D, int nthreads) {
    const long D16 = D / 16 * 16;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        const float *db = dz + b * D;
        for (long l = 0; l < L; l++) {
            const uint16_t *fl = f + (b * L + l) * D;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            for (long d = 0; d < D16; d += 16) {
                s0 = _mm256_fmadd_ps(load8(fl + d), _mm256_loadu_ps(db + d), s0);
                s1 = _mm256_fmadd_ps(load8(fl + d + 8), _mm256_loadu_ps(db + d + 8), s1);
            }
            float part[8], s = 0.f;
            _mm256_storeu_ps(part, _mm256_add_ps(s0, s1));
            for (int k = 0; k < 8; k++) s += part[k];
            for (long d = D16; d < D; d++) s += _cvtsh_ss(fl[d]) * db[d];
            d_alpha[b * L + l] = s;
        }
    }
}
#else  /* no F16C: the context stays float32 (torch.bmm) */
int half_supported(void) { return 0; }
long to_half_exact(const float *src, uint16_t *dst, long n, int nthreads) { return n; }
void context_fwd_half(const float *alpha, const uint16_t *f, float *z, long B, long L, long D, int nthreads) {}
void context_bwd_half(const float *dz, const uint16_t *f, float *d_alpha, long B, long L, long D, int nthreads) {}
#endif
