/* kvstrata: CPU matmuls over GGUF weights re-laid for AVX512_BF16 dot products.
 *
 *   out[m][n] = sum_k x[m][k] * w[n][k]        x: [M][K] (row stride K), out: float32 (row stride ldo)
 *
 * x is bf16, or float32: then the integers become float32 (exact) and float32 FMAs take x as
 * it is: a float32 dot product with the file's exact weights, no bf16 rounding anywhere
 * (~1e-7 of S, as F.linear on the dequantized float32 weight).
 *
 * Every kind keeps its file's integers and scales exactly (kvstrata.kernels.quant_cpu.NativePath
 * re-lays them; the bytes are the file's, or 3 % more for the K-quants' unpacked 6-bit scales),
 * cut in blocks of 64 output rows b and groups g of 32 columns (Q6_K: 16):
 *
 *   lo   the low nibbles: per block and column k, 32 bytes at (b * K + k) * 32, byte j = row
 *        64b + j (low nibble) | row 64b + j + 32 (high nibble) (torch's CPU int4 layout)
 *   hi   the bits above them: Q5 kinds 1 bit, per block and column 8 bytes at (b * K + k) * 8,
 *        byte i = rows 64b + i + 8j at bit j; Q6K 2 bits, 16 bytes at (b * K + k) * 16, byte i
 *        = rows 64b + i + 16j at bits 2j, 2j+1
 *   Q8   int8 instead: per block and column pair kp, 128 bytes at (b * K/2 + kp) * 128, bytes
 *        2r, 2r+1 = row 64b + r at columns 2kp, 2kp+1
 *
 *   QD4, QD5   Q4_0, Q4_1, Q5_0, Q5_1: w = d[g][n] * (q - off) + m[g][n] (d, m fp16; m absent: 0)
 *   QK4, QK5   Q4_K, Q5_K:  w = (d[k/256][n] * sc[g][n]) * q - dmin[k/256][n] * mn[g][n]
 *              (sc, mn: the 6-bit scale and min as uint8; d, dmin fp16)
 *   Q6K        Q6_K: w = (d[k/256][n] * sc[k/16][n]) * (q - 32), sc int8, groups of 16
 *   Q8         Q8_0: w = d[g][n] * q
 *
 * Per (block, group) the integers become bf16 once (exact: small integers, through a table
 * of q - off), laid out as vdpbf16ps wants them (16 rows x a column pair per 512-bit
 * register): for a few rows of x at a time straight into registers, or once into a 4 KB tile
 * that every row of x reuses (a float32 x: float32 values, an 8 KB tile; which, by M and the
 * kind: ``direct`` in matmul). Each row's group sum
 * sum_k x * (q - off) runs in float32 (vdpbf16ps; for a float32 x one FMA per column, in
 * column order), then takes the group's scale, and its offset times the group's sum of x, in
 * float32, the scales formed as gguf forms them. So with the tile the unpacking is paid once
 * per weight whatever M is, the multiply-adds run at the bf16 dot-product rate (2x float32 FMAs) or at
 * the FMA rate for a float32 x, and x is used as given. A row's result does not depend on the
 * other rows (the same sums in the same order either way). For a float32 x in registers the
 * 4-bit kinds (Q4_0, Q4_1, Q4_K) skip the bf16 pairs: each column's nibbles index a float32
 * table of q - off directly (nibble_col_f32): the same values, ~1.3x faster at one row; Q8_0's
 * int8 words go straight to float32 (1.4x).
 *
 * Needs AVX512F/BW/VL and AVX512_BF16; on a CPU with AVX2, FMA and F16C only, the AVX2 kernel
 * below runs a float32 x (bit-equal to this one's float32 results). kvq_isa() says which at run
 * time; only the kernels are compiled for their instruction sets. Parallel over blocks of 64
 * rows (AVX2: halves of 32) with OpenMP: with torch imported first, its libgomp serves both.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define INLINE static inline __attribute__((always_inline)) KVQ_TARGET
#define KVQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE2 static inline __attribute__((always_inline)) KVQ_AVX2
#define PURE static inline __attribute__((always_inline))

enum { QD4, QD5, QK4, QK5, Q6K, Q8 }; /* the order of quant_native.KINDS */

int kvq_abi_version(void) { return 6; }

/* The kernels this CPU runs: 2 both (AVX512F/BW/VL + AVX512_BF16), 1 the AVX2 float32 one
 * (AVX2, FMA, F16C), 0 none. */
int kvq_isa(void) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (!avx2) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16")
               ? 2
               : 1;
}

/* What a kernel reads (unused fields NULL). */
typedef struct {
    const uint8_t *q;   /* lo (Q8: the int8 values) */
    const uint8_t *hi;  /* QD5, QK5, Q6K */
    const void *s1;     /* QD: d; QK: sc (uint8); Q6K: sc (int8); Q8: d */
    const void *s2;     /* QD: m (or NULL); QK: mn (uint8) */
    const uint16_t *d;  /* QK: d; Q6K: d (fp16, per 256 columns) */
    const uint16_t *dmin; /* QK */
} Weight;

PURE int hi_bits(const int kind) { return kind == QD5 || kind == QK5 ? 1 : kind == Q6K ? 2 : 0; }
PURE int has_offset(const int kind) { return kind == QD4 || kind == QD5 || kind == QK4 || kind == QK5; }

/* bf16 bit patterns of v - off for v = 0..63 (lo, hi), and v - off as float32 for v = 0..15
 * (f32): the integers' values, exact */
typedef struct {
    __m512i lo, hi;
    __m512 f32;
} Lut;

INLINE Lut make_lut(int off) {
    uint16_t t[64];
    float f[16];
    for (int v = 0; v < 64; v++) {
        float fv = (float)(v - off);
        uint32_t bits;
        memcpy(&bits, &fv, sizeof bits);
        t[v] = (uint16_t)(bits >> 16);
        if (v < 16) f[v] = fv;
    }
    Lut l = {_mm512_loadu_si512(t), _mm512_loadu_si512(t + 32), _mm512_loadu_ps(f)};
    return l;
}

/* Column k of a 4-bit (block, group) as four registers of 16 rows, float32 q - off: w[t] lane r =
 * row 16t + r. Byte j of the column holds row j (low nibble) and row j + 32 (high): widened to
 * 32 bits, its low 4 bits index the table (vpermps reads only those), and so do the high
 * nibble's after a shift. Two permutes a 32 weights, no masking: for a float32 x with few rows
 * it is ~30 % fewer instructions than the bf16 pairs (the same values, so the same sums). */
INLINE void nibble_col_f32(const uint8_t *col, __m512 tab, __m512 w[4]) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)col));        /* rows 0..15 | 32..47 */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(col + 16))); /* rows 16..31 | 48..63 */
    w[0] = _mm512_permutexvar_ps(a, tab);
    w[1] = _mm512_permutexvar_ps(b, tab);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), tab);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
}

PURE int group_cols(const int kind) { return kind == Q6K ? 16 : 32; }

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
 * pair (q[16t + r][2kp] - off, q[16t + r][2kp + 1] - off) (Q8: the int8 values). */
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
    if (hi_bits(kind) == 1) {
        const __m128i one = _mm_set1_epi16(0x0101);
        __m128i hcols = _mm_loadu_si128((const __m128i *)(hi + kp * 16)); /* 8 bytes of 2kp, of 2kp+1 */
        __m128i hab = _mm_or_si128(_mm_cvtepu8_epi16(hcols), _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(hcols, 8)), 8));
        __m512i h03 = _mm512_castsi128_si512(_mm_and_si128(hab, one)); /* rows 0..31: bits 0..3 */
        h03 = _mm512_inserti32x4(h03, _mm_and_si128(_mm_srli_epi16(hab, 1), one), 1);
        h03 = _mm512_inserti32x4(h03, _mm_and_si128(_mm_srli_epi16(hab, 2), one), 2);
        h03 = _mm512_inserti32x4(h03, _mm_and_si128(_mm_srli_epi16(hab, 3), one), 3);
        __m512i h47 = _mm512_castsi128_si512(_mm_and_si128(_mm_srli_epi16(hab, 4), one)); /* rows 32..63 */
        h47 = _mm512_inserti32x4(h47, _mm_and_si128(_mm_srli_epi16(hab, 5), one), 1);
        h47 = _mm512_inserti32x4(h47, _mm_and_si128(_mm_srli_epi16(hab, 6), one), 2);
        h47 = _mm512_inserti32x4(h47, _mm_and_si128(_mm_srli_epi16(hab, 7), one), 3);
        v_lo = _mm512_or_si512(v_lo, _mm512_slli_epi16(h03, 4));
        v_hi = _mm512_or_si512(v_hi, _mm512_slli_epi16(h47, 4));
    } else if (hi_bits(kind) == 2) {
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
    for (int t = 0; t < 4; t++) /* up to 32 values: one table register; Q6K's 64: two */
        w[t] = kind == Q6K ? _mm512_permutex2var_epi16(lut.lo, idx[t], lut.hi) : _mm512_permutexvar_epi16(idx[t], lut.lo);
}

/* The even (e = 0) or odd (e = 1) column of 16 bf16 pairs, as float32 (exact). */
INLINE __m512 pair_column(__m512i w, int e) {
    return _mm512_castsi512_ps(e == 0 ? _mm512_slli_epi32(w, 16) : _mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

INLINE __m512 f16x16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE __m512 u8x16(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE __m512 i8x16(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* The group's scale s and offset z (w = s * (q - off) + z) for rows 64b + 16t .. +15. */
INLINE void group_scales(const int kind, const Weight *wt, int N, int b, int g, __m512 s[4], __m512 z[4]) {
    for (int t = 0; t < 4; t++) {
        const size_t n0 = (size_t)b * 64 + 16 * t, at = (size_t)g * N + n0;
        if (kind == QD4 || kind == QD5) {
            s[t] = f16x16((const uint16_t *)wt->s1 + at);
            z[t] = wt->s2 != NULL ? f16x16((const uint16_t *)wt->s2 + at) : _mm512_setzero_ps();
        } else if (kind == QK4 || kind == QK5) { /* d * sc and dmin * mn in float32, as gguf forms them */
            const size_t sb = (size_t)(g / 8) * N + n0;
            s[t] = _mm512_mul_ps(f16x16(wt->d + sb), u8x16((const uint8_t *)wt->s1 + at));
            z[t] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(f16x16(wt->dmin + sb), u8x16((const uint8_t *)wt->s2 + at)));
        } else if (kind == Q6K) {
            s[t] = _mm512_mul_ps(f16x16(wt->d + (size_t)(g / 16) * N + n0), i8x16((const int8_t *)wt->s1 + at));
            z[t] = _mm512_setzero_ps();
        } else {
            s[t] = f16x16((const uint16_t *)wt->s1 + at);
            z[t] = _mm512_setzero_ps();
        }
    }
}

/* Bring group g's scales for rows 64b .. 64b + 63 into L1 ahead of use: they lie in rows N apart
 * ([groups][N] planes), a stride the hardware prefetchers do not follow as they follow the
 * integers' stream (1.07x at one row of x, the same at 16). */
#define PREFETCH_GROUPS 2
PURE void prefetch_scales(const int kind, const Weight *wt, int N, int b, int g) {
    const size_t at = (size_t)g * N + (size_t)b * 64;
    const int wide = kind == QD4 || kind == QD5 || kind == Q8; /* fp16 scales; else bytes */
    const char *planes[2] = {(const char *)wt->s1, (const char *)wt->s2};
    for (int i = 0; i < 2; i++) {
        if (planes[i] == NULL) continue;
        _mm_prefetch(planes[i] + at * (wide ? 2 : 1), _MM_HINT_T0);
        if (wide) _mm_prefetch(planes[i] + at * 2 + 64, _MM_HINT_T0);
    }
}

/* How many of the ``left`` rows of x still to go one rows_dot takes: up to 6 (its registers: 4
 * accumulators a row, 4 weight vectors), in chunks of 4-6 rather than leaving 1-3 behind (in
 * registers a chunk costs its unpacking whatever its rows; from the tile, its loads: chunks of 6
 * there measured 1.03-1.10x chunks of 4 for a bf16 x at 16-256 rows). */
PURE int direct_rows(int left) {
    return left >= 10 || left == 6 ? 6 : left == 5 ? 5 : left >= 8 ? left / 2 : left < 4 ? left : 4;
}

/* Where (block b, group g)'s packed bytes start: lo (Q8: the int8 values) and hi (NULL: none). */
PURE void group_bytes(const int kind, const Weight *wt, int K, int b, int g, const uint8_t **q, const uint8_t **hi) {
    const size_t col = (size_t)b * K + (size_t)g * group_cols(kind); /* (block, first column of the group) */
    *q = wt->q + col * (kind == Q8 ? 64 : 32);
    *hi = hi_bits(kind) ? wt->hi + col * 8 * hi_bits(kind) : NULL;
}

/* The packed bytes of (block, group) g into L1: lo (Q8: the int8 values) and hi. Their stream
 * is sequential, but the hardware prefetcher stops at each 4 KB page (4 groups of Q4): perf put
 * 12 % of a bf16 16-row matmul on the first use of the bytes. The tile path fetches the next
 * group's (bf16 x: 9-16 rows 1.08x, 64 1.03x; float32 Q5_1 at 16 1.06x); the register paths,
 * which run through the bytes several times faster, measured 0.85-0.97x with it and go without. */
PURE void prefetch_group(const int kind, const Weight *wt, int K, int b, int g) {
    const int GC = group_cols(kind);
    const uint8_t *q, *hi;
    group_bytes(kind, wt, K, b, g, &q, &hi);
    for (size_t c = 0; c < (size_t)GC * (kind == Q8 ? 64 : 32); c += 64) _mm_prefetch((const char *)q + c, _MM_HINT_T0);
    if (hi != NULL)
        for (size_t c = 0; c < (size_t)GC * 8 * hi_bits(kind); c += 64) _mm_prefetch((const char *)hi + c, _MM_HINT_T0);
}

/* MT (1..6) rows of x against one (block, group): the weight pairs from registers (direct) or
 * the tile. x: the group's first column of row 0, x_stride elements a row (bf16, or float32
 * when F32). */
INLINE void rows_dot(const int kind, const int F32, const int MT, const int direct, const uint8_t *q,
                     const uint8_t *hi, Lut lut, const uint32_t *tile, const void *x, size_t x_stride,
                     const float *xsum, size_t xsum_stride, const __m512 s[4], const __m512 z[4], float *out,
                     size_t ldo, int first) {
    const int KP = group_cols(kind) / 2;
    __m512 p[6][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm512_setzero_ps();
    if (F32 && direct && (kind == QD4 || kind == QK4)) { /* column by column, in order (as below) */
        const float *xf = (const float *)x;
        for (int k = 0; k < 32; k++) {
            __m512 w[4];
            nibble_col_f32(q + k * 32, lut.f32, w);
            for (int m = 0; m < MT; m++) {
                const __m512 xv = _mm512_set1_ps(xf[m * x_stride + k]);
                for (int t = 0; t < 4; t++) p[m][t] = _mm512_fmadd_ps(w[t], xv, p[m][t]);
            }
        }
    } else if (F32 && direct && kind == Q8) { /* each pair's int8 words straight to float32 (as below) */
        const float *xf = (const float *)x;
        const __m512i low_word = _mm512_set1_epi32(1);
        for (int kp = 0; kp < KP; kp++) {
            __m512 we[4], wo[4];
            for (int t = 0; t < 4; t++) { /* lane r: the words of row 16t + r at columns 2kp, 2kp + 1 */
                const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + kp * 128 + 32 * t)));
                we[t] = _mm512_cvtepi32_ps(_mm512_madd_epi16(v, low_word)); /* lo * 1 + hi * 0 */
                wo[t] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
            }
            for (int m = 0; m < MT; m++) {
                const __m512 xe = _mm512_set1_ps(xf[m * x_stride + 2 * kp]), xo = _mm512_set1_ps(xf[m * x_stride + 2 * kp + 1]);
                for (int t = 0; t < 4; t++) p[m][t] = _mm512_fmadd_ps(wo[t], xo, _mm512_fmadd_ps(we[t], xe, p[m][t]));
            }
        }
    } else for (int kp = 0; kp < KP; kp++) {
        __m512i w[4];
        if (direct)
            unpack_pair(kind, q, hi, kp, lut, w);
        else if (!F32)
            for (int t = 0; t < 4; t++) w[t] = _mm512_load_si512(tile + kp * 64 + 16 * t);
        if (!F32) {
            const uint32_t *xp = (const uint32_t *)x;
            for (int m = 0; m < MT; m++) {
                const __m512i xv = _mm512_set1_epi32((int)xp[m * x_stride / 2 + kp]);
                for (int t = 0; t < 4; t++) p[m][t] = _mm512_dpbf16_ps(p[m][t], (__m512bh)w[t], (__m512bh)xv);
            }
            continue;
        }
        __m512 we[4], wo[4]; /* columns 2kp and 2kp + 1 as float32 */
        for (int t = 0; t < 4; t++)
            if (direct) {
                we[t] = pair_column(w[t], 0);
                wo[t] = pair_column(w[t], 1);
            } else {
                we[t] = _mm512_load_ps((const float *)tile + kp * 128 + 16 * t);
                wo[t] = _mm512_load_ps((const float *)tile + kp * 128 + 64 + 16 * t);
            }
        const float *xf = (const float *)x;
        for (int m = 0; m < MT; m++) {
            const __m512 xe = _mm512_set1_ps(xf[m * x_stride + 2 * kp]), xo = _mm512_set1_ps(xf[m * x_stride + 2 * kp + 1]);
            for (int t = 0; t < 4; t++) p[m][t] = _mm512_fmadd_ps(wo[t], xo, _mm512_fmadd_ps(we[t], xe, p[m][t]));
        }
    }
    /* out[m][0..63] = (first ? 0 : out) + p * s (+ z * the group's sum of x) */
    for (int m = 0; m < MT; m++) {
        const __m512 xs = has_offset(kind) ? _mm512_set1_ps(xsum[m * xsum_stride]) : _mm512_setzero_ps();
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 16 * t;
            __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
            acc = _mm512_fmadd_ps(p[m][t], s[t], acc);
            if (has_offset(kind)) acc = _mm512_fmadd_ps(z[t], xs, acc);
            _mm512_storeu_ps(o, acc);
        }
    }
}

/* xsum[m][g] = the sum of x[m][32g .. 32g + 31] in float32 (x bf16, or float32 when x_f32):
 * the offsets' term. */
static void group_sums(const void *x, int x_f32, int M, int K, float *xsum) {
    const int G = K / 32;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float acc = 0.f;
            for (int i = 0; i < 32; i++) {
                const size_t at = (size_t)m * K + g * 32 + i;
                float f;
                if (x_f32) {
                    f = ((const float *)x)[at];
                } else {
                    const uint32_t bits = (uint32_t)((const uint16_t *)x)[at] << 16;
                    memcpy(&f, &bits, sizeof f);
                }
                acc += f;
            }
            xsum[(size_t)m * G + g] = acc;
        }
}

/* (block b, group g): its packed bytes (q, hi) and its scales (group_scales), the scales two
 * groups on prefetched. */
INLINE void group_at(const int kind, const Weight *wt, int N, int K, int G, int b, int g, const uint8_t **q,
                     const uint8_t **hi, __m512 s[4], __m512 z[4]) {
    group_bytes(kind, wt, K, b, g, q, hi);
    if (g + PREFETCH_GROUPS < G) prefetch_scales(kind, wt, N, b, g + PREFETCH_GROUPS);
    group_scales(kind, wt, N, b, g, s, z);
}

/* All M rows of x against one (block, group), direct_rows(left) of them at a time, in registers
 * (direct) or from the tile; x, xsum and out as rows_dot takes them for row 0. */
INLINE void row_chunks(const int kind, const int F32, const int direct, int M, const uint8_t *q, const uint8_t *hi,
                       Lut lut, const uint32_t *tile, const char *x, size_t K, const float *xsum, size_t G,
                       const __m512 s[4], const __m512 z[4], float *out, size_t ldo, int first) {
    const size_t esize = F32 ? 4 : 2;
    for (int m0 = 0, mt; m0 < M; m0 += mt) {
        const char *xm = x + (size_t)m0 * K * esize;
        const float *xsm = xsum == NULL ? NULL : xsum + (size_t)m0 * G;
        float *om = out + (size_t)m0 * ldo;
        switch (mt = direct_rows(M - m0)) {
        case 6: rows_dot(kind, F32, 6, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        case 5: rows_dot(kind, F32, 5, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        case 4: rows_dot(kind, F32, 4, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        case 3: rows_dot(kind, F32, 3, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        case 2: rows_dot(kind, F32, 2, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        default: rows_dot(kind, F32, 1, direct, q, hi, lut, tile, xm, K, xsm, G, s, z, om, ldo, first); break;
        }
    }
}

/* 1-4 rows (decode): all of them in registers, a parallel region of its own (with the paths for
 * more rows in the same one it ran 3-5 % slower). */
INLINE void matmul_few(const int kind, const int F32, int off, const void *x, const Weight *wt, float *out, int M,
                       int N, int K, long ldo, int nthreads, const float *xsum) {
    const int GC = group_cols(kind), G = K / GC, NB = N / 64;
    const size_t esize = F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int b = 0; b < NB; b++) {
        const Lut lut = make_lut(off);
        for (int g = 0; g < G; g++) {
            const uint8_t *q, *hi;
            __m512 s[4], z[4];
            group_at(kind, wt, N, K, G, b, g, &q, &hi, s, z);
            const int first = g == 0;
            const char *xg = (const char *)x + (size_t)g * GC * esize;
            const float *xs = has_offset(kind) ? xsum + g : NULL;
            float *o = out + (size_t)b * 64;
            switch (M) {
            case 1: rows_dot(kind, F32, 1, 1, q, hi, lut, NULL, xg, K, xs, G, s, z, o, ldo, first); break;
            case 2: rows_dot(kind, F32, 2, 1, q, hi, lut, NULL, xg, K, xs, G, s, z, o, ldo, first); break;
            case 3: rows_dot(kind, F32, 3, 1, q, hi, lut, NULL, xg, K, xs, G, s, z, o, ldo, first); break;
            default: rows_dot(kind, F32, 4, 1, q, hi, lut, NULL, xg, K, xs, G, s, z, o, ldo, first); break;
            }
        }
    }
}

INLINE void matmul(const int kind, const int F32, int off, const void *x, const Weight *wt, float *out, int M,
                   int N, int K, long ldo, int nthreads, const float *xsum) {
    if (M <= 4) {
        matmul_few(kind, F32, off, x, wt, out, M, N, K, ldo, nthreads, xsum);
        return;
    }
    const int GC = group_cols(kind), G = K / GC, NB = N / 64;
    const size_t esize = F32 ? 4 : 2;
    /* Unpack each group for every few rows of x, or once into a tile every row reads: the tile's
     * stores and loads cost more than unpacking again for 1-4 rows (matmul_few); for a float32 x against a
     * 4-bit kind or Q8_0 (the cheap unpacking of nibble_col_f32 and the int8 words) at every M
     * (1.1-1.4x at 5-16 rows, the same at 64: SmolLM2's layers, one thread; tools/bench_native_ab.py);
     * for a bf16 x up to 8 rows (~1.1x at 5-7), where the tile's bf16 dot products win beyond. The
     * other kinds' pairs cost more to unpack: registers beyond 4 rows measured 0.73-0.92x at 8-64
     * rows for Q5_1 (1.19x at 5). */
    const int direct = F32 ? kind == QD4 || kind == QK4 || kind == Q8 : M <= 8; /* M > 4 here */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int b = 0; b < NB; b++) {
        __attribute__((aligned(64))) uint32_t tile[16 * 64 * 2]; /* bf16 pairs: the first half; float32: all */
        const Lut lut = make_lut(off);
        for (int g = 0; g < G; g++) {
            const uint8_t *q, *hi;
            __m512 s[4], z[4];
            if (!direct && g + 1 < G) prefetch_group(kind, wt, K, b, g + 1);
            group_at(kind, wt, N, K, G, b, g, &q, &hi, s, z);
            const int first = g == 0;
            const char *xg = (const char *)x + (size_t)g * GC * esize;
            const float *xs = has_offset(kind) ? xsum + g : NULL;
            float *o = out + (size_t)b * 64;
            if (direct) { /* chunks of rows, each unpacking the group again: no tile */
                row_chunks(kind, F32, 1, M, q, hi, lut, NULL, xg, K, xs, G, s, z, o, ldo, first);
                continue;
            }
            for (int kp = 0; kp < GC / 2; kp++) {
                __m512i w[4];
                unpack_pair(kind, q, hi, kp, lut, w);
                for (int t = 0; t < 4; t++)
                    if (F32) { /* column 2kp's 64 rows, then 2kp + 1's */
                        _mm512_store_ps((float *)tile + kp * 128 + 16 * t, pair_column(w[t], 0));
                        _mm512_store_ps((float *)tile + kp * 128 + 64 + 16 * t, pair_column(w[t], 1));
                    } else {
                        _mm512_store_si512(tile + kp * 64 + 16 * t, w[t]);
                    }
            }
            row_chunks(kind, F32, 0, M, q, hi, lut, tile, xg, K, xs, G, s, z, o, ldo, first);
        }
    }
}


/* ---- AVX2 + FMA: the float32 kernel for CPUs without AVX512_BF16 ----------------------------
 *
 * Same planes, same arithmetic as the AVX512 kernel's float32 x, term for term: the integers
 * become float32 q - off (exact), each row's group sum runs one FMA per column in column order,
 * the scales and the epilogue are the same float32 operations. So its results are bit-equal to
 * the AVX512 kernel's for a float32 x (tested), on half the vector width: a block's 64 rows go
 * as two halves of 32 (four registers of 8), 1-2 rows of x at a time from registers, more from a
 * 4 KB tile of the half-group, 3 rows at a time (2 for 2, 4 and 8 rows' last ones: the 16
 * registers hold 12 accumulators; 1.02-1.09x chunks of 2 at 6-64 rows, bit-equal); 1-5 rows
 * against a 4-bit kind go by whole blocks, a pass per row (row_dot8_nibbles). */

/* Rows 32h + 8t .. + 7 of column k (of its group) as float32 q - off, t = 0..3. */
INLINE2 void unpack_col8(const int kind, const uint8_t *q, const uint8_t *hi, int k, int h, float off, __m256 w[4]) {
    if (kind == Q8) { /* column pair k / 2: bytes 2r, 2r + 1 = row r at columns 2kp, 2kp + 1 */
        const uint8_t *p = q + (size_t)(k / 2) * 128 + 64 * h;
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * t)));
            const __m256i c = k % 2 == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16) : _mm256_srai_epi32(v, 16);
            w[t] = _mm256_cvtepi32_ps(c);
        }
        return;
    }
    const uint8_t *col = q + (size_t)k * 32; /* byte j = row j | row j + 32 << 4 */
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    __m256i hb[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* Q5: byte i = rows i + 8j at bit j; Q6_K: byte i = rows i + 16j at bits 2j, 2j + 1 */
    if (hi_bits(kind) == 1) {
        hb[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hi + (size_t)k * 8)));
    } else if (hi_bits(kind) == 2) {
        hb[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hi + (size_t)k * 16)));
        hb[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hi + (size_t)k * 16 + 8)));
    }
    for (int t = 0; t < 4; t++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + 8 * t)));
        v = _mm256_and_si256(h ? _mm256_srli_epi32(v, 4) : v, low4);
        if (hi_bits(kind) == 1) /* row 32h + 8t + i: bit 4h + t of byte i */
            v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb[0], 4 * h + t), _mm256_set1_epi32(1)), 4));
        else if (hi_bits(kind) == 2) /* row 32h + 8t + i: byte 8 (t % 2) + i, bits 2 (2h + t / 2) */
            v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb[t % 2], 2 * (2 * h + t / 2)), _mm256_set1_epi32(3)), 4));
        /* 2^23 + v as float bits, less 2^23 + off: v - off, exact (v < 64), one op cheaper than a conversion */
        w[t] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(v, _mm256_set1_epi32(0x4B000000))),
                             _mm256_set1_ps(8388608.0f + off));
    }
}

INLINE2 __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE2 __m256 u8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE2 __m256 i8x8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* group_scales for rows n0 + 8t .. + 7 (n0: the half's first row). */
INLINE2 void group_scales8(const int kind, const Weight *wt, int N, size_t n0, int g, __m256 s[4], __m256 z[4]) {
    for (int t = 0; t < 4; t++) {
        const size_t n = n0 + 8 * t, at = (size_t)g * N + n;
        if (kind == QD4 || kind == QD5) {
            s[t] = f16x8((const uint16_t *)wt->s1 + at);
            z[t] = wt->s2 != NULL ? f16x8((const uint16_t *)wt->s2 + at) : _mm256_setzero_ps();
        } else if (kind == QK4 || kind == QK5) {
            const size_t sb = (size_t)(g / 8) * N + n;
            s[t] = _mm256_mul_ps(f16x8(wt->d + sb), u8x8((const uint8_t *)wt->s1 + at));
            z[t] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f16x8(wt->dmin + sb), u8x8((const uint8_t *)wt->s2 + at)));
        } else if (kind == Q6K) {
            s[t] = _mm256_mul_ps(f16x8(wt->d + (size_t)(g / 16) * N + n), i8x8((const int8_t *)wt->s1 + at));
            z[t] = _mm256_setzero_ps();
        } else {
            s[t] = f16x8((const uint16_t *)wt->s1 + at);
            z[t] = _mm256_setzero_ps();
        }
    }
}

/* MT (1, 2) rows of x against one (half-block, group), columns from registers or the tile. */
INLINE2 void rows_dot8(const int kind, const int MT, const int direct, const uint8_t *q, const uint8_t *hi, int h,
                       float off, const float *tile, const float *x, size_t K, const float *xsum, size_t G,
                       const __m256 s[4], const __m256 z[4], float *out, size_t ldo, int first) {
    __m256 p[3][4];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < 4; t++) p[m][t] = _mm256_setzero_ps();
    for (int k = 0; k < group_cols(kind); k++) {
        __m256 w[4];
        if (direct)
            unpack_col8(kind, q, hi, k, h, off, w);
        else
            for (int t = 0; t < 4; t++) w[t] = _mm256_load_ps(tile + k * 32 + 8 * t);
        for (int m = 0; m < MT; m++) {
            const __m256 xv = _mm256_set1_ps(x[m * K + k]);
            for (int t = 0; t < 4; t++) p[m][t] = _mm256_fmadd_ps(w[t], xv, p[m][t]);
        }
    }
    for (int m = 0; m < MT; m++) {
        const __m256 xs = has_offset(kind) ? _mm256_set1_ps(xsum[m * G]) : _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            float *o = out + m * ldo + 8 * t;
            __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
            acc = _mm256_fmadd_ps(p[m][t], s[t], acc);
            if (has_offset(kind)) acc = _mm256_fmadd_ps(z[t], xs, acc);
            _mm256_storeu_ps(o, acc);
        }
    }
}

/* group_scales8 for the whole block b (s, z[0..3]: rows 0..31; [4..7]: 32..63), the scales two
 * groups on prefetched. */
INLINE2 void block_scales8(const int kind, const Weight *wt, int N, int G, int b, int g, __m256 s[8], __m256 z[8]) {
    if (g + PREFETCH_GROUPS < G) prefetch_scales(kind, wt, N, b, g + PREFETCH_GROUPS);
    group_scales8(kind, wt, N, (size_t)b * 64, g, s, z);
    group_scales8(kind, wt, N, (size_t)b * 64 + 32, g, s + 4, z + 4);
}

/* One row of x against a whole (block, group) of a 4-bit kind (Q4_0, Q4_1, Q4_K): each column's
 * 32 bytes widened once for both halves (low nibbles: rows 0..31, high: rows 32..63; the halves
 * path widens them twice) and the integers converted straight (less off first where it is not
 * 0). The values and the order of rows_dot8's sums, so its bits; 2.3x faster at one row. Up to
 * 5 rows take a pass each, the block's bytes in L1 for the later ones: against the halves and
 * the tile 1.55x at 2 rows, 1.37x at 3, 1.16x at 4, 1.10x at 5, the same at 6 (SmolLM2's layers,
 * KVSTRATA_NATIVE_ISA=avx2 tools/bench_native_ab.py). */
INLINE2 void row_dot8_nibbles(const int kind, const uint8_t *q, int off, const float *x, const float *xsum,
                              const __m256 s[8], const __m256 z[8], float *out, int first) {
    const __m256i low4 = _mm256_set1_epi32(0x0F), offv = _mm256_set1_epi32(off);
    __m256 p[8];
    for (int t = 0; t < 8; t++) p[t] = _mm256_setzero_ps();
    for (int k = 0; k < 32; k++) {
        const uint8_t *col = q + (size_t)k * 32; /* byte j = row j | row j + 32 << 4 */
        const __m256 xv = _mm256_set1_ps(x[k]);
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + 8 * t)));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_srli_epi32(v, 4);
            if (off != 0) {
                lo = _mm256_sub_epi32(lo, offv);
                hi = _mm256_sub_epi32(hi, offv);
            }
            p[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), xv, p[t]);
            p[4 + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), xv, p[4 + t]);
        }
    }
    const __m256 xs = has_offset(kind) ? _mm256_set1_ps(xsum[0]) : _mm256_setzero_ps();
    for (int t = 0; t < 8; t++) {
        float *o = out + 8 * t;
        __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
        acc = _mm256_fmadd_ps(p[t], s[t], acc);
        if (has_offset(kind)) acc = _mm256_fmadd_ps(z[t], xs, acc);
        _mm256_storeu_ps(o, acc);
    }
}

/* M rows of x against block b of a 4-bit kind, group by group, a row_dot8_nibbles pass per row. */
INLINE2 void block_rows8(const int kind, int off, const float *x, const Weight *wt, float *out, int M, int N, int K,
                         long ldo, const float *xsum, int b) {
    const int GC = group_cols(kind), G = K / GC;
    for (int g = 0; g < G; g++) {
        __m256 s[8], z[8];
        block_scales8(kind, wt, N, G, b, g, s, z);
        const uint8_t *q, *hi;
        group_bytes(kind, wt, K, b, g, &q, &hi);
        for (int m = 0; m < M; m++)
            row_dot8_nibbles(kind, q, off, x + (size_t)m * K + (size_t)g * GC, xsum + (size_t)m * G + g, s, z,
                             out + (size_t)m * ldo + (size_t)b * 64, g == 0);
    }
}

INLINE2 void matmul8(const int kind, int off, const float *x, const Weight *wt, float *out, int M, int N, int K,
                     long ldo, int nthreads, const float *xsum) {
    const int GC = group_cols(kind), G = K / GC, NH = N / 32;
    if (M <= 5 && (kind == QD4 || kind == QK4)) { /* whole blocks, a pass per row: see row_dot8_nibbles */
        if (M == 1) /* a region of its own: sharing one with the loop below cost one row 2-4 % */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
            for (int b = 0; b < N / 64; b++) block_rows8(kind, off, x, wt, out, 1, N, K, ldo, xsum, b);
        else
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
            for (int b = 0; b < N / 64; b++) block_rows8(kind, off, x, wt, out, M, N, K, ldo, xsum, b);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int bh = 0; bh < NH; bh++) {
        const int b = bh / 2, h = bh % 2;
        __attribute__((aligned(32))) float tile[32 * 32];
        for (int g = 0; g < G; g++) {
            const uint8_t *q, *hi;
            group_bytes(kind, wt, K, b, g, &q, &hi);
            __m256 s[4], z[4];
            group_scales8(kind, wt, N, (size_t)bh * 32, g, s, z);
            const int first = g == 0;
            const float *xg = x + (size_t)g * GC;
            const float *xs = has_offset(kind) ? xsum + g : NULL;
            float *o = out + (size_t)bh * 32;
            if (M <= 2) {
                if (M == 1) rows_dot8(kind, 1, 1, q, hi, h, (float)off, NULL, xg, K, xs, G, s, z, o, ldo, first);
                else rows_dot8(kind, 2, 1, q, hi, h, (float)off, NULL, xg, K, xs, G, s, z, o, ldo, first);
                continue;
            }
            for (int k = 0; k < GC; k++) {
                __m256 w[4];
                unpack_col8(kind, q, hi, k, h, (float)off, w);
                for (int t = 0; t < 4; t++) _mm256_store_ps(tile + k * 32 + 8 * t, w[t]);
            }
            for (int m0 = 0, mt; m0 < M; m0 += mt) {
                const float *xm = xg + (size_t)m0 * K;
                const float *xsm = xs == NULL ? NULL : xs + (size_t)m0 * G;
                float *om = o + (size_t)m0 * ldo;
                const int left = M - m0;
                mt = left >= 3 && left != 4 ? 3 : left >= 2 ? 2 : 1; /* no 1-row rest where 2 + 2 will do */
                if (mt == 3) rows_dot8(kind, 3, 0, q, hi, h, (float)off, tile, xm, K, xsm, G, s, z, om, ldo, first);
                else if (mt == 2) rows_dot8(kind, 2, 0, q, hi, h, (float)off, tile, xm, K, xsm, G, s, z, om, ldo, first);
                else rows_dot8(kind, 1, 0, q, hi, h, (float)off, tile, xm, K, xsm, G, s, z, om, ldo, first);
            }
        }
    }
}

/* The one entry point: out = x @ W^T for a weight of ``kind`` (the enum above) laid out as
 * the header says; off: the table's offset (Q4_0 8, Q5_0 16, Q6_K 32, else 0). x_f32 0: x is
 * bf16; 1: float32. isa 2: the AVX512 kernels; 1: the AVX2 one (float32 x only). xsum:
 * M * K / 32 floats of scratch (the kinds with an offset). M >= 1, N % 64 == 0, K a multiple
 * of the kind's block; the caller checks shapes, strides and the CPU (kvq_isa). Returns 0, or
 * -1 for an unknown kind or an isa / x pairing there is no kernel for. */
#define KVQ_CASE(K_, F_) \
    case K_: matmul(K_, F_, off, x, wt, out, M, N, K, ldo, nthreads, xsum); return 0;
#define KVQ_CASE8(K_) \
    case K_: matmul8(K_, off, (const float *)x, wt, out, M, N, K, ldo, nthreads, xsum); return 0;

KVQ_AVX2 static int matmul_avx2(int kind, int off, const void *x, const Weight *wt, float *out, int M, int N, int K,
                                long ldo, int nthreads, float *xsum) {
    switch (kind) { KVQ_CASE8(QD4) KVQ_CASE8(QD5) KVQ_CASE8(QK4) KVQ_CASE8(QK5) KVQ_CASE8(Q6K) KVQ_CASE8(Q8) }
    return -1;
}

KVQ_TARGET static int matmul_avx512(int kind, int off, const void *x, int x_f32, const Weight *wt, float *out, int M,
                                    int N, int K, long ldo, int nthreads, float *xsum) {
    if (x_f32)
        switch (kind) { KVQ_CASE(QD4, 1) KVQ_CASE(QD5, 1) KVQ_CASE(QK4, 1) KVQ_CASE(QK5, 1) KVQ_CASE(Q6K, 1) KVQ_CASE(Q8, 1) }
    else
        switch (kind) { KVQ_CASE(QD4, 0) KVQ_CASE(QD5, 0) KVQ_CASE(QK4, 0) KVQ_CASE(QK5, 0) KVQ_CASE(Q6K, 0) KVQ_CASE(Q8, 0) }
    return -1;
}

int kvq_matmul(int isa, int kind, int off, const void *x, int x_f32, const uint8_t *q, const uint8_t *hi,
               const void *s1, const void *s2, const uint16_t *d, const uint16_t *dmin, float *out, int M, int N, int K,
               long ldo, int nthreads, float *xsum) {
    const Weight wt = {q, hi, s1, s2, d, dmin};
    if ((isa != 1 && isa != 2) || (isa == 1 && !x_f32) || kind < QD4 || kind > Q8) return -1;
    if (has_offset(kind)) group_sums(x, x_f32, M, K, xsum);
    return isa == 2 ? matmul_avx512(kind, off, x, x_f32, &wt, out, M, N, K, ldo, nthreads, xsum)
                    : matmul_avx2(kind, off, x, &wt, out, M, N, K, ldo, nthreads, xsum);
}
