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
void attn_energy_caption(const float *proj, const float *q, const float *w, float *e, long L, long A, int fast);
void attn_energy_caption_bwd(const float *ge, const float *proj, const float *q, const float *w,
                             float *gproj, float *gq, float *gw, long L, long A, int fast);
void add_thread_shares(float *gw, const float *part, long stride, long A, int nthreads);

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* a (L) <- softmax(a), in place. */
static void softmax_row(float *a, long L) {
    float m = -INFINITY, s = 0.f;
    for (long l = 0; l < L; l++) m = fmaxf(m, a[l]);
    for (long l = 0; l < L; l++) {
        a[l] = expf(a[l] - m);
        s += a[l];
    }
    const float inv = 1.f / s;
    for (long l = 0; l < L; l++) a[l] *= inv;
}

/* The softmax's backward for one caption: de (L) <- alpha (d - alpha . d), d = d_alpha (+ g_alpha
 * where not NULL); de may be d_alpha itself. */
static void softmax_row_bwd(const float *d_alpha, const float *g_alpha, const float *alpha, float *de, long L) {
    float dot = 0.f;
    for (long l = 0; l < L; l++) {
        de[l] = g_alpha ? d_alpha[l] + g_alpha[l] : d_alpha[l];
        dot += alpha[l] * de[l];
    }
    for (long l = 0; l < L; l++) de[l] = alpha[l] * (de[l] - dot);
}

/* alpha[b] = softmax_l(w . tanh(proj[b, l] + q[b])): attention.c's energies with its rational
 * tanh, then the softmax over the L locations, per caption. q rows ldq apart. */
void attn_softmax_fwd(const float *proj, const float *q, long ldq, const float *w, float *alpha,
                      long B, long L, long A, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        attn_energy_caption(proj + b * L * A, q + b * ldq, w, alpha + b * L, L, A, 1);
        softmax_row(alpha + b * L, L);
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
    for (long b = 0; b < B; b++)
        softmax_row_bwd(d_alpha + b * L, g_alpha ? g_alpha + b * L : NULL, alpha + b * L, de + b * L, L);
    const int rc = attn_energy_bwd(de, proj, q, ldq, w, gproj, gq, gw, B, L, A, nthreads, 1);
    free(de);
    return rc;
}

/* One caption's gate: returns beta = sigmoid(logit); z (D) = beta zc. */
static inline float gate_row(float logit, const float *zc, float *z, long D) {
    const float be = sigmoidf(logit);
#pragma omp simd
    for (long d = 0; d < D; d++) z[d] = be * zc[d];
    return be;
}

/* Its backward: dz (D), the gated context's gradient, becomes the ungated one's (dz beta);
 * returns the logit's gradient (dz . zc) beta (1 - beta). */
static inline float gate_row_bwd(float *dz, const float *zc, float be, long D) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long d = 0; d < D; d++) {
        s += dz[d] * zc[d];
        dz[d] *= be;
    }
    return s * be * (1.f - be);
}

/* The gate: beta[b] = sigmoid(beta_logit[b * ld]), z[b] = beta[b] zc[b] (D wide). */
void gate_fwd(const float *beta_logit, long ld, const float *zc, float *beta, float *z, long B, long D) {
    for (long b = 0; b < B; b++) beta[b] = gate_row(beta_logit[b * ld], zc + b * D, z + b * D, D);
}

/* Its backward for dz (B, D), in place; g_logit[b * ld] <- the logits' gradients. */
void gate_bwd(float *dz, const float *zc, const float *beta, float *g_logit, long ld, long B, long D) {
    for (long b = 0; b < B; b++) g_logit[b * ld] = gate_row_bwd(dz + b * D, zc + b * D, beta[b], D);
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
 * where the CPU converts float16 in vectors (x86 F16C: GCC does not vectorise _Float16 loads).
 *
 * With float16 features a caption's whole attention is one pass, attend_fwd_half: energies,
 * softmax, context, gate, caption by caption (attend_bwd_half backward, in reverse order), not
 * one kernel after another over the batch. The same arithmetic (outputs equal bit for bit);
 * alone at the benchmark's sizes on 2 AVX2 cores, with caches flushed, 1.76 -> 1.70 ms a word
 * forward and 2.49 -> 2.18 ms backward. */
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

/* One caption's context: z (D) <- sum_l alpha[l] f[l], f (L, D) float16. */
static void context_row_half(const float *alpha, const uint16_t *f, float *z, long L, long D) {
    const long D8 = D / 8 * 8;
    memset(z, 0, D * sizeof(float));
    for (long l = 0; l < L; l++) {
        const float a = alpha[l];
        const __m256 av = _mm256_set1_ps(a);
        const uint16_t *fl = f + l * D;
        for (long d = 0; d < D8; d += 8)
            _mm256_storeu_ps(z + d, _mm256_fmadd_ps(av, load8(fl + d), _mm256_loadu_ps(z + d)));
        for (long d = D8; d < D; d++) z[d] += a * _cvtsh_ss(fl[d]);
    }
}

/* One caption's gradient of alpha from the context: d_alpha (L) <- f[l] . dz, f (L, D) float16. */
static void context_row_half_bwd(const float *dz, const uint16_t *f, float *d_alpha, long L, long D) {
    const long D16 = D / 16 * 16;
    for (long l = 0; l < L; l++) {
        const uint16_t *fl = f + l * D;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (long d = 0; d < D16; d += 16) {
            s0 = _mm256_fmadd_ps(load8(fl + d), _mm256_loadu_ps(dz + d), s0);
            s1 = _mm256_fmadd_ps(load8(fl + d + 8), _mm256_loadu_ps(dz + d + 8), s1);
        }
        float part[8], s = 0.f;
        _mm256_storeu_ps(part, _mm256_add_ps(s0, s1));
        for (int k = 0; k < 8; k++) s += part[k];
        for (long d = D16; d < D; d++) s += _cvtsh_ss(fl[d]) * dz[d];
        d_alpha[l] = s;
    }
}

/* A word's attention for every caption, features f (B, L, D) float16: alpha (B, L) <- softmax_l
 * of the energies (attention.c's, rational tanh) of proj (B, L, A) and q (rows ld apart);
 * zc (B, D) <- the context; with the gate (beta_logit not NULL, rows ld apart, as q: columns of
 * h_proj's output) beta (B) <- sigmoid(beta_logit) and z (B, D) <- beta zc. */
void attend_fwd_half(const float *proj, const float *q, const float *beta_logit, long ld, const float *w,
                     const uint16_t *f, float *alpha, float *zc, float *beta, float *z,
                     long B, long L, long A, long D, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long b = 0; b < B; b++) {
        float *ab = alpha + b * L;
        attn_energy_caption(proj + b * L * A, q + b * ld, w, ab, L, A, 1);
        softmax_row(ab, L);
        context_row_half(ab, f + b * L * D, zc + b * D, L, D);
        if (beta_logit) beta[b] = gate_row(beta_logit[b * ld], zc + b * D, z + b * D, D);
    }
}

/* Its backward, for dz (B, D), the (gated) context's gradient, and g_alpha (B, L), the loss's own
 * gradient of alpha (or NULL). With the gate, dz becomes the ungated context's gradient and
 * g_logit[b * ld] the logits'. Adds into gproj (B, L, A) and gw (A); writes gq (B, A), rows ld
 * apart. */
int attend_bwd_half(float *dz, const float *zc, const float *beta, float *g_logit, const float *alpha,
                    const float *g_alpha, const uint16_t *f, const float *proj, const float *q, long ld,
                    const float *w, float *gproj, float *gq, float *gw, long B, long L, long A, long D,
                    int nthreads) {
    float *part = calloc((size_t)nthreads * (A + L), sizeof(float));  /* per thread: gw's share, de */
    if (!part) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float *gwp = part + (long)omp_get_thread_num() * (A + L), *de = gwp + A;
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) {
            float *dzb = dz + b * D;
            if (g_logit) g_logit[b * ld] = gate_row_bwd(dzb, zc + b * D, beta[b], D);
            context_row_half_bwd(dzb, f + b * L * D, de, L, D);
            softmax_row_bwd(de, g_alpha ? g_alpha + b * L : NULL, alpha + b * L, de, L);
            attn_energy_caption_bwd(de, proj + b * L * A, q + b * ld, w, gproj + b * L * A, gq + b * ld, gwp, L, A, 1);
        }
    }
    add_thread_shares(gw, part, A + L, A, nthreads);
    free(part);
    return 0;
}
#else  /* no F16C: the context stays float32 (torch.bmm) */
int half_supported(void) { return 0; }
long to_half_exact(const float *src, uint16_t *dst, long n, int nthreads) { return n; }
void attend_fwd_half(const float *proj, const float *q, const float *beta_logit, long ld, const float *w,
                     const uint16_t *f, float *alpha, float *zc, float *beta, float *z,
                     long B, long L, long A, long D, int nthreads) {}
int attend_bwd_half(float *dz, const float *zc, const float *beta, float *g_logit, const float *alpha,
                    const float *g_alpha, const uint16_t *f, const float *proj, const float *q, long ld,
                    const float *w, float *gproj, float *gq, float *gw, long B, long L, long A, long D,
                    int nthreads) { return -1; }
#endif
