/* bert_engine's own fp32 matmul for x86-64 CPUs with AVX2 and FMA: y = x W^T + b.
 *
 * The weight W (N x K) is laid out once in panels of 16 output columns, panel p holding W[16p .. 16p+15][k]
 * for k = 0 .. K-1 as K runs of 16 floats (zero-padded past N). A tile of up to 6 rows x 16 columns of y
 * sums in 12 AVX registers; each step of k broadcasts one float of each of the 6 rows and multiplies it
 * into the panel's two 8-float halves. A thread takes whole panels (and, for long inputs, chunks of
 * rows), so a panel is read from memory once and then from cache for every tile of rows: at the few rows
 * of one request (a sentence is 10-50 tokens) the weights' trip from memory is the cost, and they make it
 * once. Each output is one row's sum over k in a fixed order, whatever the other rows and the threads:
 * a text's outputs do not depend on its batch. The sums restart every KBLOCK steps of k and are added into the tile's totals, which keeps
 * rounding close to a blocked GEMM's over long K.
 *
 * Built at first use by bert_engine/runtime/native.py with the system's C compiler
 * (-O3 -funroll-loops -mavx2 -mfma -fopenmp), loaded with ctypes; threads are OpenMP's, the count passed in by the
 * caller (torch's own setting), so the kernel shares torch's thread pool (the same libgomp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16      /* output columns per panel: two AVX registers */
#define MR 6       /* rows per tile: 12 accumulators + 2 panel halves + 1 broadcast = 15 of 16 registers */
#define KBLOCK 128 /* steps of k summed in registers before they are added into the tile's totals */
#define MCHUNK 192 /* rows a thread takes at once on long inputs (a multiple of MR) */
#define FETCH_TILES 8 /* the most tiles of rows a panel may take for them to fetch the next panel */

int tiled_matmul_version(void) { return 2; }

/* A tile of `rows` rows against one panel. With `next` (not NULL), one cache line of the next panel is
 * fetched every `every` steps of k, starting there: see tiled_matmul. */
static inline void tile(int rows, const float *a, int64_t lda, const float *panel, int64_t K,
                        float totals[MR][NR], const float *next, int every) {
    int count = 0;
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda,
                    *a5 = a + 5 * lda;
        /* One loop per row count keeps every accumulator in a register (a loop over an array of them
         * makes the compiler spill them to memory on every step). */
#define STEP_ROW(r)                                                                                      \
    {                                                                                                    \
        const __m256 x = _mm256_broadcast_ss(a##r + k);                                                  \
        c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0);                                                       \
        c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);                                                       \
    }
#define PLAIN_LOOP(BODY)                                                                                 \
    for (int64_t k = k0; k < k1; ++k) {                                                                  \
        const __m256 b0 = _mm256_loadu_ps(panel + k * NR), b1 = _mm256_loadu_ps(panel + k * NR + 8);     \
        BODY                                                                                             \
    }
#define FETCHING_LOOP(BODY)                                                                              \
    for (int64_t k = k0; k < k1; ++k) {                                                                  \
        if (++count == every) {                                                                          \
            count = 0;                                                                                   \
            _mm_prefetch((const char *)next, _MM_HINT_T0);                                               \
            next += NR;                                                                                  \
        }                                                                                                \
        const __m256 b0 = _mm256_loadu_ps(panel + k * NR), b1 = _mm256_loadu_ps(panel + k * NR + 8);     \
        BODY                                                                                             \
    }
/* two copies of each loop: a test for `next` inside one costs 5-20 % where it is NULL */
#define LOOP(BODY) if (next != NULL) { FETCHING_LOOP(BODY) } else { PLAIN_LOOP(BODY) }
        switch (rows) {
        case 6: LOOP(STEP_ROW(0) STEP_ROW(1) STEP_ROW(2) STEP_ROW(3) STEP_ROW(4) STEP_ROW(5)) break;
        case 5: LOOP(STEP_ROW(0) STEP_ROW(1) STEP_ROW(2) STEP_ROW(3) STEP_ROW(4)) break;
        case 4: LOOP(STEP_ROW(0) STEP_ROW(1) STEP_ROW(2) STEP_ROW(3)) break;
        case 3: LOOP(STEP_ROW(0) STEP_ROW(1) STEP_ROW(2)) break;
        case 2: LOOP(STEP_ROW(0) STEP_ROW(1)) break;
        default: LOOP(STEP_ROW(0)) break;
        }
#undef LOOP
#undef PLAIN_LOOP
#undef FETCHING_LOOP
#undef STEP_ROW
        const __m256 sums[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
        for (int r = 0; r < rows; ++r) {
            _mm256_storeu_ps(totals[r], _mm256_add_ps(_mm256_loadu_ps(totals[r]), sums[r][0]));
            _mm256_storeu_ps(totals[r] + 8, _mm256_add_ps(_mm256_loadu_ps(totals[r] + 8), sums[r][1]));
        }
    }
}

/* y[M x N] = x[M x K] W^T + bias (bias may be NULL); panels as above, P = ceil(N / 16) of them. */
void tiled_matmul(const float *x, int64_t M, int64_t K, const float *panels, int64_t P, const float *bias,
                  float *y, int64_t N, int threads) {
    const int64_t chunks = (M + MCHUNK - 1) / MCHUNK, work = P * chunks;
    /* Panels first while x fits in cache (each thread's panels read once, x from cache for each); on
     * inputs past that, chunks of rows first, so a chunk of x stays in cache while the panels pass. */
    const int rows_first = M * K * (int64_t)sizeof(float) > ((int64_t)2 << 20);
    if (M <= 0 || N <= 0) return;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work > 1)
    for (int64_t item = 0; item < work; ++item) {
        const int64_t p = rows_first ? item % P : item / chunks;
        const int64_t m_start = (rows_first ? item / P : item % chunks) * MCHUNK;
        const int64_t m_end = m_start + MCHUNK < M ? m_start + MCHUNK : M;
        const int64_t col = p * NR, cols = N - col < NR ? N - col : NR;
        const float *panel = panels + p * K * NR;
        float start[NR];
        for (int j = 0; j < NR; ++j) start[j] = bias != NULL && j < cols ? bias[col + j] : 0.0f;
        for (int64_t m = m_start; m < m_end; m += MR) {
            const int rows = m_end - m < MR ? (int)(m_end - m) : MR;
            float totals[MR][NR];
            for (int r = 0; r < rows; ++r) memcpy(totals[r], start, sizeof start);
            /* Where a panel takes 2 to FETCH_TILES tiles (7-48 rows), each tile fetches its share of the
             * next panel, spread over its steps, while it computes from cache: the next panel's trip from
             * memory overlaps this one's arithmetic, where alone the first tile of each panel waits for it.
             * Measured on the AVX2 EPYC (MiniLM's 24 projections in turn): 12 rows 18-22 % faster, 24 rows
             * 4-16 %, 1 and 48-128 rows level. Fetching changes no value. */
            const int64_t tiles = (m_end - m_start + MR - 1) / MR, t = (m - m_start) / MR;
            const float *next = tiles > 1 && tiles <= FETCH_TILES && p + 1 < P && !rows_first
                                    ? panel + K * NR + (t * K / tiles) * NR : NULL;
            tile(rows, x + m * K, K, panel, K, totals, next, (int)tiles);
            for (int r = 0; r < rows; ++r) memcpy(y + (m + r) * N + col, totals[r], (size_t)cols * sizeof(float));
        }
    }
}
