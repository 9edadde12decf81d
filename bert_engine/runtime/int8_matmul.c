/* bert_engine's own int8 matmul for x86-64 CPUs with AVX2 and no VNNI (and, with AVX-512 VNNI, the same sums
 * through vpdpbusd: int8_products512 below): y = x W^T + b, W in int8, x quantised per row on the way in.
 *
 * The scheme is the one the engine's FBGEMM path uses on such CPUs (runtime/fast.py, Int8Linear), so its
 * answers agree with fp32 as that path's do: the weight's codes in [-127, 127] with one scale per output
 * column (symmetric); each input row, optionally first rotated in Hadamard blocks of 16 (QuaRot-style: a wide
 * channel's range spread over its block), mapped from its own [low, high] onto codes 0..127 (7 bits). Then
 *
 *     y[m][n] = low[m] * rowsum[n] + (high[m] - low[m]) / 127 * scale[n] * sum_k code[m][k] W[n][k] + b[n]
 *
 * with rowsum[n] = scale[n] * sum_k W[n][k] (the codes' row sums). The sum over k runs in int32 through
 * vpmaddubsw (u8 x s8 products added in pairs into int16) and vpmaddwd (pairs of those into int32): 32
 * multiply-adds per pair of instructions, twice an fp32 FMA's 8 per instruction at the same rate on the AVX2
 * EPYC this was written on (Zen 3: 90 against 45 GMAC/s a core, measured). 7-bit codes keep the int16 pair
 * sums from saturating (2 x 127 x 127 < 32767), which AVX2 without VNNI needs. The sums are exact integers, so
 * a row's output does not depend on the rows beside it or on the thread count.
 *
 * Layout: the weight's codes in panels of 16 output columns, K padded to a multiple of 4 (Kq quads): panel p,
 * quad q holds 64 bytes, columns 16p..16p+7 with their 4 codes k = 4q..4q+3 each, then columns 16p+8..16p+15.
 * A tile of up to 4 rows x 16 columns sums in 8 registers; each quad of k broadcasts 4 codes of each row.
 *
 * Built with tiled_matmul.c into one library (runtime/native.py).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QNR 16      /* output columns per panel */
#define QMR 4       /* rows per tile: 8 int32 accumulators, 2 panel halves, the broadcast, ones, a temporary */
#define QMCHUNK 192 /* rows a thread takes at once on long inputs (a multiple of QMR) */
#define QMAX_K 16384 /* the longest rows the quantiser's stack buffer holds */

int int8_matmul_version(void) { return 2; }

/* On CPUs with AVX-512 VNNI, int8_matmul_set_isa(512) runs the sums over k through vpdpbusd instead (u8 x s8 in
 * fours straight into int32, 16 columns a register): the same exact integer sums, so the same bits. */
static int qisa512 = 0;

int int8_matmul_set_isa(int bits) {
    __builtin_cpu_init();
    qisa512 = bits == 512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
    return qisa512 ? 512 : 256;
}

/* codes (N x K int8, row-major) into panels as above; panels holds ceil(N/16) * ceil(K/4) * 64 bytes. */
void int8_pack(const int8_t *codes, int64_t N, int64_t K, int8_t *panels) {
    const int64_t P = (N + QNR - 1) / QNR, Kq = (K + 3) / 4;
    for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Kq; ++q)
            for (int j = 0; j < QNR; ++j)
                for (int t = 0; t < 4; ++t) {
                    const int64_t n = p * QNR + j, k = 4 * q + t;
                    panels[(p * Kq + q) * 64 + (j / 8) * 32 + (j % 8) * 4 + t] = n < N && k < K ? codes[n * K + k] : 0;
                }
}

/* v (16 floats: two registers) times the orthonormal Sylvester Hadamard matrix of size 16, in place:
 * four butterfly stages (a + b, a - b at strides 8, 4, 2, 1), then / 4. */
static inline void hadamard16(__m256 *v0, __m256 *v1) {
    __m256 a = _mm256_add_ps(*v0, *v1), b = _mm256_sub_ps(*v0, *v1);
    __m256 s;
    /* stride 4: lanes 0-3 x + x[+4], lanes 4-7 x[-4] - x */
#define STAGE(V, SWAP, MASK) s = SWAP; V = _mm256_blend_ps(_mm256_add_ps(V, s), _mm256_sub_ps(s, V), MASK);
    STAGE(a, _mm256_permute2f128_ps(a, a, 0x01), 0xF0)
    STAGE(b, _mm256_permute2f128_ps(b, b, 0x01), 0xF0)
    STAGE(a, _mm256_permute_ps(a, 0x4E), 0xCC) /* stride 2 */
    STAGE(b, _mm256_permute_ps(b, 0x4E), 0xCC)
    STAGE(a, _mm256_permute_ps(a, 0xB1), 0xAA) /* stride 1 */
    STAGE(b, _mm256_permute_ps(b, 0xB1), 0xAA)
#undef STAGE
    const __m256 quarter = _mm256_set1_ps(0.25f);
    *v0 = _mm256_mul_ps(a, quarter);
    *v1 = _mm256_mul_ps(b, quarter);
}

/* One row of K floats to Kp codes (zero past K): rotated first when `rotate` (K a multiple of 16), then its
 * [low, high] onto 0..127, rounding to nearest. Writes low and the step (high - low) / 127. */
static void quantize_row(const float *x, int64_t K, int64_t Kp, int rotate, uint8_t *codes, float *low_out,
                         float *step_out) {
    float buffer[QMAX_K];
    const float *row = x;
    if (rotate) {
        for (int64_t k = 0; k < K; k += 16) {
            __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
            hadamard16(&v0, &v1);
            _mm256_storeu_ps(buffer + k, v0);
            _mm256_storeu_ps(buffer + k + 8, v1);
        }
        row = buffer;
    }
    __m256 lo = _mm256_set1_ps(row[0]), hi = lo;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
    }
    float los[8], his[8];
    _mm256_storeu_ps(los, lo);
    _mm256_storeu_ps(his, hi);
    float low = los[0], high = his[0];
    for (int i = 1; i < 8; ++i) {
        low = los[i] < low ? los[i] : low;
        high = his[i] > high ? his[i] : high;
    }
    for (; k < K; ++k) {
        low = row[k] < low ? row[k] : low;
        high = row[k] > high ? row[k] : high;
    }
    float range = high - low;
    if (!(range >= 1e-12f)) range = 1e-12f;
    const float inverse = 127.0f / range;
    const __m256 vlow = _mm256_set1_ps(low), vinv = _mm256_set1_ps(inverse), top = _mm256_set1_ps(127.0f),
                 zero = _mm256_setzero_ps();
    /* 32 codes at a time: four registers of int32, packed to bytes (the packs interleave 128-bit lanes; the
     * final permute puts them back in order) */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i c[4];
        for (int i = 0; i < 4; ++i) {
            __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + k + 8 * i), vlow), vinv);
            v = _mm256_min_ps(_mm256_max_ps(v, zero), top);
            c[i] = _mm256_cvtps_epi32(v);
        }
        const __m256i words = _mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(codes + k), _mm256_permutevar8x32_epi32(words, order));
    }
    for (; k < K; ++k) {
        float v = (row[k] - low) * inverse;
        v = v < 0.0f ? 0.0f : v > 127.0f ? 127.0f : v;
        codes[k] = (uint8_t)_mm_cvtss_si32(_mm_set_ss(v));
    }
    for (; k < Kp; ++k) codes[k] = 0;
    *low_out = low;
    *step_out = range / 127.0f;
}

/* acc (rows x 16 int32) = the tile's codes (rows at a, a stride of lda bytes) times one panel, Kq quads. */
static inline void qtile(int rows, const uint8_t *a, int64_t lda, const int8_t *panel, int64_t Kq,
                         int32_t acc[QMR][QNR]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
            c31 = c00;
    const uint8_t *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
#define QSTEP(r)                                                                                          \
    {                                                                                                     \
        int32_t four;                                                                                     \
        memcpy(&four, a##r + 4 * q, 4);                                                                   \
        const __m256i x = _mm256_set1_epi32(four);                                                        \
        c##r##0 = _mm256_add_epi32(c##r##0, _mm256_madd_epi16(_mm256_maddubs_epi16(x, b0), ones));         \
        c##r##1 = _mm256_add_epi32(c##r##1, _mm256_madd_epi16(_mm256_maddubs_epi16(x, b1), ones));         \
    }
#define QLOOP(BODY)                                                                                       \
    for (int64_t q = 0; q < Kq; ++q) {                                                                    \
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(panel + q * 64));                         \
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(panel + q * 64 + 32));                    \
        BODY                                                                                              \
    }
    switch (rows) {
    case 4: QLOOP(QSTEP(0) QSTEP(1) QSTEP(2) QSTEP(3)) break;
    case 3: QLOOP(QSTEP(0) QSTEP(1) QSTEP(2)) break;
    case 2: QLOOP(QSTEP(0) QSTEP(1)) break;
    default: QLOOP(QSTEP(0)) break;
    }
#undef QLOOP
#undef QSTEP
    const __m256i sums[QMR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_si256((__m256i *)acc[r], sums[r][0]);
        _mm256_storeu_si256((__m256i *)(acc[r] + 8), sums[r][1]);
    }
}

/* y's 16 columns from col (cols of them) for row m from a tile's int32 sums: the scale, row sums and bias applied
 * (see the top of this file). */
static inline void qfinish(const int32_t sum[QNR], float low, float step, const float s[QNR], const float sums[QNR],
                           const float b[QNR], float *y, int cols) {
    float out[QNR];
    for (int half = 0; half < 2; ++half) {
        const __m256 total = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(sum + 8 * half)));
        const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(low), _mm256_loadu_ps(sums + 8 * half),
                                         _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(step),
                                                       _mm256_loadu_ps(s + 8 * half)), total),
                                                       _mm256_loadu_ps(b + 8 * half)));
        _mm256_storeu_ps(out + 8 * half, v);
    }
    memcpy(y, out, (size_t)cols * sizeof(float));
}

/* One panel's scales, row sums and bias (zero past N). */
static inline void qcolumns(int64_t col, int64_t cols, const float *scale, const float *rowsum, const float *bias,
                            float s[QNR], float sums[QNR], float b[QNR]) {
    for (int j = 0; j < QNR; ++j) {
        s[j] = j < cols ? scale[col + j] : 0.0f;
        sums[j] = j < cols ? rowsum[col + j] : 0.0f;
        b[j] = j < cols && bias != NULL ? bias[col + j] : 0.0f;
    }
}

/* VNNI: a tile of up to QMR512 rows x two panels (32 columns) in 24 ZMM registers of int32 sums; a single last
 * panel runs as a pair with itself (its second half dropped). */
#define QMR512 12
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

VNNI static inline void qtile512(int rows, const uint8_t *a, int64_t lda, const int8_t *p0, const int8_t *p1,
                                 int64_t Kq, int32_t acc[QMR512][2 * QNR]) {
    __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
            c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00,
            c80 = c00, c81 = c00, c90 = c00, c91 = c00, cA0 = c00, cA1 = c00, cB0 = c00, cB1 = c00;
    const uint8_t *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda,
                  *a6 = a + 6 * lda, *a7 = a + 7 * lda, *a8 = a + 8 * lda, *a9 = a + 9 * lda, *aA = a + 10 * lda,
                  *aB = a + 11 * lda;
#define QSTEP(r)                                                                                          \
    {                                                                                                     \
        int32_t four;                                                                                     \
        memcpy(&four, a##r + 4 * q, 4);                                                                   \
        const __m512i x = _mm512_set1_epi32(four);                                                        \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, x, b0);                                                    \
        c##r##1 = _mm512_dpbusd_epi32(c##r##1, x, b1);                                                    \
    }
#define QLOOP(BODY)                                                                                       \
    for (int64_t q = 0; q < Kq; ++q) {                                                                    \
        const __m512i b0 = _mm512_loadu_si512((const void *)(p0 + q * 64));                               \
        const __m512i b1 = _mm512_loadu_si512((const void *)(p1 + q * 64));                               \
        BODY                                                                                              \
    }
#define Q1 QSTEP(0)
#define Q2 Q1 QSTEP(1)
#define Q3 Q2 QSTEP(2)
#define Q4 Q3 QSTEP(3)
#define Q5 Q4 QSTEP(4)
#define Q6 Q5 QSTEP(5)
#define Q7 Q6 QSTEP(6)
#define Q8 Q7 QSTEP(7)
#define Q9 Q8 QSTEP(8)
#define Q10 Q9 QSTEP(9)
#define Q11 Q10 QSTEP(A)
#define Q12 Q11 QSTEP(B)
    switch (rows) {
    case 12: QLOOP(Q12) break;
    case 11: QLOOP(Q11) break;
    case 10: QLOOP(Q10) break;
    case 9: QLOOP(Q9) break;
    case 8: QLOOP(Q8) break;
    case 7: QLOOP(Q7) break;
    case 6: QLOOP(Q6) break;
    case 5: QLOOP(Q5) break;
    case 4: QLOOP(Q4) break;
    case 3: QLOOP(Q3) break;
    case 2: QLOOP(Q2) break;
    default: QLOOP(Q1) break;
    }
#undef Q12
#undef Q11
#undef Q10
#undef Q9
#undef Q8
#undef Q7
#undef Q6
#undef Q5
#undef Q4
#undef Q3
#undef Q2
#undef Q1
#undef QLOOP
#undef QSTEP
    const __m512i sums[QMR512][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51},
                                     {c60, c61}, {c70, c71}, {c80, c81}, {c90, c91}, {cA0, cA1}, {cB0, cB1}};
    for (int r = 0; r < rows; ++r) {
        _mm512_storeu_si512((void *)acc[r], sums[r][0]);
        _mm512_storeu_si512((void *)(acc[r] + QNR), sums[r][1]);
    }
}

/* int8_matmul's sums and outputs on VNNI, over pairs of panels. */
VNNI static void int8_products512(const uint8_t *codes, int64_t M, int64_t Kp, const int8_t *panels, int64_t P,
                                  const float *scale, const float *rowsum, const float *bias, float *y, int64_t N,
                                  const float *rowq, int threads) {
    const int64_t Kq = Kp / 4, pairs = (P + 1) / 2, chunks = (M + QMCHUNK - 1) / QMCHUNK, work = pairs * chunks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work > 1)
    for (int64_t item = 0; item < work; ++item) {
        const int64_t pair = item / chunks, m_start = (item % chunks) * QMCHUNK;
        const int64_t m_end = m_start + QMCHUNK < M ? m_start + QMCHUNK : M;
        const int two = 2 * pair + 1 < P;
        const int8_t *p0 = panels + 2 * pair * Kq * 64, *p1 = two ? p0 + Kq * 64 : p0;
        float s[2][QNR], sums[2][QNR], b[2][QNR];
        int64_t col[2], cols[2];
        for (int h = 0; h < 2; ++h) {
            col[h] = (2 * pair + h) * QNR;
            cols[h] = h && !two ? 0 : N - col[h] < QNR ? N - col[h] : QNR;
            qcolumns(col[h], cols[h], scale, rowsum, bias, s[h], sums[h], b[h]);
        }
        for (int64_t m = m_start; m < m_end; m += QMR512) {
            const int rows = m_end - m < QMR512 ? (int)(m_end - m) : QMR512;
            int32_t acc[QMR512][2 * QNR];
            qtile512(rows, codes + m * Kp, Kp, p0, p1, Kq, acc);
            for (int r = 0; r < rows; ++r)
                for (int h = 0; h < 2; ++h)
                    if (cols[h] > 0)
                        qfinish(acc[r] + h * QNR, rowq[2 * (m + r)], rowq[2 * (m + r) + 1], s[h], sums[h], b[h],
                                y + (m + r) * N + col[h], (int)cols[h]);
        }
    }
}

/* y (M x N) = x (M x K) W^T + bias through the int8 panels (P = ceil(N/16) of them) with per-column `scale`
 * and `rowsum` (see the top of this file); bias may be NULL. codes: M x Kp bytes (Kp = K rounded up to 4)
 * and rowq: 2 M floats, the caller's scratch. Returns 0, or -1 where K is beyond this code (rotation needs
 * K a multiple of 16; K at most QMAX_K). */
int int8_matmul(const float *x, int64_t M, int64_t K, int rotate, const int8_t *panels, int64_t P,
                const float *scale, const float *rowsum, const float *bias, float *y, int64_t N, uint8_t *codes,
                float *rowq, int threads) {
    if (K <= 0 || K > QMAX_K || (rotate && K % 16)) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t Kq = (K + 3) / 4, Kp = 4 * Kq;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M * K >= 4096)
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, Kp, rotate, codes + m * Kp, rowq + 2 * m, rowq + 2 * m + 1);
    if (qisa512) {
        int8_products512(codes, M, Kp, panels, P, scale, rowsum, bias, y, N, rowq, threads);
        return 0;
    }
    const int64_t chunks = (M + QMCHUNK - 1) / QMCHUNK, work = P * chunks;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work > 1)
    for (int64_t item = 0; item < work; ++item) {
        const int64_t p = item / chunks, m_start = (item % chunks) * QMCHUNK;
        const int64_t m_end = m_start + QMCHUNK < M ? m_start + QMCHUNK : M;
        const int64_t col = p * QNR, cols = N - col < QNR ? N - col : QNR;
        const int8_t *panel = panels + p * Kq * 64;
        float s[QNR], sums[QNR], b[QNR];
        qcolumns(col, cols, scale, rowsum, bias, s, sums, b);
        for (int64_t m = m_start; m < m_end; m += QMR) {
            const int rows = m_end - m < QMR ? (int)(m_end - m) : QMR;
            int32_t acc[QMR][QNR];
            qtile(rows, codes + m * Kp, Kp, panel, Kq, acc);
            for (int r = 0; r < rows; ++r)
                qfinish(acc[r], rowq[2 * (m + r)], rowq[2 * (m + r) + 1], s, sums, b, y + (m + r) * N + col, (int)cols);
        }
    }
    return 0;
}
