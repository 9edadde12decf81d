/* A linear-chain CRF's two recursions for one row, as bert_engine/crf.py's numpy versions compute them:
 * n-best Viterbi (float32, the same operations in the same order, so the same paths and scores to the bit)
 * and scaled forward-backward (float64; sums in another order than numpy's, so within 1e-15). A visitor's
 * sentence is ~20 steps over 9 tags: numpy spends ~35 microseconds a step dispatching small operations,
 * this a few hundred nanoseconds.
 *
 * Layouts: em S x L (the row's selected positions), trans L x L [from][to], start and end L.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int crf_decode_version(void) { return 1; }

/* Inserts (value, index) into the top-k list (best first; an equal value goes after those already there, as
 * a stable sort of the candidates in index order puts it). */
static void keep_best(float *values, int64_t *indices, int64_t *count, int64_t k, float value, int64_t index) {
    int64_t at = *count;
    if (at == k) {
        if (!(value > values[k - 1])) return;
        at = k - 1;
    } else {
        ++*count;
    }
    while (at > 0 && value > values[at - 1]) {
        values[at] = values[at - 1];
        indices[at] = indices[at - 1];
        --at;
    }
    values[at] = value;
    indices[at] = index;
}

/* The K best paths of the row's S steps: paths (K x S tags, best first) and scores (K); returns how many
 * were written (paths scoring -inf are left out), or -1 where memory runs out. */
int64_t crf_viterbi_nbest(const float *em, int64_t S, int64_t L, const float *trans, const float *start,
                          const float *end, int64_t K, int64_t *paths, float *scores) {
    if (S <= 0 || L <= 0 || K <= 0) return 0;
    float *best = malloc(sizeof(float) * (size_t)(2 * L * K));
    int64_t *pointers = malloc(sizeof(int64_t) * (size_t)((S > 1 ? S - 1 : 1) * L * K));
    float *values = malloc(sizeof(float) * (size_t)K);
    int64_t *chosen = malloc(sizeof(int64_t) * (size_t)K);
    if (best == NULL || pointers == NULL || values == NULL || chosen == NULL) {
        free(best), free(pointers), free(values), free(chosen);
        return -1;
    }
    float *now = best, *next = best + L * K;
    for (int64_t l = 0; l < L; ++l)
        for (int64_t r = 0; r < K; ++r) now[l * K + r] = r == 0 ? start[l] + em[l] : -INFINITY;
    for (int64_t s = 1; s < S; ++s) {
        for (int64_t to = 0; to < L; ++to) {
            int64_t count = 0;
            for (int64_t from = 0; from < L; ++from) {
                const float move = trans[from * L + to] + em[s * L + to];
                for (int64_t r = 0; r < K; ++r)
                    keep_best(values, chosen, &count, K, now[from * K + r] + move, from * K + r);
            }
            for (int64_t r = 0; r < K; ++r) {
                next[to * K + r] = values[r];
                pointers[((s - 1) * L + to) * K + r] = chosen[r];
            }
        }
        float *swap = now;
        now = next, next = swap;
    }
    int64_t count = 0;
    for (int64_t flat = 0; flat < L * K; ++flat) keep_best(values, chosen, &count, K, now[flat] + end[flat / K], flat);
    int64_t found = 0;
    for (int64_t i = 0; i < count; ++i) {
        if (values[i] == -INFINITY) continue;
        int64_t tag = chosen[i] / K, rank = chosen[i] % K;
        int64_t *path = paths + found * S;
        path[S - 1] = tag;
        for (int64_t s = S - 1; s > 0; --s) {
            const int64_t back = pointers[((s - 1) * L + tag) * K + rank];
            tag = back / K, rank = back % K;
            path[s - 1] = tag;
        }
        scores[found++] = values[i];
    }
    free(best), free(pointers), free(values), free(chosen);
    return found;
}

/* Marginals (S x L) and log Z of the row, by forward-backward in probability space with each step's vector
 * rescaled to sum 1, as crf.py's _scaled_forward_backward. Returns 0, 1 where a sum is zero or not finite
 * (the caller falls back to the log-space recursion), or -1 where memory runs out. */
int crf_forward_backward(const double *em, int64_t S, int64_t L, const double *trans, const double *start,
                         const double *end, double *probs, double *log_z) {
    if (S <= 0 || L <= 0) return 1;
    double *steps = malloc(sizeof(double) * (size_t)((S > 1 ? S - 1 : 1) * L * L));
    double *alphas = malloc(sizeof(double) * (size_t)(S * L)), *vector = malloc(sizeof(double) * (size_t)(2 * L));
    if (steps == NULL || alphas == NULL || vector == NULL) {
        free(steps), free(alphas), free(vector);
        return -1;
    }
    double *other = vector + L, log_sum = 0.0;
    for (int64_t s = 1; s < S; ++s) { /* exp(trans + em[s] - the step's largest), [from][to] */
        double *step = steps + (s - 1) * L * L, shift = -INFINITY;
        for (int64_t i = 0; i < L * L; ++i) {
            step[i] = trans[i] + em[s * L + i % L];
            shift = step[i] > shift ? step[i] : shift;
        }
        for (int64_t i = 0; i < L * L; ++i) step[i] = exp(step[i] - shift);
        log_sum += shift;
    }
    double top = -INFINITY;
    for (int64_t l = 0; l < L; ++l) top = fmax(top, start[l] + em[l]);
    for (int64_t l = 0; l < L; ++l) vector[l] = exp(start[l] + em[l] - top);
    log_sum += top;
    for (int64_t s = 0; s < S; ++s) {
        if (s) {
            const double *step = steps + (s - 1) * L * L;
            for (int64_t to = 0; to < L; ++to) {
                double sum = 0.0;
                for (int64_t from = 0; from < L; ++from) sum += vector[from] * step[from * L + to];
                other[to] = sum;
            }
            memcpy(vector, other, sizeof(double) * (size_t)L);
        }
        double total = 0.0;
        for (int64_t l = 0; l < L; ++l) total += vector[l];
        for (int64_t l = 0; l < L; ++l) alphas[s * L + l] = vector[l] /= total;
        log_sum += log(total);
    }
    double top_end = -INFINITY, closing = 0.0;
    for (int64_t l = 0; l < L; ++l) top_end = fmax(top_end, end[l]);
    for (int64_t l = 0; l < L; ++l) {
        other[l] = exp(end[l] - top_end);
        closing += vector[l] * other[l];
    }
    *log_z = log_sum + log(closing) + top_end;
    memcpy(vector, other, sizeof(double) * (size_t)L);
    int bad = !isfinite(*log_z);
    for (int64_t s = S - 1; s >= 0 && !bad; --s) {
        if (s < S - 1) {
            const double *step = steps + s * L * L;
            for (int64_t from = 0; from < L; ++from) {
                double sum = 0.0;
                for (int64_t to = 0; to < L; ++to) sum += step[from * L + to] * vector[to];
                other[from] = sum;
            }
            memcpy(vector, other, sizeof(double) * (size_t)L);
        }
        double total = 0.0, joint = 0.0;
        for (int64_t l = 0; l < L; ++l) total += vector[l];
        for (int64_t l = 0; l < L; ++l) {
            vector[l] /= total;
            if (!isfinite(vector[l])) bad = 1;
            probs[s * L + l] = alphas[s * L + l] * vector[l];
            joint += probs[s * L + l];
        }
        if (!(joint > 0.0)) bad = 1;
        for (int64_t l = 0; l < L && !bad; ++l) probs[s * L + l] /= joint;
    }
    free(steps), free(alphas), free(vector);
    return bad ? 1 : 0;
}
