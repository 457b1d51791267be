/* kvstrata: CPU matmuls over quantized weights, bf16 dot products (AVX512_BF16).
 *
 *   out[m][n] = sum_k x[m][k] * w[n][k]        x: bf16 [M][K] (row stride K), out: float32 (row stride ldo)
 *
 * Three kinds of weight, all cut in blocks of 64 output rows b and groups of columns g:
 *
 *   INT4  w = (q - 8) * s[g][n] + z[g][n], q 4 bits, groups of 32. q: the nibbles of torch's
 *         _convert_weight_to_int4pack_for_cpu(q, 1) for N % 64 == 0: per block and column k,
 *         32 bytes at (b * K + k) * 32, byte j = row 64b + j (low nibble) | row 64b + j + 32
 *         (high). sz: bf16 [K/32][N][2] (scale, zero), the same op's scales_and_zeros.
 *         Several planes (Q5, Q8_0 in two) add up: accumulate = 1 adds to out.
 *   Q6K   w = d[k/256][n] * sc[k/16][n] * (q - 32), q 6 bits, groups of 16: Q6_K's bytes
 *         re-laid. lo: the low nibbles as INT4's q; hi: the top two bits, per block and
 *         column 16 bytes at (b * K + k) * 16, byte i = rows 64b + i, +16, +32, +48 at bits
 *         0, 2, 4, 6; sc: int8 [K/16][N]; d: fp16 [K/256][N].
 *   Q8    w = d[k/32][n] * q, q int8, groups of 32: Q8_0's bytes re-laid. q: per block and
 *         column pair kp, 128 bytes at (b * K/2 + kp) * 128, bytes 2r, 2r+1 = row 64b + r at
 *         columns 2kp, 2kp+1; d: fp16 [K/32][N].
 *
 * Per (block, group) the integers become bf16 once (exact: small integers), laid out as
 * vdpbf16ps wants them (16 rows x a column pair per 512-bit register): for 1-4 rows of x
 * straight into registers, for more into a 4 KB tile that every row of x reuses. Each row's
 * group sum sum_k x * q runs in float32 by vdpbf16ps, then takes the group's scale (and
 * INT4's zero: z * the group's sum of x) in float32. So the unpacking is paid once per
 * weight whatever M is, the multiply-adds run at the bf16 dot-product rate (2x float32
 * FMAs), and x is the only rounded operand (to bf16, by the caller). A row's result does
 * not depend on the other rows (the same sums in the same order on either way).
 *
 * Needs AVX512F/BW/VL and AVX512_BF16 (kvq_supported() says so at run time; only the
 * kernels are compiled for them). Parallel over blocks of 64 rows with OpenMP: with torch
 * imported first, its libgomp serves both.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define INLINE static inline __attribute__((always_inline)) KVQ_TARGET

enum { INT4, Q6K, Q8 };

int kvq_abi_version(void) { return 3; }

int kvq_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("fma");
}

/* What a kernel reads, per kind (unused fields NULL). */
typedef struct {
    const uint8_t *q;   /* INT4: nibbles; Q6K: lo; Q8: the int8 values */
    const uint8_t *hi;  /* Q6K: the top two bits */
    const void *scale;  /* INT4: sz (bf16 pairs); Q6K: sc (int8); Q8: d (fp16) */
    const uint16_t *d;  /* Q6K: d (fp16) */
} Weight;

/* bf16 bit patterns of v - off for v = 0..63: the integers' values, exact */
typedef struct {
    __m512i lo, hi;
} Lut;

INLINE Lut make_lut(int off) {
    uint16_t t[64];
    for (int v = 0; v < 64; v++) {
        float f = (float)(v - off);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        t[v] = (uint16_t)(bits >> 16);
    }
    Lut l = {_mm512_loadu_si512(t), _mm512_loadu_si512(t + 32)};
    return l;
}

INLINE int group_cols(const int kind) { return kind == Q6K ? 16 : 32; }

/* The low nibbles of column pair (2kp, 2kp+1), 64 rows: lo = rows 0..31, hi = rows 32..63,
 * each 32 words of (byte of column 2kp, byte of column 2kp+1). */
INLINE void nibble_pair(const uint8_t *cols_at, __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi16(0x0F0F);
    __m512i cols = _mm512_loadu_si512(cols_at); /* columns 2kp and 2kp+1, 32 bytes each */
    __m512i a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(cols));
    __m512i b = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(cols, 1));
    __m512i ab = _mm512_or_si512(a, _mm512_slli_epi16(b, 8)); /* word j: byte j of column 2kp, of 2kp+1 */
    *lo = _mm512_and_si512(ab, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(ab, 4), low4);
}

/* Column pair kp of a (block, group) as four registers of 16 rows: w[t] lane r = the bf16
 * pair (w'[16t + r][2kp], w'[16t + r][2kp + 1]), w' the integer part (q - 8, q - 32, q). */
INLINE void unpack_pair(const int kind, const uint8_t *q, const uint8_t *hi, int kp, Lut lut, __m512i w[4]) {
    if (kind == Q8) {
        const uint8_t *p = q + kp * 128;
        for (int t = 0; t < 4; t++) { /* 16 rows x 2 columns = 32 bytes, as pairs already */
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 * t))));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 * t + 16))));
            w[t] = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* exact: |q| <= 128 */
        }
        return;
    }
    __m512i v_lo, v_hi;
    nibble_pair(q + kp * 64, &v_lo, &v_hi);
    if (kind == Q6K) {
        const __m256i low2 = _mm256_set1_epi16(0x0303);
        __m256i hcols = _mm256_loadu_si256((const __m256i *)(hi + kp * 32)); /* 16 bytes of 2kp, of 2kp+1 */
        __m256i ha = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hcols));
        __m256i hb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hcols, 1));
        __m256i hab = _mm256_or_si256(ha, _mm256_slli_epi16(hb, 8)); /* word i: byte i of 2kp, of 2kp+1 */
        __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(hab, low2)),
                                         _mm256_and_si256(_mm256_srli_epi16(hab, 2), low2), 1); /* rows 0..31 */
        __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(hab, 4), low2)),
                                         _mm256_and_si256(_mm256_srli_epi16(hab, 6), low2), 1); /* rows 32..63 */
        v_lo = _mm512_or_si512(v_lo, _mm512_slli_epi16(h01, 4));
        v_hi = _mm512_or_si512(v_hi, _mm512_slli_epi16(h23, 4));
    }
    /* bytes -> words -> the table's bf16 */
    const __m512i idx[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v_lo)),
                            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v_lo, 1)),
                            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v_hi)),
                            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v_hi, 1))};
    for (int t = 0; t < 4; t++) /* 16 values: one table register; Q6K's 64: two */
        w[t] = kind == INT4 ? _mm512_permutexvar_epi16(idx[t], lut.lo) : _mm512_permutex2var_epi16(lut.lo, idx[t], lut.hi);
}

/* The group's scale (and INT4's zero) for rows 64b + 16t .. +15. */
INLINE void group_scales(const int kind, const Weight *wt, int N, int b, int g, __m512 s[4], __m512 z[4]) {
    for (int t = 0; t < 4; t++) {
        const size_t n0 = (size_t)b * 64 + 16 * t;
        if (kind == INT4) { /* 16 (scale, zero) bf16 pairs; as float32: bits << 16 */
            const __m512i v = _mm512_loadu_si512((const uint16_t *)wt->scale + ((size_t)g * N + n0) * 2);
            s[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            z[t] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
        } else if (kind == Q6K) { /* d * sc in float32, as gguf forms it */
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wt->d + (size_t)(g / 16) * N + n0)));
            const __m128i c = _mm_loadu_si128((const __m128i *)((const int8_t *)wt->scale + (size_t)g * N + n0));
            s[t] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
            z[t] = _mm512_setzero_ps();
        } else {
            s[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wt->scale + (size_t)g * N + n0)));
            z[t] = _mm512_setzero_ps();
        }
    }
}

/* MT (1..4) rows of x against one (block, group): the pairs from registers (direct) or the tile. */
INLINE void rows_dot(const int kind, const int MT, const int direct, const uint8_t *q, const uint8_t *hi, Lut lut,
                     const uint32_t *tile, const uint32_t *xpairs, size_t x_stride, const float *xsum,
                     size_t xsum_stride, const __m512 s[4], const __m512 z[4], float *out, size_t ldo, int first) {
    const int KP = group_cols(kind) / 2;
    __m512 p[4][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm512_setzero_ps();
    for (int kp = 0; kp < KP; kp++) {
        __m512i w[4];
        if (direct)
            unpack_pair(kind, q, hi, kp, lut, w);
        else
            for (int t = 0; t < 4; t++) w[t] = _mm512_load_si512(tile + kp * 64 + 16 * t);
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xpairs[m * x_stride + kp]);
            for (int t = 0; t < 4; t++) p[m][t] = _mm512_dpbf16_ps(p[m][t], (__m512bh)w[t], (__m512bh)xv);
        }
    }
    /* out[m][0..63] = (first ? 0 : out) + p * s (+ z * the group's sum of x) */
    for (int m = 0; m < MT; m++) {
        const __m512 xs = kind == INT4 ? _mm512_set1_ps(xsum[m * xsum_stride]) : _mm512_setzero_ps();
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 16 * t;
            __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
            acc = _mm512_fmadd_ps(p[m][t], s[t], acc);
            if (kind == INT4) acc = _mm512_fmadd_ps(z[t], xs, acc);
            _mm512_storeu_ps(o, acc);
        }
    }
}

/* xsum[m][g] = the sum of x[m][32g .. 32g + 31] (as bf16, in float32): INT4's zero term. */
static void group_sums(const uint16_t *x, int M, int K, float *xsum) {
    const int G = K / 32;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float acc = 0.f;
            for (int i = 0; i < 32; i++) {
                uint32_t bits = (uint32_t)x[(size_t)m * K + g * 32 + i] << 16;
                float f;
                memcpy(&f, &bits, sizeof f);
                acc += f;
            }
            xsum[(size_t)m * G + g] = acc;
        }
}

INLINE void matmul(const int kind, const uint16_t *x, const Weight *wt, float *out, int M, int N, int K, long ldo,
                   int accumulate, int nthreads, const float *xsum) {
    const int GC = group_cols(kind), G = K / GC, NB = N / 64;
    const size_t x_stride = (size_t)K / 2; /* bf16 pairs per row */
    const uint32_t *xpairs = (const uint32_t *)x;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int b = 0; b < NB; b++) {
        __attribute__((aligned(64))) uint32_t tile[16 * 64];
        const Lut lut = make_lut(kind == INT4 ? 8 : 32);
        for (int g = 0; g < G; g++) {
            const size_t col = (size_t)b * K + (size_t)g * GC; /* (block, first column of the group) */
            const uint8_t *q = kind == Q8 ? wt->q + col * 64 : wt->q + col * 32;
            const uint8_t *hi = kind == Q6K ? wt->hi + col * 16 : NULL;
            __m512 s[4], z[4];
            group_scales(kind, wt, N, b, g, s, z);
            const int first = g == 0 && !accumulate;
            const uint32_t *xp = xpairs + (size_t)g * (GC / 2);
            const float *xs = kind == INT4 ? xsum + g : NULL;
            float *o = out + (size_t)b * 64;
            switch (M) { /* few rows: no tile, its stores and loads would cost more than they save */
            case 1: rows_dot(kind, 1, 1, q, hi, lut, NULL, xp, x_stride, xs, G, s, z, o, ldo, first); continue;
            case 2: rows_dot(kind, 2, 1, q, hi, lut, NULL, xp, x_stride, xs, G, s, z, o, ldo, first); continue;
            case 3: rows_dot(kind, 3, 1, q, hi, lut, NULL, xp, x_stride, xs, G, s, z, o, ldo, first); continue;
            case 4: rows_dot(kind, 4, 1, q, hi, lut, NULL, xp, x_stride, xs, G, s, z, o, ldo, first); continue;
            }
            for (int kp = 0; kp < GC / 2; kp++) {
                __m512i w[4];
                unpack_pair(kind, q, hi, kp, lut, w);
                for (int t = 0; t < 4; t++) _mm512_store_si512(tile + kp * 64 + 16 * t, w[t]);
            }
            for (int m0 = 0; m0 < M; m0 += 4) {
                const uint32_t *xm = xp + (size_t)m0 * x_stride;
                const float *xsm = xs == NULL ? NULL : xs + (size_t)m0 * G;
                float *om = o + (size_t)m0 * ldo;
                switch (M - m0 < 4 ? M - m0 : 4) {
                case 4: rows_dot(kind, 4, 0, q, hi, lut, tile, xm, x_stride, xsm, G, s, z, om, ldo, first); break;
                case 3: rows_dot(kind, 3, 0, q, hi, lut, tile, xm, x_stride, xsm, G, s, z, om, ldo, first); break;
                case 2: rows_dot(kind, 2, 0, q, hi, lut, tile, xm, x_stride, xsm, G, s, z, om, ldo, first); break;
                default: rows_dot(kind, 1, 0, q, hi, lut, tile, xm, x_stride, xsm, G, s, z, om, ldo, first); break;
                }
            }
        }
    }
}

/* The entry points. M >= 1, N % 64 == 0, K a multiple of the kind's block (32; Q6K 256);
 * the caller checks shapes, strides and the CPU. */

/* INT4, one plane: out (+)= x @ W^T (accumulate = 1 adds); xsum: M * K / 32 floats of scratch. */
KVQ_TARGET void kvq_int4_mm(const uint16_t *x, const uint8_t *q, const uint16_t *sz, float *out, int M, int N, int K,
                            long ldo, int accumulate, int nthreads, float *xsum) {
    const Weight wt = {q, NULL, sz, NULL};
    group_sums(x, M, K, xsum);
    matmul(INT4, x, &wt, out, M, N, K, ldo, accumulate, nthreads, xsum);
}

KVQ_TARGET void kvq_q6k_mm(const uint16_t *x, const uint8_t *lo, const uint8_t *hi, const int8_t *sc,
                           const uint16_t *d, float *out, int M, int N, int K, long ldo, int nthreads) {
    const Weight wt = {lo, hi, sc, d};
    matmul(Q6K, x, &wt, out, M, N, K, ldo, 0, nthreads, NULL);
}

KVQ_TARGET void kvq_q8_mm(const uint16_t *x, const int8_t *q, const uint16_t *d, float *out, int M, int N, int K,
                          long ldo, int nthreads) {
    const Weight wt = {(const uint8_t *)q, NULL, d, NULL};
    matmul(Q8, x, &wt, out, M, N, K, ldo, 0, nthreads, NULL);
}
