/* kvstrata: a CPU matmul over torch's int4 weight layout, bf16 dot products.
 *
 *   out[m][n] (+)= sum_k x[m][k] * w[n][k],   w[n][k] = (q[n][k] - 8) * s[g][n] + z[g][n],  g = k / 32
 *
 * x: bf16 [M][K] (row stride K). q: the nibbles of torch's
 * _convert_weight_to_int4pack_for_cpu(q, 1) for N % 64 == 0: per block of 64
 * output rows b and column k, 32 bytes at (b * K + k) * 32; byte j holds row
 * 64b + j in its low nibble and row 64b + j + 32 in its high one. sz: bf16
 * [K/32][N][2] (scale, zero), the same op's scales_and_zeros. out: float32,
 * row stride ldo.
 *
 * Per (block of 64 rows, group of 32 columns) the nibbles become bf16
 * (q - 8) once, in a 4 KB tile (exact: small integers), laid out as
 * vdpbf16ps wants them (16 rows x a pair of columns per 512-bit register);
 * every row of x then reuses the tile: sum_k x * (q - 8) in float32 by
 * vdpbf16ps, times s, plus z * (sum of the group's x). So the dequantizing
 * is paid once per weight whatever M is, and the multiply-adds run at the
 * bf16 dot-product rate (2x float32 FMAs). x is the only rounded operand
 * (to bf16, by the caller); products and sums are float32.
 *
 * Needs AVX512F/BW/VL and AVX512_BF16 (kvq_supported() says so at run time;
 * only the kernel is compiled for them). Parallel over blocks of 64 rows
 * with OpenMP: with torch imported first, its libgomp serves both.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

int kvq_abi_version(void) { return 2; }

int kvq_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("fma");
}

/* bf16 bit patterns of q - 8 for q = 0..15 (the rest of the 32-entry table unused) */
static const uint16_t kLut[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                  0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

/* One column pair 2kp, 2kp+1 of a (block, group) as four registers of 16 rows:
 * w[t] lane r = the bf16 pair (q[16t + r][2kp] - 8, q[16t + r][2kp + 1] - 8). */
static inline __attribute__((always_inline)) KVQ_TARGET void
unpack_pair(const uint8_t *cols_at, const __m512i lut, const __m512i low4, __m512i w[4]) {
    __m512i cols = _mm512_loadu_si512(cols_at); /* columns 2kp and 2kp+1, 32 bytes each */
    __m512i a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(cols));
    __m512i b = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(cols, 1));
    __m512i ab = _mm512_or_si512(a, _mm512_slli_epi16(b, 8)); /* word j: byte j of column 2kp, of 2kp+1 */
    __m512i lo = _mm512_and_si512(ab, low4);                  /* rows j */
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(ab, 4), low4); /* rows j + 32 */
    w[0] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)), lut);
    w[1] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)), lut);
    w[2] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)), lut);
    w[3] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1)), lut);
}

/* The tile of one (block, group): tile[kp * 64 + n] = the bf16 pair (q[n][2kp] - 8, q[n][2kp+1] - 8). */
static inline __attribute__((always_inline)) KVQ_TARGET void
unpack_tile(const uint8_t *wq, uint32_t *tile) {
    const __m512i lut = _mm512_loadu_si512(kLut);
    const __m512i low4 = _mm512_set1_epi16(0x0F0F);
    for (int kp = 0; kp < 16; kp++) {
        __m512i w[4];
        unpack_pair(wq + kp * 64, lut, low4, w);
        for (int t = 0; t < 4; t++) _mm512_store_si512(tile + kp * 64 + 16 * t, w[t]);
    }
}

/* MT (1..4) rows of x against one tile of KP column pairs (a group: 16 for
 * int4's 32 columns, 8 for Q6_K's 16): out[m][0..63] = (first ? 0 : out) +
 * dot * s (+ z * xsum when HAS_Z). */
static inline __attribute__((always_inline)) KVQ_TARGET void
rows_dot(const int MT, const int KP, const int HAS_Z, const uint32_t *xpairs, size_t x_stride, const uint32_t *tile,
         const float *xsum, size_t xsum_stride, const __m512 s[4], const __m512 z[4], float *out, size_t ldo,
         int first) {
    __m512 p[4][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm512_setzero_ps();
    for (int kp = 0; kp < KP; kp++) {
        const __m512i w0 = _mm512_load_si512(tile + kp * 64);
        const __m512i w1 = _mm512_load_si512(tile + kp * 64 + 16);
        const __m512i w2 = _mm512_load_si512(tile + kp * 64 + 32);
        const __m512i w3 = _mm512_load_si512(tile + kp * 64 + 48);
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xpairs[m * x_stride + kp]);
            p[m][0] = _mm512_dpbf16_ps(p[m][0], (__m512bh)w0, (__m512bh)xv);
            p[m][1] = _mm512_dpbf16_ps(p[m][1], (__m512bh)w1, (__m512bh)xv);
            p[m][2] = _mm512_dpbf16_ps(p[m][2], (__m512bh)w2, (__m512bh)xv);
            p[m][3] = _mm512_dpbf16_ps(p[m][3], (__m512bh)w3, (__m512bh)xv);
        }
    }
    for (int m = 0; m < MT; m++) {
        const __m512 xs = HAS_Z ? _mm512_set1_ps(xsum[m * xsum_stride]) : _mm512_setzero_ps();
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 16 * t;
            __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
            acc = _mm512_fmadd_ps(p[m][t], s[t], acc);
            if (HAS_Z) acc = _mm512_fmadd_ps(z[t], xs, acc);
            _mm512_storeu_ps(o, acc);
        }
    }
}

/* Every row of x against one tile, 4 rows at a time. */
static inline __attribute__((always_inline)) KVQ_TARGET void
all_rows(const int KP, const int HAS_Z, int M, const uint32_t *xpairs, size_t x_stride, const uint32_t *tile,
         const float *xsum, size_t xsum_stride, const __m512 s[4], const __m512 z[4], float *out, size_t ldo,
         int first) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        const uint32_t *xp = xpairs + (size_t)m0 * x_stride;
        const float *xs = HAS_Z ? xsum + (size_t)m0 * xsum_stride : xsum;
        float *o = out + (size_t)m0 * ldo;
        switch (M - m0 < 4 ? M - m0 : 4) {
        case 4: rows_dot(4, KP, HAS_Z, xp, x_stride, tile, xs, xsum_stride, s, z, o, ldo, first); break;
        case 3: rows_dot(3, KP, HAS_Z, xp, x_stride, tile, xs, xsum_stride, s, z, o, ldo, first); break;
        case 2: rows_dot(2, KP, HAS_Z, xp, x_stride, tile, xs, xsum_stride, s, z, o, ldo, first); break;
        default: rows_dot(1, KP, HAS_Z, xp, x_stride, tile, xs, xsum_stride, s, z, o, ldo, first); break;
        }
    }
}

/* MT (1..3) rows of x against one (block, group) unpacked straight into
 * registers (no tile: with so few rows the tile's stores and loads cost
 * more than they save). Same sums as rows_dot, in the same order. */
static inline __attribute__((always_inline)) KVQ_TARGET void
rows_direct(const int MT, const uint8_t *wq, const uint32_t *xpairs, size_t x_stride, const float *xsum,
            size_t xsum_stride, const __m512 s[4], const __m512 z[4], float *out, size_t ldo, int first) {
    const __m512i lut = _mm512_loadu_si512(kLut);
    const __m512i low4 = _mm512_set1_epi16(0x0F0F);
    __m512 p[4][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm512_setzero_ps();
    for (int kp = 0; kp < 16; kp++) {
        __m512i w[4];
        unpack_pair(wq + kp * 64, lut, low4, w);
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xpairs[m * x_stride + kp]);
            for (int t = 0; t < 4; t++) p[m][t] = _mm512_dpbf16_ps(p[m][t], (__m512bh)w[t], (__m512bh)xv);
        }
    }
    for (int m = 0; m < MT; m++) {
        const __m512 xs = _mm512_set1_ps(xsum[m * xsum_stride]);
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 16 * t;
            __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
            acc = _mm512_fmadd_ps(p[m][t], s[t], acc);
            acc = _mm512_fmadd_ps(z[t], xs, acc);
            _mm512_storeu_ps(o, acc);
        }
    }
}

/* xsum[m][g] = the sum of x[m][32g .. 32g + 31] (as bf16, in float32). */
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

/* out (+)= x @ W^T. M >= 1, N % 64 == 0, K % 32 == 0; xsum: M * K / 32 floats of scratch.
 * accumulate = 0 overwrites out. The caller checks shapes, strides and the CPU. */
KVQ_TARGET void kvq_int4_mm(const uint16_t *x, const uint8_t *wq, const uint16_t *sz, float *out, int M, int N,
                            int K, long ldo, int accumulate, int nthreads, float *xsum) {
    const int G = K / 32, NB = N / 64;
    const size_t x_stride = (size_t)K / 2; /* bf16 pairs per row */
    const uint32_t *xpairs = (const uint32_t *)x;
    group_sums(x, M, K, xsum);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int b = 0; b < NB; b++) {
        __attribute__((aligned(64))) uint32_t tile[16 * 64];
        const __m512i zmask = _mm512_set1_epi32((int)0xFFFF0000);
        for (int g = 0; g < G; g++) {
            const uint8_t *wg = wq + ((size_t)b * K + (size_t)g * 32) * 32;
            __m512 s[4], z[4];
            for (int t = 0; t < 4; t++) { /* 16 (scale, zero) bf16 pairs; as float32: bits << 16 */
                const __m512i v = _mm512_loadu_si512(sz + ((size_t)g * N + (size_t)b * 64 + 16 * t) * 2);
                s[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                z[t] = _mm512_castsi512_ps(_mm512_and_si512(v, zmask));
            }
            const int first = g == 0 && !accumulate;
            const uint32_t *xp = xpairs + (size_t)g * 16;
            float *o = out + (size_t)b * 64;
            switch (M) {
            case 1: rows_direct(1, wg, xp, x_stride, xsum + g, G, s, z, o, ldo, first); break;
            case 2: rows_direct(2, wg, xp, x_stride, xsum + g, G, s, z, o, ldo, first); break;
            case 3: rows_direct(3, wg, xp, x_stride, xsum + g, G, s, z, o, ldo, first); break;
            case 4: rows_direct(4, wg, xp, x_stride, xsum + g, G, s, z, o, ldo, first); break;
            default:
                unpack_tile(wg, tile);
                all_rows(16, 1, M, xp, x_stride, tile, xsum + g, G, s, z, o, ldo, first);
            }
        }
    }
}

/* ---- Q6_K ------------------------------------------------------------------------------------
 *
 *   out[m][n] = sum_k x[m][k] * d[k/256][n] * sc[k/16][n] * (q[n][k] - 32),   q in 0..63
 *
 * Q6_K's values re-laid for this kernel (kvstrata.kernels.quant_cpu.Q6Path), the file's
 * bytes exactly (0.82 B per weight): lo = the low nibbles in the int4 layout above; hi = the
 * top two bits, per block of 64 rows b and column k 16 bytes at (b * K + k) * 16, byte i
 * holding rows 64b + i, +16, +32, +48 in bits 0-1, 2-3, 4-5, 6-7; sc = int8 [K/16][N];
 * d = fp16 [K/256][N]. The scale d * sc is formed in float32 as gguf does (no rounding to
 * bf16), so x is again the only rounded operand. Groups of 16 columns (8 pairs), no zero.
 */

/* One column pair of a Q6_K (block, group) as four registers of 16 rows (as unpack_pair). */
static inline __attribute__((always_inline)) KVQ_TARGET void
unpack_q6_pair(const uint8_t *lo, const uint8_t *hi, const __m512i lut0, const __m512i lut1, __m512i w[4]) {
    const __m512i low4 = _mm512_set1_epi16(0x0F0F);
    const __m256i low2 = _mm256_set1_epi16(0x0303);
    __m512i cols = _mm512_loadu_si512(lo);
    __m512i a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(cols));
    __m512i b = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(cols, 1));
    __m512i ab = _mm512_or_si512(a, _mm512_slli_epi16(b, 8));
    __m512i v_lo = _mm512_and_si512(ab, low4);                  /* rows 0..31, low nibbles */
    __m512i v_hi = _mm512_and_si512(_mm512_srli_epi16(ab, 4), low4); /* rows 32..63 */
    __m256i hcols = _mm256_loadu_si256((const __m256i *)hi); /* 16 bytes of 2k, of 2k+1 */
    __m256i ha = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hcols));
    __m256i hb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hcols, 1));
    __m256i hab = _mm256_or_si256(ha, _mm256_slli_epi16(hb, 8)); /* word i: byte i of 2k, of 2k+1 */
    __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(hab, low2)),
                                     _mm256_and_si256(_mm256_srli_epi16(hab, 2), low2), 1); /* rows 0..31 */
    __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(hab, 4), low2)),
                                     _mm256_and_si256(_mm256_srli_epi16(hab, 6), low2), 1); /* rows 32..63 */
    v_lo = _mm512_or_si512(v_lo, _mm512_slli_epi16(h01, 4));
    v_hi = _mm512_or_si512(v_hi, _mm512_slli_epi16(h23, 4));
    w[0] = _mm512_permutex2var_epi16(lut0, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v_lo)), lut1);
    w[1] = _mm512_permutex2var_epi16(lut0, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v_lo, 1)), lut1);
    w[2] = _mm512_permutex2var_epi16(lut0, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v_hi)), lut1);
    w[3] = _mm512_permutex2var_epi16(lut0, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v_hi, 1)), lut1);
}

/* tile[kp * 64 + n] = the bf16 pair (q[n][2kp] - 32, q[n][2kp+1] - 32), kp < 8. */
static inline __attribute__((always_inline)) KVQ_TARGET void
unpack_q6_tile(const uint8_t *lo, const uint8_t *hi, const __m512i lut0, const __m512i lut1, uint32_t *tile) {
    for (int kp = 0; kp < 8; kp++) {
        __m512i w[4];
        unpack_q6_pair(lo + kp * 64, hi + kp * 32, lut0, lut1, w);
        for (int t = 0; t < 4; t++) _mm512_store_si512(tile + kp * 64 + 16 * t, w[t]);
    }
}

/* MT (1..3) rows against one Q6_K (block, group) unpacked straight into registers (as rows_direct). */
static inline __attribute__((always_inline)) KVQ_TARGET void
q6_rows_direct(const int MT, const uint8_t *lo, const uint8_t *hi, const __m512i lut0, const __m512i lut1,
               const uint32_t *xpairs, size_t x_stride, const __m512 s[4], float *out, size_t ldo, int first) {
    __m512 p[4][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm512_setzero_ps();
    for (int kp = 0; kp < 8; kp++) {
        __m512i w[4];
        unpack_q6_pair(lo + kp * 64, hi + kp * 32, lut0, lut1, w);
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xpairs[m * x_stride + kp]);
            for (int t = 0; t < 4; t++) p[m][t] = _mm512_dpbf16_ps(p[m][t], (__m512bh)w[t], (__m512bh)xv);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 16 * t;
            const __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(p[m][t], s[t], acc));
        }
}

/* out = x @ W^T for Q6_K laid out as above. M >= 1, N % 64 == 0, K % 256 == 0. */
KVQ_TARGET void kvq_q6k_mm(const uint16_t *x, const uint8_t *lo, const uint8_t *hi, const int8_t *sc,
                           const uint16_t *d, float *out, int M, int N, int K, long ldo, int nthreads) {
    const int G = K / 16, NB = N / 64;
    const size_t x_stride = (size_t)K / 2;
    const uint32_t *xpairs = (const uint32_t *)x;
    uint16_t lut[64]; /* bf16 of v - 32: small integers, exact */
    for (int v = 0; v < 64; v++) {
        float f = (float)(v - 32);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        lut[v] = (uint16_t)(bits >> 16);
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int b = 0; b < NB; b++) {
        __attribute__((aligned(64))) uint32_t tile[8 * 64];
        const __m512i lut0 = _mm512_loadu_si512(lut), lut1 = _mm512_loadu_si512(lut + 32);
        __m512 s[4], z[4];
        for (int g = 0; g < G; g++) {
            for (int t = 0; t < 4; t++) {
                const size_t n0 = (size_t)b * 64 + 16 * t;
                const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (size_t)(g / 16) * N + n0)));
                const __m128i c = _mm_loadu_si128((const __m128i *)(sc + (size_t)g * N + n0));
                s[t] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
                z[t] = _mm512_setzero_ps();
            }
            const uint8_t *lg = lo + ((size_t)b * K + (size_t)g * 16) * 32, *hg = hi + ((size_t)b * K + (size_t)g * 16) * 16;
            const uint32_t *xp = xpairs + (size_t)g * 8;
            float *o = out + (size_t)b * 64;
            switch (M) {
            case 1: q6_rows_direct(1, lg, hg, lut0, lut1, xp, x_stride, s, o, ldo, g == 0); break;
            case 2: q6_rows_direct(2, lg, hg, lut0, lut1, xp, x_stride, s, o, ldo, g == 0); break;
            case 3: q6_rows_direct(3, lg, hg, lut0, lut1, xp, x_stride, s, o, ldo, g == 0); break;
            case 4: q6_rows_direct(4, lg, hg, lut0, lut1, xp, x_stride, s, o, ldo, g == 0); break;
            default:
                unpack_q6_tile(lg, hg, lut0, lut1, tile);
                all_rows(8, 0, M, xp, x_stride, tile, NULL, 0, s, z, o, ldo, g == 0);
            }
        }
    }
}
