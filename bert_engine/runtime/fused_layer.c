/* One whole BERT encoder layer in a single call, for inference on x86-64 CPUs with AVX2 and FMA:
 *
 *     x = LayerNorm(x + out(attention(qkv(x))));  x = LayerNorm(x + down(act(up(x))))
 *
 * the post-LN layer of bert_engine/model.py (BertLayer), with every projection through tiled_matmul or, in an
 * int8 model, int8_matmul (both built into the same library) and the rest here: attention per sequence and head, the residual adds, the
 * LayerNorms and the activation (exact erf GELU, tanh GELU or ReLU). At the few rows of one request the
 * layer's ~20 small torch operators, each dispatched from Python, cost about as much as its matmuls'
 * arithmetic; here they are a few loops over data already in cache.
 *
 * Rows are the tokens of `seqs` sequences laid end to end (no padding): sequence s is rows offsets[s] ..
 * offsets[s+1]-1, and attends only to itself. x (rows x H) is read and overwritten with the layer's output.
 * Each sequence's result does not depend on the others beside it (rows are computed on their own; attention
 * and the norms in a fixed order per sequence), nor on the number of threads.
 * The attention runs at the width the matmuls do (tiled_matmul_isa(): AVX-512 where native.py set it, two ZMM
 * registers a query where AVX2 has two YMM; attend_head512), with the same bits at either width.
 *
 * erf and exp are polynomial approximations evaluated in float32: erf on [0, 4) in four pieces of degree 9 (the
 * table below, fitted by scripts/fit_erf.py), 1 past 4, within 8.8e-8 of the true value; exp as 2^n times a
 * degree-7 Taylor series on |r| <= ln(2)/2, within a few ulp. torch's are within 3e-8; tests/test_fused_layer.py
 * checks the GELU against float64 and the whole layer against the torch modules.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void tiled_matmul(const float *x, int64_t M, int64_t K, const float *panels, int64_t P, const float *bias,
                  float *y, int64_t N, int threads);
int tiled_matmul_isa(void);
int int8_matmul(const float *x, int64_t M, int64_t K, int rotate, const int8_t *panels, int64_t P,
                const float *scale, const float *rowsum, const float *bias, float *y, int64_t N, uint8_t *codes,
                float *rowq, int threads);

int fused_layer_version(void) { return 4; }

/* One projection of the layer: fp32 panels (tiled_matmul.c) or, with `int8` set, int8 panels with their
 * per-column scales and row sums (int8_matmul.c; `rotate`: its input rotated in Hadamard blocks of 16). */
typedef struct {
    const void *panels;
    const float *bias;
    const float *scale;
    const float *rowsum;
    int64_t int8;
    int64_t rotate;
} projection;

/* y (M x N) = x (M x K) through projection p; codes and rowq: int8's scratch (M x K bytes rounded up, 2 M floats) */
static int project(const projection *p, const float *x, int64_t M, int64_t K, float *y, int64_t N, uint8_t *codes,
                   float *rowq, int threads) {
    const int64_t P = (N + 15) / 16;
    if (!p->int8) {
        tiled_matmul(x, M, K, (const float *)p->panels, P, p->bias, y, N, threads);
        return 0;
    }
    return int8_matmul(x, M, K, (int)p->rotate, (const int8_t *)p->panels, P, p->scale, p->rowsum, p->bias, y, N,
                       codes, rowq, threads);
}

enum { ACT_GELU = 0, ACT_GELU_TANH = 1, ACT_RELU = 2 };

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, so r is exact to float precision), e^r by
 * its Taylor series to r^7 (|r| <= 0.347: the first term left out is below 2.3e-9), times 2^n built in the
 * exponent bits. Inputs below -87.3 give 0 (softmax's masked and far-below-the-maximum scores). */
static inline __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

/* e^x at AVX-512's width: exp_ps's operations, each the same in every lane, so the same bits. */
AVX512 static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(bits));
}

/* erf on [0, 4) in 4 pieces of width 1, each a degree-9 polynomial in u, the distance from its middle
 * (coefficient k of piece i: ERF_PIECES[k][i]); 1 past 4 (erf(4) = 1 - 1.5e-8 rounds to 1). Each lane picks its
 * piece's coefficients by an in-lane permute (the 4 values sit in both halves of the register): 9 FMAs, 10
 * permutes, no division and no exp. The rational form this replaced (x P(x^2) below 1, 1 - e^(-x^2) R(1/(1+x))
 * above) took twice as long: GELU over a 128-token layer's 196,608 values 180-220 -> 89-96 us on the AVX2
 * EPYC, two threads. scripts/fit_erf.py fits the table (Chebyshev least squares in float64) and prints it with
 * the float32 error of this evaluation: 8.8e-8 at most (tests/test_fused_layer.py checks the table is its output). */
static const float ERF_PIECES[10][4] = {
    {5.204998851e-01f, 9.661051631e-01f, 9.995930195e-01f, 9.999992847e-01f},
    {8.787825704e-01f, 1.189302877e-01f, 2.178284340e-03f, 5.399429028e-06f},
    {-4.393907487e-01f, -1.783954203e-01f, -5.445736926e-03f, -1.889634405e-05f},
    {-1.464641392e-01f, 1.387522072e-01f, 8.350082673e-03f, 4.229531623e-05f},
    {1.830619723e-01f, -4.459944740e-02f, -8.621518500e-03f, -6.777083763e-05f},
    {7.331535686e-03f, -1.487084292e-02f, 6.117499899e-03f, 8.212085231e-05f},
    {-4.984138906e-02f, 1.933342963e-02f, -2.808213001e-03f, -7.714565436e-05f},
    {5.327904597e-03f, -4.701159894e-03f, 5.410769954e-04f, 5.814713222e-05f},
    {9.115515277e-03f, -2.401931444e-03f, 3.063140030e-04f, -3.703756374e-05f},
    {-1.850174041e-03f, 1.540404046e-03f, -2.453946800e-04f, 1.554410119e-05f},
};

static inline __m256 erf_ps(__m256 x) {
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    /* |x| clamped below 4 (a NaN becomes the clamp; GELU's product with x brings the NaN back) */
    const __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(3.9999998f));
    const __m256i piece = _mm256_cvttps_epi32(a);
    const __m256 u = _mm256_sub_ps(a, _mm256_add_ps(_mm256_cvtepi32_ps(piece), _mm256_set1_ps(0.5f)));
#define COEFFICIENT(k) _mm256_permutevar_ps(_mm256_broadcast_ps((const __m128 *)ERF_PIECES[k]), piece)
    /* two Horner chains of degree 4, low(u) + u^5 high(u): half the dependent steps of one chain */
    __m256 low = COEFFICIENT(4), high = COEFFICIENT(9);
    for (int k = 3; k >= 0; --k) low = _mm256_fmadd_ps(low, u, COEFFICIENT(k));
    for (int k = 8; k >= 5; --k) high = _mm256_fmadd_ps(high, u, COEFFICIENT(k));
#undef COEFFICIENT
    const __m256 u2 = _mm256_mul_ps(u, u);
    return _mm256_or_ps(_mm256_fmadd_ps(high, _mm256_mul_ps(_mm256_mul_ps(u2, u2), u), low), sign);
}

static inline __m256 act_ps(__m256 x, int act) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    if (act == ACT_RELU) return _mm256_max_ps(x, _mm256_setzero_ps());
    if (act == ACT_GELU)
        return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, erf_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)))));
    /* tanh form: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); 1 + tanh(u) = 2 - 2 / (e^(2u) + 1) */
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
    const __m256 e = exp_ps(_mm256_add_ps(u, u));
    const __m256 onep = _mm256_sub_ps(_mm256_set1_ps(2.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), onep);
}

/* erf_ps and act_ps at AVX-512's width: their operations, each the same in every lane, so the same bits (the
 * coefficients' permute is within each 128-bit lane at either width). */
AVX512 static inline __m512 erf512(__m512 x) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(3.9999998f));
    const __m512i piece = _mm512_cvttps_epi32(a);
    const __m512 u = _mm512_sub_ps(a, _mm512_add_ps(_mm512_cvtepi32_ps(piece), _mm512_set1_ps(0.5f)));
#define COEFFICIENT(k) _mm512_permutevar_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(ERF_PIECES[k])), piece)
    __m512 low = COEFFICIENT(4), high = COEFFICIENT(9);
    for (int k = 3; k >= 0; --k) low = _mm512_fmadd_ps(low, u, COEFFICIENT(k));
    for (int k = 8; k >= 5; --k) high = _mm512_fmadd_ps(high, u, COEFFICIENT(k));
#undef COEFFICIENT
    const __m512 u2 = _mm512_mul_ps(u, u);
    const __m512 value = _mm512_fmadd_ps(high, _mm512_mul_ps(_mm512_mul_ps(u2, u2), u), low);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), _mm512_castps_si512(sign)));
}

AVX512 static inline __m512 act512(__m512 x, int act) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    if (act == ACT_RELU) return _mm512_max_ps(x, _mm512_setzero_ps());
    if (act == ACT_GELU)
        return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, erf512(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)))));
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.79788456080286536f),
                                   _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
    const __m512 e = exp512(_mm512_add_ps(u, u));
    const __m512 onep = _mm512_sub_ps(_mm512_set1_ps(2.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    return _mm512_mul_ps(_mm512_mul_ps(half, x), onep);
}

AVX512 static void activate512(float *y, int64_t n, int act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 8192)
    for (int64_t i = 0; i < n; i += 16) {
        if (i + 16 <= n)
            _mm512_storeu_ps(y + i, act512(_mm512_loadu_ps(y + i), act));
        else /* n % 16 == 8: the last 8 as act_ps */
            _mm256_storeu_ps(y + i, act_ps(_mm256_loadu_ps(y + i), act));
    }
}

/* y[i] = act(y[i]) over n floats, n a multiple of 8 (the caller's widths are); at the matmuls' width. */
static void activate(float *y, int64_t n, int act, int threads) {
    if (tiled_matmul_isa() == 512) {
        activate512(y, n, act, threads);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 8192)
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, act_ps(_mm256_loadu_ps(y + i), act));
}

/* The activation alone, exported for the tests (n a multiple of 8). */
void fused_activation(float *y, int64_t n, int act, int threads) {
    if (n > 0 && n % 8 == 0 && act >= 0 && act <= 2) activate(y, n, act, threads);
}

/* row = LayerNorm(row + more) * w + b, H a multiple of 8; mean and variance in double. */
static inline void norm_row(float *row, const float *more, int64_t H, const float *w, const float *b, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(more + i));
        _mm256_storeu_ps(row + i, v);
        sum += hsum(v);
    }
    const float mean = (float)(sum / (double)H);
    const __m256 m = _mm256_set1_ps(mean);
    double squares = 0.0;
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(row + i), m);
        squares += hsum(_mm256_mul_ps(d, d));
    }
    const __m256 scale = _mm256_set1_ps((float)(1.0 / sqrt(squares / (double)H + (double)eps)));
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), m), scale);
        _mm256_storeu_ps(row + i, _mm256_fmadd_ps(d, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
    }
}

/* x[r] = LayerNorm(x[r] + add[r]) * w + b for every row (norm_row). */
static void add_norm(float *x, const float *add, int64_t rows, int64_t H, const float *w, const float *b, float eps,
                     int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * H >= 8192)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * H, add + r * H, H, w, b, eps);
}

/* BertEmbeddings for inference, `rows` tokens (sequences of `tokens` laid end to end) in one call:
 *
 *     out[r] = LayerNorm((word[ids[r]] + type[types[r]]) + pos[p]) * w + b,   p = positions[r], or r % tokens
 *
 * the sums in torch's order (bert_engine/model.py), the norm as the layers' (norm_row). type and types NULL: no
 * segment embeddings (DistilBERT); positions NULL: 0 .. tokens-1 in each sequence. E a multiple of 8. Every id is
 * checked against its table first: -1 (nothing written) where one is outside it, so the caller runs the torch
 * modules, which name it; else 0. At a request's few dozen tokens this is a few microseconds, where the seven
 * torch operators it replaces took 0.15-0.4 ms on the AVX2 EPYC. */
int fused_embeddings(const int64_t *ids, const int64_t *types, const int64_t *positions, int64_t rows, int64_t tokens,
                     int64_t E, const float *word, int64_t vocab, const float *type, int64_t type_vocab, const float *pos,
                     int64_t max_positions, const float *w, const float *b, float eps, float *out, int threads) {
    if (rows <= 0 || tokens <= 0 || E <= 0 || E % 8 || (type == NULL) != (types == NULL)) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t p = positions != NULL ? positions[r] : r % tokens;
        if (ids[r] < 0 || ids[r] >= vocab || p < 0 || p >= max_positions ||
            (types != NULL && (types[r] < 0 || types[r] >= type_vocab)))
            return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * E >= 8192)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = out + r * E;
        const float *from = word + ids[r] * E;
        if (types != NULL) {
            const float *segment = type + types[r] * E;
            for (int64_t i = 0; i < E; i += 8)
                _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(from + i), _mm256_loadu_ps(segment + i)));
        } else {
            memcpy(row, from, sizeof(float) * (size_t)E);
        }
        norm_row(row, pos + (positions != NULL ? positions[r] : r % tokens) * E, E, w, b, eps);
    }
    return 0;
}

/* A head's keys transposed (kt: D x Lp, zero past L) and its values copied (vc: L x D) next to each other, for
 * attend_head and attend_head512. */
static void stage_head(const float *k, const float *v, int64_t stride, int64_t L, int64_t Lp, int64_t D, float *kt,
                       float *vc) {
    for (int64_t j = 0; j < L; ++j) {
        for (int64_t d = 0; d < D; ++d) kt[d * Lp + j] = k[j * stride + d];
        memcpy(vc + j * D, v + j * stride, sizeof(float) * (size_t)D);
    }
    for (int64_t d = 0; d < D; ++d)
        for (int64_t j = L; j < Lp; ++j) kt[d * Lp + j] = 0.0f;
}

#define QB 6 /* queries at a time: each key and value row loaded serves six (12 sums in registers) */

/* softmax(q k^T / sqrt(D)) v for one sequence of L rows and one head (D a multiple of 8, at most 256), for its
 * first `queries` rows (the query rows are computed as they are with all L: the first alone is the same bits):
 * q, k, v rows `stride` floats apart; context rows H apart. Scratch: kt (D x Lp, Lp = L rounded up to 16),
 * vc (L x D), scores (QB x Lp). k is transposed and v copied next to each other first: read in place, each
 * of their rows lies on another page (3H floats apart), and every block of queries would walk them again. */
static void attend_head(const float *q, const float *k, const float *v, int64_t stride, int64_t L, int64_t queries,
                        int64_t D, float *context, int64_t H, float *kt, float *vc, float *scores) {
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    stage_head(k, v, stride, L, Lp, D, kt, vc);
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)D));
    for (int64_t i0 = 0; i0 < queries; i0 += QB) { /* the first `queries` rows: all L, or the first alone */
        const float *qr[QB];
        for (int r = 0; r < QB; ++r) qr[r] = q + (i0 + r < L ? i0 + r : L - 1) * stride; /* past L: repeats, unused */
        /* scores: QB queries x 16 keys per step, twelve sums in registers */
        for (int64_t j = 0; j < Lp; j += 16) {
            __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00,
                   s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
            const float *col = kt + j;
            for (int64_t d = 0; d < D; ++d) {
                const __m256 k0 = _mm256_loadu_ps(col + d * Lp), k1 = _mm256_loadu_ps(col + d * Lp + 8);
                __m256 b = _mm256_set1_ps(qr[0][d]);
                s00 = _mm256_fmadd_ps(b, k0, s00), s01 = _mm256_fmadd_ps(b, k1, s01);
                b = _mm256_set1_ps(qr[1][d]);
                s10 = _mm256_fmadd_ps(b, k0, s10), s11 = _mm256_fmadd_ps(b, k1, s11);
                b = _mm256_set1_ps(qr[2][d]);
                s20 = _mm256_fmadd_ps(b, k0, s20), s21 = _mm256_fmadd_ps(b, k1, s21);
                b = _mm256_set1_ps(qr[3][d]);
                s30 = _mm256_fmadd_ps(b, k0, s30), s31 = _mm256_fmadd_ps(b, k1, s31);
                b = _mm256_set1_ps(qr[4][d]);
                s40 = _mm256_fmadd_ps(b, k0, s40), s41 = _mm256_fmadd_ps(b, k1, s41);
                b = _mm256_set1_ps(qr[5][d]);
                s50 = _mm256_fmadd_ps(b, k0, s50), s51 = _mm256_fmadd_ps(b, k1, s51);
            }
            _mm256_storeu_ps(scores + 0 * Lp + j, _mm256_mul_ps(s00, scale));
            _mm256_storeu_ps(scores + 0 * Lp + j + 8, _mm256_mul_ps(s01, scale));
            _mm256_storeu_ps(scores + 1 * Lp + j, _mm256_mul_ps(s10, scale));
            _mm256_storeu_ps(scores + 1 * Lp + j + 8, _mm256_mul_ps(s11, scale));
            _mm256_storeu_ps(scores + 2 * Lp + j, _mm256_mul_ps(s20, scale));
            _mm256_storeu_ps(scores + 2 * Lp + j + 8, _mm256_mul_ps(s21, scale));
            _mm256_storeu_ps(scores + 3 * Lp + j, _mm256_mul_ps(s30, scale));
            _mm256_storeu_ps(scores + 3 * Lp + j + 8, _mm256_mul_ps(s31, scale));
            _mm256_storeu_ps(scores + 4 * Lp + j, _mm256_mul_ps(s40, scale));
            _mm256_storeu_ps(scores + 4 * Lp + j + 8, _mm256_mul_ps(s41, scale));
            _mm256_storeu_ps(scores + 5 * Lp + j, _mm256_mul_ps(s50, scale));
            _mm256_storeu_ps(scores + 5 * Lp + j + 8, _mm256_mul_ps(s51, scale));
        }
        float inv[QB];
        for (int r = 0; r < QB; ++r) { /* softmax of each row; the padded keys' scores are set to -inf first */
            float *row = scores + r * Lp;
            for (int64_t j = L; j < Lp; ++j) row[j] = -INFINITY;
            __m256 top = _mm256_set1_ps(-INFINITY);
            for (int64_t j = 0; j < Lp; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
            top = _mm256_set1_ps(hmax(top));
            __m256 total = _mm256_setzero_ps();
            for (int64_t j = 0; j < Lp; j += 8) {
                const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), top));
                _mm256_storeu_ps(row + j, e);
                total = _mm256_add_ps(total, e);
            }
            inv[r] = 1.0f / hsum(total);
        }
        /* context: QB queries x 16 of D per step, over the keys; D % 16 == 8 leaves one step of 8 */
        for (int64_t d = 0; d < D; d += 16) {
            const int wide = d + 16 <= D;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
            for (int64_t j = 0; j < L; ++j) {
                const __m256 v0 = _mm256_loadu_ps(vc + j * D + d);
                const __m256 v1 = wide ? _mm256_loadu_ps(vc + j * D + d + 8) : _mm256_setzero_ps();
                __m256 b = _mm256_set1_ps(scores[j]);
                a00 = _mm256_fmadd_ps(b, v0, a00), a01 = _mm256_fmadd_ps(b, v1, a01);
                b = _mm256_set1_ps(scores[Lp + j]);
                a10 = _mm256_fmadd_ps(b, v0, a10), a11 = _mm256_fmadd_ps(b, v1, a11);
                b = _mm256_set1_ps(scores[2 * Lp + j]);
                a20 = _mm256_fmadd_ps(b, v0, a20), a21 = _mm256_fmadd_ps(b, v1, a21);
                b = _mm256_set1_ps(scores[3 * Lp + j]);
                a30 = _mm256_fmadd_ps(b, v0, a30), a31 = _mm256_fmadd_ps(b, v1, a31);
                b = _mm256_set1_ps(scores[4 * Lp + j]);
                a40 = _mm256_fmadd_ps(b, v0, a40), a41 = _mm256_fmadd_ps(b, v1, a41);
                b = _mm256_set1_ps(scores[5 * Lp + j]);
                a50 = _mm256_fmadd_ps(b, v0, a50), a51 = _mm256_fmadd_ps(b, v1, a51);
            }
            const __m256 out[QB][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
            for (int r = 0; r < QB && i0 + r < queries; ++r) {
                float *dst = context + (i0 + r) * H + d;
                const __m256 m = _mm256_set1_ps(inv[r]);
                _mm256_storeu_ps(dst, _mm256_mul_ps(out[r][0], m));
                if (wide) _mm256_storeu_ps(dst + 8, _mm256_mul_ps(out[r][1], m));
            }
        }
    }
}

/* attend_head at AVX-512's width: QB queries x 32 keys (scores) and QB queries x 32 of D (context) per step, two
 * ZMM registers a query where attend_head has two YMM; the last step's second half (16 keys, or what is left of
 * D) masked. Every score and context value is the same chain of fused multiply-adds as there, each softmax
 * total is summed 8 lanes at a time in the same order, so the outputs are the same bits. */
AVX512 static void attend_head512(const float *q, const float *k, const float *v, int64_t stride, int64_t L,
                                  int64_t queries, int64_t D, float *context, int64_t H, float *kt, float *vc,
                                  float *scores) {
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    stage_head(k, v, stride, L, Lp, D, kt, vc);
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)D));
    for (int64_t i0 = 0; i0 < queries; i0 += QB) {
        const float *qr[QB];
        for (int r = 0; r < QB; ++r) qr[r] = q + (i0 + r < L ? i0 + r : L - 1) * stride;
        for (int64_t j = 0; j < Lp; j += 32) {
            const __mmask16 m1 = j + 32 <= Lp ? 0xFFFF : 0; /* Lp is a multiple of 16 */
            __m512 s00 = _mm512_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00,
                   s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
            const float *col = kt + j;
            for (int64_t d = 0; d < D; ++d) {
                const __m512 k0 = _mm512_loadu_ps(col + d * Lp), k1 = _mm512_maskz_loadu_ps(m1, col + d * Lp + 16);
                __m512 b = _mm512_set1_ps(qr[0][d]);
                s00 = _mm512_fmadd_ps(b, k0, s00), s01 = _mm512_fmadd_ps(b, k1, s01);
                b = _mm512_set1_ps(qr[1][d]);
                s10 = _mm512_fmadd_ps(b, k0, s10), s11 = _mm512_fmadd_ps(b, k1, s11);
                b = _mm512_set1_ps(qr[2][d]);
                s20 = _mm512_fmadd_ps(b, k0, s20), s21 = _mm512_fmadd_ps(b, k1, s21);
                b = _mm512_set1_ps(qr[3][d]);
                s30 = _mm512_fmadd_ps(b, k0, s30), s31 = _mm512_fmadd_ps(b, k1, s31);
                b = _mm512_set1_ps(qr[4][d]);
                s40 = _mm512_fmadd_ps(b, k0, s40), s41 = _mm512_fmadd_ps(b, k1, s41);
                b = _mm512_set1_ps(qr[5][d]);
                s50 = _mm512_fmadd_ps(b, k0, s50), s51 = _mm512_fmadd_ps(b, k1, s51);
            }
            const __m512 sums[QB][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}, {s40, s41}, {s50, s51}};
            for (int r = 0; r < QB; ++r) {
                _mm512_storeu_ps(scores + r * Lp + j, _mm512_mul_ps(sums[r][0], scale));
                _mm512_mask_storeu_ps(scores + r * Lp + j + 16, m1, _mm512_mul_ps(sums[r][1], scale));
            }
        }
        float inv[QB];
        for (int r = 0; r < QB; ++r) {
            float *row = scores + r * Lp;
            for (int64_t j = L; j < Lp; ++j) row[j] = -INFINITY;
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < Lp; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top)); /* a maximum is exact in any order */
            __m256 total = _mm256_setzero_ps();
            for (int64_t j = 0; j < Lp; j += 16) {
                const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
                _mm512_storeu_ps(row + j, e);
                total = _mm256_add_ps(total, _mm512_castps512_ps256(e)); /* as attend_head: 8 at a time */
                total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
            }
            inv[r] = 1.0f / hsum(total);
        }
        for (int64_t d = 0; d < D; d += 32) {
            const int64_t left = D - d;
            const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
            for (int64_t j = 0; j < L; ++j) {
                const __m512 v0 = _mm512_maskz_loadu_ps(m0, vc + j * D + d);
                const __m512 v1 = _mm512_maskz_loadu_ps(m1, vc + j * D + d + 16);
                __m512 b = _mm512_set1_ps(scores[j]);
                a00 = _mm512_fmadd_ps(b, v0, a00), a01 = _mm512_fmadd_ps(b, v1, a01);
                b = _mm512_set1_ps(scores[Lp + j]);
                a10 = _mm512_fmadd_ps(b, v0, a10), a11 = _mm512_fmadd_ps(b, v1, a11);
                b = _mm512_set1_ps(scores[2 * Lp + j]);
                a20 = _mm512_fmadd_ps(b, v0, a20), a21 = _mm512_fmadd_ps(b, v1, a21);
                b = _mm512_set1_ps(scores[3 * Lp + j]);
                a30 = _mm512_fmadd_ps(b, v0, a30), a31 = _mm512_fmadd_ps(b, v1, a31);
                b = _mm512_set1_ps(scores[4 * Lp + j]);
                a40 = _mm512_fmadd_ps(b, v0, a40), a41 = _mm512_fmadd_ps(b, v1, a41);
                b = _mm512_set1_ps(scores[5 * Lp + j]);
                a50 = _mm512_fmadd_ps(b, v0, a50), a51 = _mm512_fmadd_ps(b, v1, a51);
            }
            const __m512 out[QB][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
            for (int r = 0; r < QB && i0 + r < queries; ++r) {
                float *dst = context + (i0 + r) * H + d;
                const __m512 m = _mm512_set1_ps(inv[r]);
                _mm512_mask_storeu_ps(dst, m0, _mm512_mul_ps(out[r][0], m));
                _mm512_mask_storeu_ps(dst + 16, m1, _mm512_mul_ps(out[r][1], m));
            }
        }
    }
}

/* Every head's attention for the sequences of qkv (rows x 3H, [q | k | v] per row; sequence s's rows from
 * offsets[s] - base to offsets[s + 1] - base, at most `longest`) into context (rows x H; with `first_only`, one
 * row per sequence: its first query's). Sequences and heads are shared among the threads; each is computed on
 * its own, so the values do not depend on the threads. Returns 0, or -2 where memory runs out. */
static int attend(const float *qkv, const int64_t *offsets, int64_t base, int64_t seqs, int64_t longest, int64_t H,
                  int64_t heads, float *context, int threads, int first_only) {
    const int64_t D = H / heads;
    int failed = 0;
    const int wide = tiled_matmul_isa() == 512; /* attention at the width the matmuls run at: the same bits */
#pragma omp parallel num_threads(threads) if (threads > 1 && seqs * heads > 1)
    {
        const int64_t padded = (longest + 15) & ~(int64_t)15;
        float *kt = malloc(sizeof(float) * (size_t)(2 * D * padded + QB * padded));
        if (kt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < seqs * heads; ++item) {
            if (kt == NULL) continue;
            const int64_t s = item / heads, h = item % heads, start = offsets[s] - base, L = offsets[s + 1] - offsets[s];
            const float *at = qkv + start * 3 * H + h * D;
            (wide ? attend_head512 : attend_head)(at, at + H, at + 2 * H, 3 * H, L, first_only ? 1 : L, D,
                        context + (first_only ? s : start) * H + h * D, H, kt, kt + D * padded, kt + 2 * D * padded);
        }
        free(kt);
    }
    return failed ? -2 : 0;
}

/* attend over a whole call's sequences, for a layer whose matmuls run elsewhere (oneDNN's): softmax(q k^T /
 * sqrt(D)) v per sequence and head over its own rows alone (no padding), qkv (rows x 3H) to context (rows x H).
 * Returns 0, -1 for shapes this code does not handle, -2 where memory runs out. */
int fused_attention(const float *qkv, int64_t rows, const int64_t *offsets, int64_t seqs, int64_t H, int64_t heads,
                    float *context, int threads) {
    const int64_t D = heads > 0 ? H / heads : 0;
    if (rows <= 0 || seqs <= 0 || H % 8 || D * heads != H || D % 8 || D > 256 || offsets[0] != 0 ||
        offsets[seqs] != rows)
        return -1;
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; ++s) {
        if (offsets[s + 1] <= offsets[s]) return -1;
        if (offsets[s + 1] - offsets[s] > longest) longest = offsets[s + 1] - offsets[s];
    }
    return attend(qkv, offsets, 0, seqs, longest, H, heads, context, threads, 0);
}

/* The layer over the rows of sequences s0 .. s0 + seqs - 1 (x: the first of them; offsets: the whole call's,
 * `base` = offsets[s0]); see fused_layer. */
static int layer_part(float *x, int64_t rows, const int64_t *offsets, int64_t base, int64_t seqs, int64_t H,
                      int64_t heads, int64_t I, const projection *proj, const float *ln1_w, const float *ln1_b,
                      float eps1, int act, const float *ln2_w, const float *ln2_b, float eps2, float *scratch,
                      int threads, float *first) {
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; ++s)
        if (offsets[s + 1] - offsets[s] > longest) longest = offsets[s + 1] - offsets[s];
    float *qkv = scratch, *context = qkv + rows * 3 * H, *inner = context + rows * H, *projected = inner + rows * I;
    float *rowq = projected + rows * H;
    uint8_t *codes = (uint8_t *)(rowq + 2 * rows); /* rows x (I rounded up to 4) bytes: the widest input */
    if (project(&proj[0], x, rows, H, qkv, 3 * H, codes, rowq, threads)) return -1;
    if (attend(qkv, offsets, base, seqs, longest, H, heads, context, threads, first != NULL)) return -2;
    float *out = x;
    int64_t n = rows;
    if (first != NULL) { /* from here on, the first rows alone */
        for (int64_t s = 0; s < seqs; ++s) memcpy(first + s * H, x + (offsets[s] - base) * H, sizeof(float) * (size_t)H);
        out = first, n = seqs;
    }
    if (project(&proj[1], context, n, H, projected, H, codes, rowq, threads)) return -1;
    add_norm(out, projected, n, H, ln1_w, ln1_b, eps1, threads);
    if (project(&proj[2], out, n, H, inner, I, codes, rowq, threads)) return -1;
    activate(inner, n * I, act, threads);
    if (project(&proj[3], inner, n, I, projected, H, codes, rowq, threads)) return -1;
    add_norm(out, projected, n, H, ln2_w, ln2_b, eps2, threads);
    return 0;
}

/* The layer over x (rows x H) in place; see the top of this file. proj: the four projections qkv, out, up,
 * down; qkv gives 3H outputs ordered [q | k | v], each H = heads x D wide; up gives I. The sequences go through
 * in groups of whole sequences of at most `group_rows` rows (one longer sequence alone): every step works per
 * row or per sequence, so the grouping changes no value, and a group's intermediates (5H + I floats a row) stay
 * in cache and in the caller's scratch: G x (5H + I) floats, G the largest group's rows (group_rows, or the
 * longest sequence past it, at most `rows`), and where a projection is int8, G x (ceil(max(H, I) / 4) + 2)
 * more. With `first` (not NULL: seqs x H), only each sequence's first row goes on past the attention (what a
 * classifier over [CLS] reads): its keys and values are every row's, and its output, the same bits as the whole
 * layer's first row, is written to `first`, x left as it came. Returns 0, -1 where the shapes are not ones this
 * code handles (the caller then runs the torch modules), -2 where memory runs out. */
int fused_layer(float *x, int64_t rows, const int64_t *offsets, int64_t seqs, int64_t H, int64_t heads, int64_t I,
                const projection *proj, const float *ln1_w, const float *ln1_b, float eps1, int act,
                const float *ln2_w, const float *ln2_b, float eps2, float *scratch, int threads, float *first,
                int64_t group_rows) {
    const int64_t D = heads > 0 ? H / heads : 0;
    if (rows <= 0 || seqs <= 0 || H % 8 || I % 8 || D * heads != H || D % 8 || D > 256 || act < 0 || act > 2 ||
        offsets[0] != 0 || offsets[seqs] != rows)
        return -1;
    for (int64_t s = 0; s < seqs; ++s)
        if (offsets[s + 1] <= offsets[s]) return -1;
    for (int64_t s0 = 0; s0 < seqs;) {
        int64_t s1 = s0 + 1;
        while (s1 < seqs && offsets[s1 + 1] - offsets[s0] <= group_rows) ++s1;
        const int status = layer_part(x + offsets[s0] * H, offsets[s1] - offsets[s0], offsets + s0, offsets[s0],
                                      s1 - s0, H, heads, I, proj, ln1_w, ln1_b, eps1, act, ln2_w, ln2_b, eps2, scratch,
                                      threads, first != NULL ? first + s0 * H : NULL);
        if (status) return status;
        s0 = s1;
    }
    return 0;
}

/* Every layer of an encoder in one call, for short inputs where a layer's own call costs more around it than the
 * C code takes (a visitor's 1-24 tokens: 0.3-1 ms a layer, with 0.1-0.3 ms of Python around each): fused_layer
 * for layers 0 .. layers - 1 in turn over x in place, layer l with projections proj[4l .. 4l + 3], norms
 * norms[4l .. 4l + 3] (the first's weight and bias, the second's), epsilons eps[2l], eps[2l + 1] and activation
 * acts[l]; `first` as fused_layer's, for the last layer alone. The same bits as fused_layer called once a layer.
 * Returns 0, or the status of the first layer that failed (x then holds an unfinished layer: the caller starts
 * again from its own copy). */
int fused_stack(float *x, int64_t rows, const int64_t *offsets, int64_t seqs, int64_t H, int64_t heads, int64_t I,
                int64_t layers, const projection *proj, const float *const *norms, const float *eps, const int *acts,
                float *scratch, int threads, float *first, int64_t group_rows) {
    if (layers <= 0) return -1;
    for (int64_t l = 0; l < layers; ++l) {
        const int status = fused_layer(x, rows, offsets, seqs, H, heads, I, proj + 4 * l, norms[4 * l],
                                       norms[4 * l + 1], eps[2 * l], acts[l], norms[4 * l + 2], norms[4 * l + 3],
                                       eps[2 * l + 1], scratch, threads, l == layers - 1 ? first : NULL, group_rows);
        if (status) return status;
    }
    return 0;
}
