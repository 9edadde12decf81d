/* bert_engine's own fp32 matmul for x86-64 CPUs with AVX2 and FMA: y = x W^T + b (and, where the CPU has AVX-512F
 * and native.py asks for it, the same sums at AVX-512's width: tiled_matmul512 below, and blocked_matmul512 past
 * 96 rows).
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
#include <stdlib.h>
#include <string.h>

#define NR 16      /* output columns per panel: two AVX registers */
#define MR 6       /* rows per tile: 12 accumulators + 2 panel halves + 1 broadcast = 15 of 16 registers */
#define KBLOCK 128 /* steps of k summed in registers before they are added into the tile's totals */
#define MCHUNK 192 /* rows a thread takes at once on long inputs (a multiple of MR) */
#define FETCH_TILES 8 /* the most tiles of rows a panel may take for them to fetch the next panel */

int tiled_matmul_version(void) { return 3; }

/* The vector width tiled_matmul runs at: 256 (AVX2 + FMA) unless tiled_matmul_set_isa(512) was called on a CPU
 * with AVX-512F (native.py calls it where torch's own capability is AVX512). Both give the same bits: each
 * output is the same chain of fused multiply-adds over k in either. */
static int isa512 = 0;

int tiled_matmul_isa(void) { return isa512 ? 512 : 256; }

int tiled_matmul_set_isa(int bits) {
    __builtin_cpu_init();
    isa512 = bits == 512 && __builtin_cpu_supports("avx512f");
    return isa512 ? 512 : 256;
}

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

/* AVX-512: a tile of up to MR512 rows x two panels (32 columns) sums in 2 x MR512 of the 32 ZMM registers;
 * each step of k loads one cache line of each panel and broadcasts one float of each row. A single panel (the
 * last of an odd count) runs as a pair with itself and its second half is dropped. The sums restart every
 * KBLOCK steps as above: each output is the same chain of operations as in the AVX2 tile. */
#define MR512 12
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

/* The AVX-512 kernels' tiles of 1 to MR512 rows: R<n> is STEP_ROW for rows 0 .. n-1 and BY_ROWS runs LOOP of the
 * tile's row count (each kernel defines STEP_ROW and LOOP around its use): a loop per row count keeps every
 * accumulator in a register. */
#define R1 STEP_ROW(0)
#define R2 R1 STEP_ROW(1)
#define R3 R2 STEP_ROW(2)
#define R4 R3 STEP_ROW(3)
#define R5 R4 STEP_ROW(4)
#define R6 R5 STEP_ROW(5)
#define R7 R6 STEP_ROW(6)
#define R8 R7 STEP_ROW(7)
#define R9 R8 STEP_ROW(8)
#define R10 R9 STEP_ROW(9)
#define R11 R10 STEP_ROW(A)
#define R12 R11 STEP_ROW(B)
#define BY_ROWS(rows)                                                                                    \
    switch (rows) {                                                                                      \
    case 12: LOOP(R12) break;                                                                            \
    case 11: LOOP(R11) break;                                                                            \
    case 10: LOOP(R10) break;                                                                            \
    case 9: LOOP(R9) break;                                                                              \
    case 8: LOOP(R8) break;                                                                              \
    case 7: LOOP(R7) break;                                                                              \
    case 6: LOOP(R6) break;                                                                              \
    case 5: LOOP(R5) break;                                                                              \
    case 4: LOOP(R4) break;                                                                              \
    case 3: LOOP(R3) break;                                                                              \
    case 2: LOOP(R2) break;                                                                              \
    default: LOOP(R1) break;                                                                             \
    }

AVX512 static inline void tile512(int rows, const float *a, int64_t lda, const float *p0, const float *p1,
                                  int64_t K, float totals[MR512][2 * NR], const float *next, int64_t next_gap,
                                  int every) {
    int count = 0;
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
               c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00,
               c80 = c00, c81 = c00, c90 = c00, c91 = c00, cA0 = c00, cA1 = c00, cB0 = c00, cB1 = c00;
        const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda,
                    *a5 = a + 5 * lda, *a6 = a + 6 * lda, *a7 = a + 7 * lda, *a8 = a + 8 * lda, *a9 = a + 9 * lda,
                    *aA = a + 10 * lda, *aB = a + 11 * lda;
#define STEP_ROW(r)                                                                                      \
    {                                                                                                    \
        const __m512 x = _mm512_set1_ps(a##r[k]);                                                        \
        c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0);                                                       \
        c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);                                                       \
    }
#define PLAIN_LOOP(BODY)                                                                                 \
    for (int64_t k = k0; k < k1; ++k) {                                                                  \
        const __m512 b0 = _mm512_loadu_ps(p0 + k * NR), b1 = _mm512_loadu_ps(p1 + k * NR);               \
        BODY                                                                                             \
    }
#define FETCHING_LOOP(BODY)                                                                              \
    for (int64_t k = k0; k < k1; ++k) {                                                                  \
        if (++count == every) {                                                                          \
            count = 0;                                                                                   \
            _mm_prefetch((const char *)next, _MM_HINT_T0);                                               \
            _mm_prefetch((const char *)(next + next_gap), _MM_HINT_T0);                                  \
            next += NR;                                                                                  \
        }                                                                                                \
        const __m512 b0 = _mm512_loadu_ps(p0 + k * NR), b1 = _mm512_loadu_ps(p1 + k * NR);               \
        BODY                                                                                             \
    }
#define LOOP(BODY) if (next != NULL) { FETCHING_LOOP(BODY) } else { PLAIN_LOOP(BODY) }
        BY_ROWS(rows)
#undef LOOP
#undef PLAIN_LOOP
#undef FETCHING_LOOP
#undef STEP_ROW
        const __m512 sums[MR512][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51},
                                       {c60, c61}, {c70, c71}, {c80, c81}, {c90, c91}, {cA0, cA1}, {cB0, cB1}};
        for (int r = 0; r < rows; ++r) {
            _mm512_storeu_ps(totals[r], _mm512_add_ps(_mm512_loadu_ps(totals[r]), sums[r][0]));
            _mm512_storeu_ps(totals[r] + NR, _mm512_add_ps(_mm512_loadu_ps(totals[r] + NR), sums[r][1]));
        }
    }
}

/* Past FETCH_TILES tiles of rows (97 rows and more), at AVX-512's width: x first copied tile by tile, each tile's
 * rows in runs of 16 steps of k ([k / 16][row][k % 16]: a row's run is one cache line), then, for each pair of
 * panels, one KBLOCK of k at a time for every tile: the pair's 16 KB of that block stays in L1 while the tiles
 * pass, and each tile's rows come in order from one pointer. The sums are those of tile512 (a block's sum added
 * into the totals, here kept in y itself, in the same order): the same bits. On the Cascade Lake Xeon a whole
 * MiniLM forward with each layer in one call ran 1.03-1.05x faster with it at 128-192 tokens (the two builds in
 * one process, 30 rounds in turn; session 41); below 97 rows tile512's fetching of the next pair is worth more
 * (0.9x at 24 rows without it). Up to 2 MB of x (past that, chunks of rows: tiled_matmul512) the copy is made
 * once per call; where it cannot be allocated, tiled_matmul512 runs instead. */
#define KRUN 16

AVX512 static inline void block512(int rows, const float *a, const float *p0, const float *p1, int64_t steps,
                                   float *y, int64_t ldy, __mmask16 m0, __mmask16 m1, const char **next,
                                   const char *end, int lines) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00, c80 = c00,
           c81 = c00, c90 = c00, c91 = c00, cA0 = c00, cA1 = c00, cB0 = c00, cB1 = c00;
#define STEP_ROW(r)                                                                                      \
    {                                                                                                    \
        const __m512 x = _mm512_set1_ps(run[0x##r * KRUN + j]);                                          \
        c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0);                                                       \
        c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);                                                       \
    }
#define LOOP(BODY)                                                                                       \
    for (int64_t k = 0; k < steps; k += KRUN) {                                                          \
        const float *run = a + (k / KRUN) * (MR512 * KRUN);                                              \
        const int n = steps - k < KRUN ? (int)(steps - k) : KRUN;                                        \
        for (int f = 0; f < lines && *next < end; ++f, *next += 64) _mm_prefetch(*next, _MM_HINT_T1);     \
        if (n == KRUN) {                                                                                 \
            for (int j = 0; j < KRUN; ++j) {                                                             \
                const __m512 b0 = _mm512_loadu_ps(p0 + (k + j) * NR), b1 = _mm512_loadu_ps(p1 + (k + j) * NR); \
                BODY                                                                                     \
            }                                                                                            \
        } else {                                                                                         \
            for (int j = 0; j < n; ++j) {                                                                \
                const __m512 b0 = _mm512_loadu_ps(p0 + (k + j) * NR), b1 = _mm512_loadu_ps(p1 + (k + j) * NR); \
                BODY                                                                                     \
            }                                                                                            \
        }                                                                                                \
    }
    BY_ROWS(rows)
#undef LOOP
#undef STEP_ROW
    const __m512 sums[MR512][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51},
                                   {c60, c61}, {c70, c71}, {c80, c81}, {c90, c91}, {cA0, cA1}, {cB0, cB1}};
    for (int r = 0; r < rows; ++r) {
        float *o = y + r * ldy;
        _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), sums[r][0]));
        _mm512_mask_storeu_ps(o + NR, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + NR), sums[r][1]));
    }
}

/* tiled_matmul512 through block512, each thread taking whole pairs of panels; returns -2 (nothing written) where
 * the copy of x cannot be allocated. */
AVX512 static int blocked_matmul512(const float *x, int64_t M, int64_t K, const float *panels, int64_t P,
                                    const float *bias, float *y, int64_t N, int threads) {
    const int64_t pairs = (P + 1) / 2, tiles = (M + MR512 - 1) / MR512, runs = (K + KRUN - 1) / KRUN;
    const int64_t tile_floats = runs * MR512 * KRUN;
    float *packed = aligned_alloc(64, (size_t)(tiles * tile_floats) * sizeof(float));
    if (packed == NULL) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int rows = M - t * MR512 < MR512 ? (int)(M - t * MR512) : MR512;
            for (int64_t u = 0; u < runs; ++u) {
                const int64_t k = u * KRUN, n = K - k < KRUN ? K - k : KRUN;
                float *run = packed + t * tile_floats + u * MR512 * KRUN;
                for (int r = 0; r < rows; ++r) memcpy(run + r * KRUN, x + (t * MR512 + r) * K + k, (size_t)n * sizeof(float));
            }
        }
#pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; ++q) {
            const int64_t col = q * 2 * NR, cols = N - col < 2 * NR ? N - col : 2 * NR;
            const __mmask16 m0 = cols >= NR ? 0xFFFF : (__mmask16)((1u << cols) - 1);
            const __mmask16 m1 = cols >= 2 * NR ? 0xFFFF : cols > NR ? (__mmask16)((1u << (cols - NR)) - 1) : 0;
            const float *p0 = panels + 2 * q * K * NR, *p1 = 2 * q + 1 < P ? p0 + K * NR : p0;
            const __m512 s0 = bias != NULL ? _mm512_maskz_loadu_ps(m0, bias + col) : _mm512_setzero_ps();
            const __m512 s1 = bias != NULL ? _mm512_maskz_loadu_ps(m1, bias + col + NR) : _mm512_setzero_ps();
            for (int64_t m = 0; m < M; ++m) {
                _mm512_mask_storeu_ps(y + m * N + col, m0, s0);
                _mm512_mask_storeu_ps(y + m * N + col + NR, m1, s1);
            }
            /* The next pair's panels (2 K x 16 floats, one run in memory, 2K cache lines) fetched into L2 while this
             * pair computes: ceil(32 / tiles) lines every KRUN steps of k, so that up to 32 tiles (384 rows) the last
             * arrives as this pair ends, and past that sooner (at 32 / tiles of the pair). Without it, the first tile
             * of each of the pair's blocks waited for the pair's trip from memory (an encoder's weights do not stay
             * in cache from one forward to the next). Under schedule(static) a thread's last pair fetches the next
             * thread's first one, into its own L2: harmless. On the Ice Lake Xeon (benchmarks/README.md, session 48)
             * one projection with its weights from memory ran 3-13 % faster at 100-384 rows, a whole MiniLM forward
             * 3-5 % at 128-192 tokens; into L1 (_MM_HINT_T0) was level with L2 there, and L2 leaves the 32 KB L1 of
             * other CPUs to the pair at work. */
            const char *next = (const char *)(panels + 2 * (q + 1) * K * NR);
            const char *end = (const char *)(panels + (2 * q + 4 < P ? 2 * q + 4 : P) * K * NR);
            const int lines = (int)((32 + tiles - 1) / tiles); /* 2K lines over tiles x K / KRUN runs */
            for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
                const int64_t steps = K - k0 < KBLOCK ? K - k0 : KBLOCK;
                for (int64_t t = 0; t < tiles; ++t) {
                    const int rows = M - t * MR512 < MR512 ? (int)(M - t * MR512) : MR512;
                    block512(rows, packed + t * tile_floats + (k0 / KRUN) * MR512 * KRUN, p0 + k0 * NR, p1 + k0 * NR,
                             steps, y + t * MR512 * N + col, N, m0, m1, &next, end, lines);
                }
            }
        }
    }
    free(packed);
    return 0;
}

/* tiled_matmul on AVX-512: as below, over pairs of panels and tiles of MR512 rows. */
AVX512 static void tiled_matmul512(const float *x, int64_t M, int64_t K, const float *panels, int64_t P,
                                   const float *bias, float *y, int64_t N, int threads) {
    const int64_t pairs = (P + 1) / 2, chunks = (M + MCHUNK - 1) / MCHUNK, work = pairs * chunks;
    const int rows_first = M * K * (int64_t)sizeof(float) > ((int64_t)2 << 20);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work > 1)
    for (int64_t item = 0; item < work; ++item) {
        const int64_t q = rows_first ? item % pairs : item / chunks;
        const int64_t m_start = (rows_first ? item / pairs : item % chunks) * MCHUNK;
        const int64_t m_end = m_start + MCHUNK < M ? m_start + MCHUNK : M;
        const int64_t col = q * 2 * NR, cols = N - col < 2 * NR ? N - col : 2 * NR;
        const float *p0 = panels + 2 * q * K * NR, *p1 = 2 * q + 1 < P ? p0 + K * NR : p0;
        float start[2 * NR];
        for (int j = 0; j < 2 * NR; ++j) start[j] = bias != NULL && j < cols ? bias[col + j] : 0.0f;
        for (int64_t m = m_start; m < m_end; m += MR512) {
            const int rows = m_end - m < MR512 ? (int)(m_end - m) : MR512;
            float totals[MR512][2 * NR];
            for (int r = 0; r < rows; ++r) memcpy(totals[r], start, sizeof start);
            /* The next pair's panels fetched as in tiled_matmul, both at once, and from a single tile too (12 rows:
             * 8-15 % faster on the Cascade Lake Xeon it was measured on, MiniLM's 24 projections in turn). */
            const int64_t tiles = (m_end - m_start + MR512 - 1) / MR512, t = (m - m_start) / MR512;
            const int have_next = 2 * q + 2 < P;
            const float *next = tiles <= FETCH_TILES && have_next && !rows_first
                                    ? p0 + 2 * K * NR + (t * K / tiles) * NR : NULL;
            const int64_t gap = 2 * q + 3 < P ? K * NR : 0;
            tile512(rows, x + m * K, K, p0, p1, K, totals, next, gap, (int)tiles);
            for (int r = 0; r < rows; ++r) memcpy(y + (m + r) * N + col, totals[r], (size_t)cols * sizeof(float));
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
    if (isa512) {
        if (!rows_first && M > FETCH_TILES * MR512 && blocked_matmul512(x, M, K, panels, P, bias, y, N, threads) == 0)
            return;
        tiled_matmul512(x, M, K, panels, P, bias, y, N, threads);
        return;
    }
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
