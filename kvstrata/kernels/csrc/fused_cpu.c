/* kvstrata: the fused elementwise work of a decoder layer on the CPU (kernels/fused.py's
 * contract), one call where the torch code runs a chain of small ops:
 *
 *   kvf_add_rms_norm     s = residual + x (or x); out = RMSNorm(s) * weight; residual_out = s
 *   kvf_rotary_and_cache q_out = rotate(q); rotate(k) and v written to the paged caches at the
 *                        slots (a negative slot: padding, nothing written)
 *
 * Rounding as the torch code rounds: every product and sum in float32, rounded to the tensors'
 * dtype (float32, bf16 or fp16) after each op torch rounds after (so rotary and the residual
 * sum are bit-equal to the references; no FMA contraction below). The norm's sum of squares
 * runs in double and is rounded once (torch's float32 cascade sum: the two agree to the last
 * bit nearly always, within an ulp of the mean otherwise), then mean, eps, 1 / sqrt and the
 * products in float32 as torch forms them. Portable C (no ISA needed).
 */
/* no FMA contraction: every product is rounded before it is added, as torch rounds */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { F32, BF16, F16 }; /* the order of fused_native.DTYPES */
#define MAX_H 16384        /* the norm's row width */

int kvf_abi_version(void) { return 1; }

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays a quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float ld(const void *p, size_t i, int dt) {
    if (dt == F32) return ((const float *)p)[i];
    if (dt == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

INLINE void st(void *p, size_t i, int dt, float v) {
    if (dt == F32) ((float *)p)[i] = v;
    else if (dt == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((_Float16 *)p)[i] = (_Float16)v;
}

/* v rounded to dt (and back to float32): what a torch op in dt leaves */
INLINE float rnd(float v, int dt) {
    if (dt == F32) return v;
    if (dt == BF16) return bf16_to_f32(f32_to_bf16(v));
    return (float)(_Float16)v;
}

/* Rows t < T of width H (row strides in elements; residual / residual_out may be NULL). dt is a
 * constant in each instance below, so the loads and roundings fold. */
INLINE void add_rms_norm(const int dt, const void *x, long xs, const void *res, long rs, const void *w, float eps,
                         void *out, long os, void *res_out, long ros, int T, int H) {
    float s[MAX_H];
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < H; i++) {
            float v = ld(x, (size_t)t * xs + i, dt);
            s[i] = res ? rnd(ld(res, (size_t)t * rs + i, dt) + v, dt) : v;
        }
        double q[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* eight chains: the sum is not one long dependency */
        int i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) q[j] += (double)s[i + j] * s[i + j];
        for (; i < H; i++) q[0] += (double)s[i] * s[i];
        const double sq = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
        /* torch: mean of the squares in float32, + eps, rsqrt; x * r, rounded to dt, * weight */
        const float r = 1.0f / sqrtf((float)sq / (float)H + eps);
        if (res_out)
            for (int k = 0; k < H; k++) st(res_out, (size_t)t * ros + k, dt, s[k]);
        for (int k = 0; k < H; k++) st(out, (size_t)t * os + k, dt, ld(w, k, dt) * rnd(s[k] * r, dt));
    }
}

#define NORM(name, DT)                                                                                         \
    __attribute__((noinline)) static void name(const void *x, long xs, const void *res, long rs, const void *w, \
                                               float eps, void *out, long os, void *ro, long ros, int T, int H) { \
        add_rms_norm(DT, x, xs, res, rs, w, eps, out, os, ro, ros, T, H);                                       \
    }
NORM(norm_f32, F32)
NORM(norm_bf16, BF16)
NORM(norm_f16, F16)

int kvf_add_rms_norm(int dt, const void *x, long xs, const void *res, long rs, const void *w, float eps, void *out,
                     long os, void *res_out, long ros, int T, int H) {
    if (dt < F32 || dt > F16 || H <= 0 || H > MAX_H) return -1;
    (dt == F32 ? norm_f32 : dt == BF16 ? norm_bf16 : norm_f16)(x, xs, res, rs, w, eps, out, os, res_out, ros, T, H);
    return 0;
}

/* One head of D at element a of src, rotated by cos / sin (element c0 on) into element o of dst:
 * both halves read before either is written, so dst may be src. */
INLINE void rotate(const int dt, const void *src, size_t a, void *dst, size_t o, const void *cosp, const void *sinp,
                   size_t c0, int half) {
    for (int d = 0; d < half; d++) {
        float c = ld(cosp, c0 + d, dt), sn = ld(sinp, c0 + d, dt);
        float x1 = ld(src, a + d, dt), x2 = ld(src, a + half + d, dt);
        float o1 = rnd(rnd(x1 * c, dt) - rnd(x2 * sn, dt), dt);
        float o2 = rnd(rnd(x2 * c, dt) + rnd(x1 * sn, dt), dt);
        st(dst, o + d, dt, o1);
        st(dst, o + half + d, dt, o2);
    }
}

/* q [T][Hq][D] (token stride qs), k, v [T][Hkv][D] (strides ks, vs), cos / sin [T][D/2] (token
 * stride cs), caches [blocks][block_size][Hkv][D] with block stride bst, slots int64 or int32
 * (slot_bytes 8 or 4). q_out may be q. */
INLINE void rotary_and_cache(const int dt, const void *q, long qs, const void *k, long ks, const void *v, long vs,
                             const void *cosp, const void *sinp, long cs, void *kc, void *vc, long bst, int block_size,
                             const void *slots, int slot_bytes, void *q_out, long qos, int T, int Hq, int Hkv, int D) {
    const int half = D / 2;
    const size_t row = (size_t)Hkv * D, es = dt == F32 ? 4 : 2;
    for (int t = 0; t < T; t++) {
        const size_t c0 = (size_t)t * cs;
        for (int h = 0; h < Hq; h++)
            rotate(dt, q, (size_t)t * qs + (size_t)h * D, q_out, (size_t)t * qos + (size_t)h * D, cosp, sinp, c0, half);
        const long long slot = slot_bytes == 8 ? ((const int64_t *)slots)[t] : ((const int32_t *)slots)[t];
        if (slot < 0) continue;
        const size_t at = (size_t)(slot / block_size) * bst + (size_t)(slot % block_size) * row;
        for (int h = 0; h < Hkv; h++) {
            rotate(dt, k, (size_t)t * ks + (size_t)h * D, kc, at + (size_t)h * D, cosp, sinp, c0, half);
            memcpy((char *)vc + (at + (size_t)h * D) * es, (const char *)v + ((size_t)t * vs + (size_t)h * D) * es,
                   (size_t)D * es);
        }
    }
}

#define ROTARY(name, DT)                                                                                       \
    __attribute__((noinline)) static void name(const void *q, long qs, const void *k, long ks, const void *v,   \
                                               long vs, const void *c, const void *sn, long cs, void *kc,       \
                                               void *vc, long bst, int bs, const void *sl, int sb, void *qo,   \
                                               long qos, int T, int Hq, int Hkv, int D) {                      \
        rotary_and_cache(DT, q, qs, k, ks, v, vs, c, sn, cs, kc, vc, bst, bs, sl, sb, qo, qos, T, Hq, Hkv, D); \
    }
ROTARY(rotary_f32, F32)
ROTARY(rotary_bf16, BF16)
ROTARY(rotary_f16, F16)

int kvf_rotary_and_cache(int dt, const void *q, long qs, const void *k, long ks, const void *v, long vs,
                         const void *cosp, const void *sinp, long cs, void *kc, void *vc, long bst, int block_size,
                         const void *slots, int slot_bytes, void *q_out, long qos, int T, int Hq, int Hkv, int D) {
    if (dt < F32 || dt > F16 || D <= 0 || D % 2 || block_size <= 0 || (slot_bytes != 4 && slot_bytes != 8)) return -1;
    (dt == F32 ? rotary_f32 : dt == BF16 ? rotary_bf16 : rotary_f16)(q, qs, k, ks, v, vs, cosp, sinp, cs, kc, vc, bst,
                                                                  block_size, slots, slot_bytes, q_out, qos, T, Hq,
                                                                  Hkv, D);
    return 0;
}
