/* kvstrata: CPU decode attention straight from the paged KV cache.
 *
 * One new token per sequence attends to the positions [lo[i], hi[i]) of its sequence:
 *
 *   out[row[i]][h * G + g] = sum_p softmax_p(scale * q . K[p]) V[p]     (kv head h, G = Hq / Hkv)
 *
 * K[p] (V alike) is row p % block_size of physical block table[seq[i]][p / block_size], kv head h,
 * in a cache laid out [num_blocks][block_size][Hkv][D] (the block stride may exceed
 * block_size * Hkv * D). Only the visible rows are read: the table's padding, the null block and
 * slid-out blocks never are, so nothing outside [lo, hi) can reach the output.
 *
 * Per kv head its G query heads share each load of K and V: the scores of up to 16 positions at a
 * time (8 positions per pass, float32 FMAs over D and one transposing sum), an online softmax
 * over those (max, exp, running sum, the accumulator rescaled when the max grows), and the
 * weighted V rows added in position order (16 columns of up to four heads in registers). The next
 * chunk's rows are prefetched meanwhile (blocks lie anywhere). Everything runs in float32; a
 * bf16 or fp16 cache and query are widened exactly, the output rounded to nearest even as
 * torch's .to() does. A head's result depends only on its own query and rows (the same sums in
 * the same order whatever the batch or the thread count). exp is a polynomial (Cephes' expf
 * form: |rel err| < 2e-7 on the range it sees, x <= 0); a NaN score makes the head's output NaN.
 *
 * AVX2 + FMA + F16C (kva_isa() says whether this CPU has them), D % 8 == 0, G <= 16,
 * G * D <= 8192. Parallel over (sequence, kv head) with OpenMP.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVA_TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline)) KVA_TARGET

enum { F32, BF16, F16 }; /* the order of attention_native.DTYPES */
#define CHUNK 16         /* positions scored at a time */
#define MAX_GD 8192      /* floats of query and accumulator per (sequence, kv head): G * D */

int kva_abi_version(void) { return 1; }

int kva_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* 8 elements of a row as float32 */
INLINE __m256 load8(const void *p, int dtype) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* the 8 sums of a0..a7's lanes, as one vector (lane j: a_j's sum) */
INLINE __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* a0..a3: lanes 0-3 | 4-7 halves */
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0 (x = -inf and x < -87.3 give 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by
 * Cephes' degree-5 polynomial, times 2^n through the exponent bits. */
INLINE __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x); /* a NaN x stays NaN (maxps returns its second operand then) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline size_t elem_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* a[h * D + c] += sum_t p[h * CHUNK + t] * V[t][c] for the gn heads h < gn and the 16 columns c
 * (8 when two is 0) of the n rows at v, in row order; gn, two and dtype are constants where it
 * is inlined, so the unused heads and columns cost nothing. */
INLINE void add_pv(const int gn, const int two, const int dtype, const float *p, const char *v, long tok_stride,
                   int n, float *a, int D) {
    const size_t es = elem_size(dtype);
    __m256 z = _mm256_setzero_ps(), acc[8];
    for (int h = 0; h < gn; h++) {
        acc[2 * h] = _mm256_loadu_ps(a + h * D);
        acc[2 * h + 1] = two ? _mm256_loadu_ps(a + h * D + 8) : z;
    }
    for (int t = 0; t < n; t++) {
        const char *vr = v + (size_t)t * tok_stride * es;
        __m256 v0 = load8(vr, dtype), v1 = two ? load8(vr + 8 * es, dtype) : z;
        for (int h = 0; h < gn; h++) {
            __m256 ph = _mm256_set1_ps(p[h * CHUNK + t]);
            acc[2 * h] = _mm256_fmadd_ps(ph, v0, acc[2 * h]);
            if (two) acc[2 * h + 1] = _mm256_fmadd_ps(ph, v1, acc[2 * h + 1]);
        }
    }
    for (int h = 0; h < gn; h++) {
        _mm256_storeu_ps(a + h * D, acc[2 * h]);
        if (two) _mm256_storeu_ps(a + h * D + 8, acc[2 * h + 1]);
    }
}

/* One chunk of n positions (rows at k, v: token stride tok_stride elements) for one kv head's G
 * query heads (qf: their float32 queries, acc / m / l: their running state). */
INLINE void chunk_head(const int dtype, const float *qf, float *acc, float *m, float *l, const char *k, const char *v,
                       long tok_stride, int n, int G, int D, float scale) {
    const size_t es = elem_size(dtype);
    float s[16 * CHUNK]; /* CHUNK scores per head, G <= 16 */
    /* scores, per head 8 positions at a time (8 independent FMA chains, one transposing sum);
     * the positions past n read row n-1 again and are masked below */
    for (int g = 0; g < G; g++) {
        const float *qg = qf + g * D;
        for (int t0 = 0; t0 < n; t0 += 8) {
            const char *kr[8];
            for (int j = 0; j < 8; j++) kr[j] = k + (size_t)(t0 + j < n ? t0 + j : n - 1) * tok_stride * es;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qg + d);
                a0 = _mm256_fmadd_ps(qv, load8(kr[0] + d * es, dtype), a0);
                a1 = _mm256_fmadd_ps(qv, load8(kr[1] + d * es, dtype), a1);
                a2 = _mm256_fmadd_ps(qv, load8(kr[2] + d * es, dtype), a2);
                a3 = _mm256_fmadd_ps(qv, load8(kr[3] + d * es, dtype), a3);
                a4 = _mm256_fmadd_ps(qv, load8(kr[4] + d * es, dtype), a4);
                a5 = _mm256_fmadd_ps(qv, load8(kr[5] + d * es, dtype), a5);
                a6 = _mm256_fmadd_ps(qv, load8(kr[6] + d * es, dtype), a6);
                a7 = _mm256_fmadd_ps(qv, load8(kr[7] + d * es, dtype), a7);
            }
            _mm256_storeu_ps(s + g * CHUNK + t0,
                             _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
        }
    }
    /* online softmax over the chunk: p = e^(s - max), the accumulator rescaled when the max grows */
    for (int g = 0; g < G; g++) {
        float *sg = s + g * CHUNK;
        for (int t = n; t < CHUNK; t++) sg[t] = -INFINITY;
        __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
        float mx = hmax(_mm256_max_ps(s0, s1));
        if (mx > m[g]) {
            if (m[g] != -INFINITY) { /* else nothing came before: acc and l are zero */
                float alpha = _mm256_cvtss_f32(exp_neg(_mm256_set1_ps(m[g] - mx)));
                l[g] *= alpha;
                __m256 va = _mm256_set1_ps(alpha);
                float *ag = acc + g * D;
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(ag + d, _mm256_mul_ps(_mm256_loadu_ps(ag + d), va));
            }
            m[g] = mx;
        }
        __m256 vm = _mm256_set1_ps(m[g]);
        _mm256_storeu_ps(sg, exp_neg(_mm256_sub_ps(s0, vm)));
        _mm256_storeu_ps(sg + 8, exp_neg(_mm256_sub_ps(s1, vm)));
        for (int t = 0; t < n; t++) l[g] += sg[t];
    }
    /* acc += p V, in position order: 16 columns of up to four heads in registers at a time */
    for (int d = 0; d < D; d += 16) {
        for (int g0 = 0; g0 < G; g0 += 4) {
            float *a = acc + g0 * D + d;
            const float *p = s + g0 * CHUNK;
            const char *vd = v + (size_t)d * es;
            switch (G - g0) {
            case 1: add_pv(1, D - d >= 16, dtype, p, vd, tok_stride, n, a, D); break;
            case 2: add_pv(2, D - d >= 16, dtype, p, vd, tok_stride, n, a, D); break;
            case 3: add_pv(3, D - d >= 16, dtype, p, vd, tok_stride, n, a, D); break;
            default: add_pv(4, D - d >= 16, dtype, p, vd, tok_stride, n, a, D); break;
            }
        }
    }
}

/* The chunk at position p (< hi): its byte offset in the cache and its length. */
static inline void next_chunk(int p, int hi, int block_size, long block_stride, long tok_stride, size_t es,
                              const int32_t *table, size_t *base, int *n) {
    int blk = p / block_size, off = p - blk * block_size, len = block_size - off;
    if (len > hi - p) len = hi - p;
    *n = len > CHUNK ? CHUNK : len;
    *base = ((size_t)table[blk] * block_stride + (size_t)off * tok_stride) * es;
}

/* One (sequence, kv head): kc, vc, q and out already point at the head; q and out hold its G
 * query heads at head stride D elements. dtype is a constant in each of the three instances
 * below, so every load is straight-line code. */
INLINE void attend(const int dtype, const char *q, const char *kc, const char *vc, long block_stride, int block_size,
                   long tok_stride, const int32_t *table, int lo, int hi, int G, int D, float scale, char *out) {
    const size_t es = elem_size(dtype);
    const int row_bytes = D * (int)es;
    float qf[MAX_GD], acc[MAX_GD], m[16], l[16];
    for (int i = 0; i < G * D; i += 8) _mm256_storeu_ps(qf + i, load8(q + (size_t)i * es, dtype));
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    for (int p0 = lo; p0 < hi;) {
        size_t base;
        int n;
        next_chunk(p0, hi, block_size, block_stride, tok_stride, es, table, &base, &n);
        if (p0 + n < hi) { /* the next chunk's rows into L2 while this one computes (blocks lie anywhere;
                            * into L1 measured slower: the misses queue up) */
            size_t nbase;
            int nn;
            next_chunk(p0 + n, hi, block_size, block_stride, tok_stride, es, table, &nbase, &nn);
            for (int t = 0; t < nn; t++)
                for (int c = 0; c < row_bytes; c += 64) {
                    _mm_prefetch(kc + nbase + (size_t)t * tok_stride * es + c, _MM_HINT_T1);
                    _mm_prefetch(vc + nbase + (size_t)t * tok_stride * es + c, _MM_HINT_T1);
                }
        }
        chunk_head(dtype, qf, acc, m, l, kc + base, vc + base, tok_stride, n, G, D, scale);
        p0 += n;
    }
    for (int g = 0; g < G; g++) {
        float inv = 1.0f / l[g];
        const float *ag = acc + g * D;
        char *og = out + (size_t)g * D * es;
        for (int d = 0; d < D; d++) {
            float o = ag[d] * inv;
            if (dtype == F32) ((float *)og)[d] = o;
            else if (dtype == BF16) ((uint16_t *)og)[d] = to_bf16(o);
            else ((uint16_t *)og)[d] = _cvtss_sh(o, _MM_FROUND_TO_NEAREST_INT);
        }
    }
}

#define ATTEND(name, DT)                                                                                        \
    KVA_TARGET __attribute__((noinline)) static void name(const char *q, const char *kc, const char *vc,      \
                                                          long bst, int bs, long ts, const int32_t *table,    \
                                                          int lo, int hi, int G, int D, float sc, char *o) {  \
        attend(DT, q, kc, vc, bst, bs, ts, table, lo, hi, G, D, sc, o);                                       \
    }
ATTEND(attend_f32, F32)
ATTEND(attend_bf16, BF16)
ATTEND(attend_f16, F16)

/* Decode attention for nseq sequences (see the top). q / out: [T][Hq][D] with token strides
 * q_stride / out_stride (elements); tables: int32 rows of table_stride; seq, row, lo, hi: int32
 * per sequence (its table row, its token's row in q and out, its visible positions). Returns 0,
 * or -1 when the shapes are out of range (nothing written). A work item is one (sequence, kv head):
 * measured faster than a sequence's kv heads chunk by chunk together. */
int kva_decode(int dtype, const void *q, long q_stride, const void *kc, const void *vc, long block_stride,
               int block_size, int hkv, int D, int G, const int32_t *tables, long table_stride,
               const int32_t *seq, const int32_t *row, const int32_t *lo, const int32_t *hi, int nseq, float scale,
               void *out, long out_stride, int nthreads) {
    if (dtype < F32 || dtype > F16 || D % 8 || D <= 0 || G <= 0 || G > 16 || G * D > MAX_GD || block_size <= 0 ||
        hkv <= 0)
        return -1;
    const size_t es = elem_size(dtype);
    const long tok_stride = (long)hkv * D;
    const long items = (long)nseq * hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && items > 1)
    for (long it = 0; it < items; it++) {
        int i = (int)(it / hkv), h = (int)(it % hkv);
        const char *qp = (const char *)q + ((size_t)row[i] * q_stride + (size_t)h * G * D) * es;
        char *op = (char *)out + ((size_t)row[i] * out_stride + (size_t)h * G * D) * es;
        void (*fn)(const char *, const char *, const char *, long, int, long, const int32_t *, int, int, int, int,
                   float, char *) = dtype == F32 ? attend_f32 : dtype == BF16 ? attend_bf16 : attend_f16;
        fn(qp, (const char *)kc + (size_t)h * D * es, (const char *)vc + (size_t)h * D * es, block_stride,
           block_size, tok_stride, tables + (size_t)seq[i] * table_stride, lo[i], hi[i], G, D, scale, op);
    }
    return 0;
}
