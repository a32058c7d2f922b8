/* grace_dl's compiled kernels: single passes over a gradient where NumPy/torch need several.
 *
 * Plain C with no Python API (loaded through ctypes by grace_dl/native/__init__.py), so it
 * builds without Python's headers and any framework can call it on a raw buffer. Each kernel
 * has a portable scalar loop and, on x86-64, wider versions picked at run time from the CPU's
 * features (GCC/Clang target attributes), so one build runs on any x86-64 host.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GD_X86 1
#include <immintrin.h>
#endif

/* Does x reach t under `mode`: 0 |x| >= t, 1 x >= t, -1 x <= -t. NaN never does (every
 * comparison with NaN is false). */
static inline int reaches(float x, float t, int mode) {
    if (mode == 0) return (x < 0 ? -x : x) >= t;
    return mode > 0 ? x >= t : x <= -t;
}

static int64_t positions_scalar(const float *x, int64_t lo, int64_t n, float t, int mode,
                                int32_t *out, int64_t c, int64_t cap) {
    for (int64_t i = lo; i < n; i++)
        if (reaches(x[i], t, mode)) {
            if (c < cap) out[c] = (int32_t)i;
            c++;
        }
    return c;
}

#ifdef GD_X86
__attribute__((target("avx512f")))
static int64_t positions_avx512(const float *x, int64_t n, float t, int mode, int32_t *out,
                                int64_t cap) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512 tv = _mm512_set1_ps(mode < 0 ? -t : t);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t c = 0, i = 0;
    /* branch-free: every block's hits' positions are packed to the front of a register and
     * the whole register is stored (c + 16 <= cap: the lanes past the hits land in the buffer
     * and are overwritten by the next block). Not a compress-store to memory: AMD's Zen 4
     * runs vpcompressd with a memory operand in microcode, ~7x slower than this loop there
     * (4.2M fp32: 6.6 ms against 1.0), while the register form is fast on every AVX-512 CPU. */
    for (; i + 16 <= n && c + 16 <= cap; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 m;
        if (mode == 0)
            m = _mm512_cmp_ps_mask(
                _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask)), tv,
                _CMP_GE_OQ);
        else if (mode > 0)
            m = _mm512_cmp_ps_mask(v, tv, _CMP_GE_OQ);
        else
            m = _mm512_cmp_ps_mask(v, tv, _CMP_LE_OQ);
        _mm512_storeu_si512((void *)(out + c), _mm512_maskz_compress_epi32(m, idx));
        c += __builtin_popcount((unsigned)m);
        idx = _mm512_add_epi32(idx, sixteen);
    }
    return positions_scalar(x, i, n, t, mode, out, c, cap);
}

__attribute__((target("avx2")))
static int64_t positions_avx2(const float *x, int64_t n, float t, int mode, int32_t *out,
                              int64_t cap) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256 tv = _mm256_set1_ps(mode < 0 ? -t : t);
    int64_t c = 0, i = 0;
    for (; i + 8 <= n && c + 8 <= cap; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i), hit;
        if (mode == 0)
            hit = _mm256_cmp_ps(
                _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), abs_mask)), tv,
                _CMP_GE_OQ);
        else if (mode > 0)
            hit = _mm256_cmp_ps(v, tv, _CMP_GE_OQ);
        else
            hit = _mm256_cmp_ps(v, tv, _CMP_LE_OQ);
        unsigned m = (unsigned)_mm256_movemask_ps(hit);
        while (m) {
            out[c++] = (int32_t)(i + __builtin_ctz(m));
            m &= m - 1;
        }
    }
    return positions_scalar(x, i, n, t, mode, out, c, cap);
}
#endif

/* ---------------------------------------------------------------- sign codes
 * The 1-bit planes of grace_dl/compressors/signbits.py: element i is bit i % 8 of byte i / 8;
 * bits past n are 0. */

static inline int nonfinite(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u & 0x7fffffffu) >= 0x7f800000u;
}

/* elements [lo, n), lo a multiple of 8: the planes' remaining bytes, bit by bit */
static int sign_code_scalar(const float *x, int64_t lo, int64_t n, uint8_t *neg, uint8_t *zero,
                            float *err, float *dec) {
    int bad = 0;
    for (int64_t b = lo; b < n; b += 8) {
        uint8_t nb = 0, zb = 0;
        for (int64_t i = b; i < b + 8 && i < n; i++) {
            float v = x[i];
            float d = v > 0 ? 1.0f : (v < 0 ? -1.0f : 0.0f);
            nb |= (uint8_t)((v < 0) << (i - b));
            zb |= (uint8_t)((v == 0) << (i - b));
            bad |= nonfinite(v);
            if (dec) dec[i] = d;
            if (err) err[i] = v - d;
        }
        neg[b >> 3] = nb;
        if (zero) zero[b >> 3] = zb;
    }
    return bad;
}

static void ternary_scalar(const uint8_t *pos, const uint8_t *neg, int64_t lo, int64_t n,
                           float *out) {
    for (int64_t i = lo; i < n; i++) {
        int p = (pos[i >> 3] >> (i & 7)) & 1, m = (neg[i >> 3] >> (i & 7)) & 1;
        out[i] = (float)(p - m);
    }
}

#ifdef GD_X86
/* The sign code of the 16 elements v at position i (a multiple of 16): their negative and zero
 * planes' 2 bytes (zero skipped when NULL), dec = sign(v) and err = v - sign(v) when not NULL
 * (err may be v's own memory); returns the lanes holding a NaN or an Inf. */
__attribute__((target("avx512f")))
static inline __mmask16 sign_code_block_avx512(__m512 v, int64_t i, uint8_t *neg, uint8_t *zero,
                                               float *err, float *dec) {
    const __m512 z = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 minus = _mm512_set1_ps(-1.0f);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    __mmask16 mn = _mm512_cmp_ps_mask(v, z, _CMP_LT_OQ);
    __mmask16 mp = _mm512_cmp_ps_mask(v, z, _CMP_GT_OQ);
    uint16_t nb = (uint16_t)mn;
    memcpy(neg + (i >> 3), &nb, 2);
    if (zero) {
        uint16_t zb = (uint16_t)_mm512_cmp_ps_mask(v, z, _CMP_EQ_OQ);
        memcpy(zero + (i >> 3), &zb, 2);
    }
    if (err || dec) {
        __m512 d = _mm512_mask_blend_ps(mp, _mm512_mask_blend_ps(mn, z, minus), one);
        if (dec) _mm512_storeu_ps(dec + i, d);
        if (err) _mm512_storeu_ps(err + i, _mm512_sub_ps(v, d));
    }
    return _mm512_cmpge_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf);
}

__attribute__((target("avx512f")))
static int sign_code_avx512(const float *x, int64_t n, uint8_t *neg, uint8_t *zero, float *err,
                            float *dec) {
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        bad |= sign_code_block_avx512(_mm512_loadu_ps(x + i), i, neg, zero, err, dec);
    return (bad != 0) | sign_code_scalar(x, i, n, neg, zero, err, dec);
}

__attribute__((target("avx512f")))
static void ternary_avx512(const uint8_t *pos, const uint8_t *neg, int64_t n, float *out) {
    const __m512 z = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 minus = _mm512_set1_ps(-1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint16_t p, m;
        memcpy(&p, pos + (i >> 3), 2);
        memcpy(&m, neg + (i >> 3), 2);
        __m512 v = _mm512_mask_blend_ps((__mmask16)(m & ~p), z, minus);
        _mm512_storeu_ps(out + i, _mm512_mask_blend_ps((__mmask16)(p & ~m), v, one));
    }
    ternary_scalar(pos, neg, i, n, out);
}

/* the 8 lanes of an AVX2 vector whose bit is set in `byte` */
__attribute__((target("avx2")))
static inline __m256 lanes_of(uint8_t byte) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i b = _mm256_and_si256(_mm256_set1_epi32(byte), bit);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
}

/* The AVX2 twin of sign_code_block_avx512 for the 8 elements v at position i (a multiple of
 * 8): their planes' byte, dec and err; returns the lanes holding a NaN or an Inf. */
__attribute__((target("avx2")))
static inline __m256i sign_code_block_avx2(__m256 v, int64_t i, uint8_t *neg, uint8_t *zero,
                                           float *err, float *dec) {
    const __m256 z = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 minus = _mm256_set1_ps(-1.0f);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
    __m256 ln = _mm256_cmp_ps(v, z, _CMP_LT_OQ), lp = _mm256_cmp_ps(v, z, _CMP_GT_OQ);
    neg[i >> 3] = (uint8_t)_mm256_movemask_ps(ln);
    if (zero) zero[i >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, z, _CMP_EQ_OQ));
    if (err || dec) {
        __m256 d = _mm256_blendv_ps(_mm256_blendv_ps(z, minus, ln), one, lp);
        if (dec) _mm256_storeu_ps(dec + i, d);
        if (err) _mm256_storeu_ps(err + i, _mm256_sub_ps(v, d));
    }
    return _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), max_finite);
}

__attribute__((target("avx2")))
static int sign_code_avx2(const float *x, int64_t n, uint8_t *neg, uint8_t *zero, float *err,
                          float *dec) {
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        bad = _mm256_or_si256(bad, sign_code_block_avx2(_mm256_loadu_ps(x + i), i, neg, zero,
                                                        err, dec));
    return (!_mm256_testz_si256(bad, bad)) | sign_code_scalar(x, i, n, neg, zero, err, dec);
}

__attribute__((target("avx2")))
static void ternary_avx2(const uint8_t *pos, const uint8_t *neg, int64_t n, float *out) {
    const __m256 z = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 minus = _mm256_set1_ps(-1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint8_t p = pos[i >> 3], m = neg[i >> 3];
        __m256 v = _mm256_blendv_ps(z, minus, lanes_of((uint8_t)(m & ~p)));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(v, one, lanes_of((uint8_t)(p & ~m))));
    }
    ternary_scalar(pos, neg, i, n, out);
}
#endif

/* ---------------------------------------------------------------- qsgd levels
 * grace_dl/compressors/qsgd.py's stochastic levels and decoded values, the same float32
 * operations in the same order (built with -ffp-contract=off: no fused multiply-adds), so the
 * results are bit for bit those of torch's elementwise ops. Row r of b elements has its own
 * scale[r] (s / norm) and step[r] (norm / s). */

/* float32 -> int32 as x86's cvttps2dq: truncation, and INT32_MIN for NaN and out of range */
static inline int32_t trunc_i32(float t) {
    if (!(t >= -2147483648.0f && t < 2147483648.0f)) return INT32_MIN;
    return (int32_t)t;
}

static inline float dither_of(const void *k, int kbits, int64_t i) {
    return kbits == 8 ? (float)((const uint8_t *)k)[i] : (float)((const uint16_t *)k)[i];
}

/* elements [from, to) of one row, whose scale and step are given */
static void levels_span(const float *x, int64_t from, int64_t to, float scale, float step,
                        const void *k, int kbits, float s, int hi, uint8_t *codes, float *err,
                        float *dec) {
    const float unit = kbits == 8 ? 1.0f / 256 : 1.0f / 65536;
    const float off = s + unit * 0.5f;
    for (int64_t i = from; i < to; i++) {
        float xi = x[i], t = xi * scale;
        t += dither_of(k, kbits, i) * unit;
        t += off;
        uint8_t c = (uint8_t)(uint32_t)trunc_i32(t);
        if (c > hi) c = (uint8_t)hi;
        codes[i] = c;
        if (err || dec) {
            float v = (float)c - s;
            v *= step;
            if (dec) dec[i] = v;
            if (err) err[i] = xi - v;
        }
    }
}

static void values_span(const uint8_t *codes, int64_t from, int64_t to, float step, float s,
                        float *out, int accumulate) {
    for (int64_t i = from; i < to; i++) {
        float v = (float)codes[i] - s;
        v *= step;
        out[i] = accumulate ? v + out[i] : v;
    }
}

#ifdef GD_X86
__attribute__((target("avx512f")))
static void levels_avx512(const float *x, int64_t rows, int64_t b, const float *scale,
                          const float *step, const void *k, int kbits, float s, int hi,
                          uint8_t *codes, float *err, float *dec) {
    const float unit_f = kbits == 8 ? 1.0f / 256 : 1.0f / 65536;
    const __m512 unit = _mm512_set1_ps(unit_f), off = _mm512_set1_ps(s + unit_f * 0.5f);
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i hiv = _mm512_set1_epi32(hi), low_byte = _mm512_set1_epi32(0xff);
    int64_t i = 0;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 sc = _mm512_set1_ps(scale[r]), st = _mm512_set1_ps(step[r]);
        int64_t end = (r + 1) * b;
        for (; i + 16 <= end; i += 16) {
            __m512 xv = _mm512_loadu_ps(x + i);
            __m512i ki = kbits == 8
                ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)k + i)))
                : _mm512_cvtepu16_epi32(
                      _mm256_loadu_si256((const __m256i *)((const uint16_t *)k + i)));
            __m512 t = _mm512_mul_ps(xv, sc);
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(ki), unit));
            t = _mm512_add_ps(t, off);
            __m512i c = _mm512_and_si512(_mm512_cvttps_epi32(t), low_byte);
            c = _mm512_min_epu32(c, hiv);
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(c));
            if (err || dec) {
                __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c), sv), st);
                if (dec) _mm512_storeu_ps(dec + i, v);
                if (err) _mm512_storeu_ps(err + i, _mm512_sub_ps(xv, v));
            }
        }
        /* a row whose length is not a multiple of 16: its tail */
        levels_span(x, i, end, scale[r], step[r], k, kbits, s, hi, codes, err, dec);
        i = end;
    }
}

__attribute__((target("avx512f")))
static void values_avx512(const uint8_t *codes, int64_t rows, int64_t b, const float *step,
                          float s, float *out, int accumulate) {
    const __m512 sv = _mm512_set1_ps(s);
    int64_t i = 0;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 st = _mm512_set1_ps(step[r]);
        int64_t end = (r + 1) * b;
        for (; i + 16 <= end; i += 16) {
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c), sv), st);
            if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(out + i));
            _mm512_storeu_ps(out + i, v);
        }
        values_span(codes, i, end, step[r], s, out, accumulate);
        i = end;
    }
}
#endif

/* ---------------------------------------------------------------- two-phase signSGD
 * The server's step of signsgd over two phases, fused: the majority vote of the ranks'
 * payloads (each one's negative plane at [0, nb), zero plane at [nb, 2 nb)): v = the sign of
 * the sum of their -1/0/+1, added to the server's residual, s = slot + v, then the sign code of
 * s as sign_code_* writes it, its error s - sign(s) back into slot and sign(s) into dec. The
 * same float operations as the vote decoded, added and re-encoded one after the other. */
static inline float vote_at(const uint8_t *const *payloads, int ranks, int64_t nb, int64_t i) {
    int sum = 0;
    for (int r = 0; r < ranks; r++) {
        int m = (payloads[r][i >> 3] >> (i & 7)) & 1;
        int z = (payloads[r][nb + (i >> 3)] >> (i & 7)) & 1;
        sum += m ? -1 : (z ? 0 : 1);
    }
    return (float)((sum > 0) - (sum < 0));
}

static int vote_feedback_scalar(const uint8_t *const *payloads, int ranks, int64_t lo, int64_t n,
                                float *slot, uint8_t *out_neg, uint8_t *out_zero, float *dec) {
    const int64_t nb = (n + 7) / 8;
    int bad = 0;
    for (int64_t b = lo; b < n; b += 8) {   /* a byte of the planes at a time, in cache */
        int64_t end = b + 8 < n ? b + 8 : n;
        for (int64_t i = b; i < end; i++) slot[i] += vote_at(payloads, ranks, nb, i);
        bad |= sign_code_scalar(slot, b, end, out_neg, out_zero, slot, dec);
    }
    return bad;
}

#ifdef GD_X86
__attribute__((target("avx512f")))
static int vote_feedback_avx512(const uint8_t *const *payloads, int ranks, int64_t n,
                                float *slot, uint8_t *out_neg, uint8_t *out_zero, float *dec) {
    const int64_t nb = (n + 7) / 8;
    const __m512 z = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 minus = _mm512_set1_ps(-1.0f);
    const __m512i ione = _mm512_set1_epi32(1), izero = _mm512_setzero_si512();
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i sum = izero;    /* the ranks' -1/0/+1, summed exactly in int32 */
        for (int r = 0; r < ranks; r++) {
            uint16_t m, zr;
            memcpy(&m, payloads[r] + (i >> 3), 2);
            memcpy(&zr, payloads[r] + nb + (i >> 3), 2);
            sum = _mm512_mask_add_epi32(sum, (__mmask16)~(m | zr), sum, ione);
            sum = _mm512_mask_sub_epi32(sum, (__mmask16)m, sum, ione);
        }
        __m512 vote = _mm512_mask_blend_ps(
            _mm512_cmpgt_epi32_mask(sum, izero),
            _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(sum, izero), z, minus), one);
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(slot + i), vote);
        bad |= sign_code_block_avx512(v, i, out_neg, out_zero, slot, dec);
    }
    return (bad != 0) |
           vote_feedback_scalar(payloads, ranks, i, n, slot, out_neg, out_zero, dec);
}

/* The AVX2 path, a byte of every rank's planes (8 elements) at a time. Without it AVX2-only
 * CPUs ran the scalar loop, slower than this path and than the framework ops it replaced
 * (the 256-bit and scalar columns of docs/benchmarks.md's kernel table). */
__attribute__((target("avx2")))
static int vote_feedback_avx2(const uint8_t *const *payloads, int ranks, int64_t n,
                              float *slot, uint8_t *out_neg, uint8_t *out_zero, float *dec) {
    const int64_t nb = (n + 7) / 8;
    const __m256 z = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 minus = _mm256_set1_ps(-1.0f);
    const __m256i izero = _mm256_setzero_si256();
    __m256i bad = izero;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i sum = izero;    /* the ranks' -1/0/+1, summed exactly in int32 */
        for (int r = 0; r < ranks; r++) {
            uint8_t m = payloads[r][i >> 3], zr = payloads[r][nb + (i >> 3)];
            /* a lane of lanes_of is all ones (-1): subtracting it adds 1 */
            sum = _mm256_sub_epi32(sum, _mm256_castps_si256(lanes_of((uint8_t)~(m | zr))));
            sum = _mm256_add_epi32(sum, _mm256_castps_si256(lanes_of(m)));
        }
        __m256 vote = _mm256_blendv_ps(
            _mm256_blendv_ps(z, minus, _mm256_castsi256_ps(_mm256_cmpgt_epi32(izero, sum))), one,
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(sum, izero)));
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(slot + i), vote);
        bad = _mm256_or_si256(bad, sign_code_block_avx2(v, i, out_neg, out_zero, slot, dec));
    }
    return (!_mm256_testz_si256(bad, bad)) |
           vote_feedback_scalar(payloads, ranks, i, n, slot, out_neg, out_zero, dec);
}
#endif

/* The widest SIMD path the kernels may take (tests lower it to run every path on one CPU). */
static int gd_max_bits = 512;

void gd_limit_vector_bits(int bits) { gd_max_bits = bits; }

/* Which code path the kernels take on this CPU: 512, 256 (bits per vector) or 0 (scalar). */
int gd_vector_bits(void) {
#ifdef GD_X86
    if (gd_max_bits >= 512 && __builtin_cpu_supports("avx512f")) return 512;
    if (gd_max_bits >= 256 && __builtin_cpu_supports("avx2")) return 256;
#endif
    return 0;
}

/* The ascending int32 positions i < n (n < 2**31) of float32 x whose x[i] reaches t (see
 * `reaches`), written to out[0:cap]. Returns how many there are, which may exceed cap: then
 * only the first cap were written, and the caller calls again with room for all. */
int64_t gd_positions_f32(const float *x, int64_t n, float t, int mode, int32_t *out,
                         int64_t cap) {
    switch (gd_vector_bits()) {
#ifdef GD_X86
    case 512: return positions_avx512(x, n, t, mode, out, cap);
    case 256: return positions_avx2(x, n, t, mode, out, cap);
#endif
    default: return positions_scalar(x, 0, n, t, mode, out, 0, cap);
    }
}

/* The pure-sign code of float32 x[0:n] in one pass: the negative plane (x < 0) into
 * neg[0:ceil(n/8)], the zero plane (x == 0, either sign) into zero (skipped when NULL), and,
 * when not NULL, dec = sign(x) (+1, -1, or +0 for zeros and NaN) and err = x - dec. Returns 1
 * if x holds a NaN or an Inf, else 0. */
int gd_sign_code_f32(const float *x, int64_t n, uint8_t *neg, uint8_t *zero, float *err,
                     float *dec) {
    switch (gd_vector_bits()) {
#ifdef GD_X86
    case 512: return sign_code_avx512(x, n, neg, zero, err, dec);
    case 256: return sign_code_avx2(x, n, neg, zero, err, dec);
#endif
    default: return sign_code_scalar(x, 0, n, neg, zero, err, dec);
    }
}

/* out[i] = +1 where bit i of pos is set, -1 where bit i of neg is, 0 where neither or both
 * (signbits.ternary's table), for i < n. */
void gd_ternary_f32(const uint8_t *pos, const uint8_t *neg, int64_t n, float *out) {
    switch (gd_vector_bits()) {
#ifdef GD_X86
    case 512: ternary_avx512(pos, neg, n, out); return;
    case 256: ternary_avx2(pos, neg, n, out); return;
#endif
    default: ternary_scalar(pos, neg, 0, n, out);
    }
}

/* qsgd's levels of rows x rows of b float32 (qsgd.py ``levels``): code = min(hi, low byte of
 * trunc(x * scale[r] + k * 2**-kbits + (s + 2**-(kbits+1)))), k the uint8 (kbits 8) or uint16
 * (16) dither; and, when not NULL, dec = (code - s) * step[r] and err = x - dec (err may be
 * x itself). */
void gd_qsgd_levels_f32(const float *x, int64_t rows, int64_t b, const float *scale,
                        const float *step, const void *k, int kbits, float s, int hi,
                        uint8_t *codes, float *err, float *dec) {
#ifdef GD_X86
    if (gd_vector_bits() >= 512) {
        levels_avx512(x, rows, b, scale, step, k, kbits, s, hi, codes, err, dec);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        levels_span(x, r * b, (r + 1) * b, scale[r], step[r], k, kbits, s, hi, codes, err, dec);
}

/* qsgd's decoded values: out = (code - s) * step[r], plus what out holds when accumulate. */
void gd_qsgd_values_f32(const uint8_t *codes, int64_t rows, int64_t b, const float *step,
                        float s, float *out, int accumulate) {
#ifdef GD_X86
    if (gd_vector_bits() >= 512) {
        values_avx512(codes, rows, b, step, s, out, accumulate);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        values_span(codes, r * b, (r + 1) * b, step[r], s, out, accumulate);
}

/* ---------------------------------------------------------------- exact top-k
 * The sparsifiers' exact top-k (grace_dl/compressors/sparse.py `top_of` of `magnitudes`) in
 * passes around a selection (gd_kth_largest_f32 below): the magnitudes of float32
 * x[0:n] (mode 0: |x|; 1: x where x > 0; -1: -x where x < 0; -1 for NaN and the other sign),
 * then, given the k-th largest of them, the positions above it and the first tied ones, all
 * ascending. */
void gd_top_magnitudes_f32(const float *x, int64_t n, int mode, float *mag) {
    if (mode == 0)
        for (int64_t i = 0; i < n; i++) mag[i] = x[i] == x[i] ? fabsf(x[i]) : -1.0f;
    else if (mode > 0)
        for (int64_t i = 0; i < n; i++) mag[i] = x[i] > 0 ? x[i] : -1.0f;
    else
        for (int64_t i = 0; i < n; i++) mag[i] = x[i] < 0 ? -x[i] : -1.0f;
}

/* An unsigned key of a float's bits in the float's order (-0.0 just below +0.0; NaN outside
 * the order, which callers exclude), and back. */
static inline uint32_t order_key(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

static inline float from_order_key(uint32_t key) {
    uint32_t u = (key & 0x80000000u) ? key & 0x7fffffffu : ~key;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* The k-th largest of x[0:n] (1 <= k <= n, no NaN): a radix select over the order keys, 11, 11
 * and 10 bits at a time (the bin holding the k-th, counted from the top), where NumPy's
 * partition moved the array about. After the first pass the keys that share the chosen top
 * bits are copied into keep (room for n), branch-free, and the later passes read only those.
 * The value NumPy finds (of -0.0 and +0.0 tied at the k-th it may return either; here +0.0
 * ranks higher). */
float gd_kth_largest_f32(const float *x, int64_t n, int64_t k, uint32_t *keep) {
    int64_t hist[2048], need = k, m = 0;
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++) hist[order_key(x[i]) >> 21]++;
    int b = 2047;
    while (hist[b] < need) need -= hist[b--];
    const uint32_t top = (uint32_t)b;
    for (int64_t i = 0; i < n; i++) {
        uint32_t key = order_key(x[i]);
        keep[m] = key;
        m += (key >> 21) == top;
    }
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < m; i++) hist[(keep[i] >> 10) & 2047]++;
    b = 2047;
    while (hist[b] < need) need -= hist[b--];
    const uint32_t high = top << 11 | (uint32_t)b;      /* the key's top 22 bits */
    memset(hist, 0, 1024 * sizeof *hist);
    for (int64_t i = 0; i < m; i++)
        if ((keep[i] >> 10) == high) hist[keep[i] & 1023]++;
    b = 1023;
    while (hist[b] < need) need -= hist[b--];
    return from_order_key(high << 10 | (uint32_t)b);
}

/* The k positions (0 < k <= n, kth the k-th largest of mag) ascending into out[0:k]: a count
 * of those above the k-th, then one branch-free pass (each position is written, and kept by
 * advancing the count: which entries lie above is data, not a pattern a branch predictor
 * learns) that stops at the k-th kept. */
void gd_top_collect_f32(const float *mag, int64_t n, int64_t k, float kth, int64_t *out) {
    int64_t above = 0;
    for (int64_t i = 0; i < n; i++) above += mag[i] > kth;
    int64_t need = k - above, tied = 0, kept = 0;
    for (int64_t i = 0; i < n && kept < k; i++) {
        float v = mag[i];
        int tie = v == kth;
        out[kept] = i;
        kept += (v > kth) | (tie & (tied < need));
        tied += tie;
    }
}

/* ---------------------------------------------------------------- sparse sums
 * out[0:n] = the sum of `ranks` sparse vectors (grace_dl/compressors/sparse.py `scatter_sum`):
 * rank r's vals[r][0:count[r]] at its positions idx[r] (int32, or int64 when wide), each
 * rank's strictly ascending and inside [0, n). Written block by block: a block is zeroed and
 * then every rank's values that fall in it are added while it is in cache, one pass over out
 * where zeroing it and then scattering into it missed the cache once per value. Values at one
 * position are added in rank order onto +0.0, the operations of index_add_ over the ranks'
 * payloads joined. Returns 0, or 1 with nothing written where a rank's positions are not
 * ascending or leave [0, n) (the caller then runs the framework's scatter, which reports
 * a bad position). */
#define GD_SPARSE_BLOCK 8192
#define GD_SPARSE_RANKS 256

static inline int64_t position_at(const void *idx, int wide, int64_t j) {
    return wide ? ((const int64_t *)idx)[j] : (int64_t)((const int32_t *)idx)[j];
}

int gd_sparse_sum_f32(float *out, int64_t n, int ranks, const void *const *idx,
                      const float *const *vals, const int64_t *count, int wide) {
    int64_t at[GD_SPARSE_RANKS];
    if (ranks < 1 || ranks > GD_SPARSE_RANKS) return 1;
    for (int r = 0; r < ranks; r++) {
        int64_t prev = -1;
        for (int64_t j = 0; j < count[r]; j++) {
            int64_t p = position_at(idx[r], wide, j);
            if (p <= prev || p >= n) return 1;
            prev = p;
        }
        at[r] = 0;
    }
    for (int64_t b = 0; b < n; b += GD_SPARSE_BLOCK) {
        int64_t e = n - b < GD_SPARSE_BLOCK ? n : b + GD_SPARSE_BLOCK;
        memset(out + b, 0, (size_t)(e - b) * sizeof(float));
        for (int r = 0; r < ranks; r++) {
            const float *v = vals[r];
            int64_t j = at[r], c = count[r];
            for (int64_t p; j < c && (p = position_at(idx[r], wide, j)) < e; j++) out[p] += v[j];
            at[r] = j;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- random bits
 * `words` outputs of Chris Doty-Humphrey's SFC64 from the state s = (a, b, c, counter), the
 * recurrence of NumPy's SFC64 bit generator: the same words as its random_raw(words) from
 * that state (grace_dl/seeding.py draws every dither this way). s is not advanced. */
void gd_sfc64_raw(const uint64_t *state, int64_t words, uint64_t *out) {
    uint64_t a = state[0], b = state[1], c = state[2], w = state[3];
    for (int64_t i = 0; i < words; i++) {
        uint64_t tmp = a + b + w++;
        a = b ^ (b >> 11);
        b = c + (c << 3);
        c = ((c << 24) | (c >> 40)) + tmp;
        out[i] = tmp;
    }
}

/* NumPy's SeedSequence(entropy) (pool of 4 uint32 words, hashmix/mix of
 * numpy/random/bit_generator.pyx) -> generate_state(3, uint64) -> SFC64's seeding (counter 1,
 * 12 rounds discarded): the state SFC64(SeedSequence(entropy)) starts from, without building
 * NumPy's objects (~10 us a key hot, several times that once a gradient pass has evicted
 * them from the caches). */
static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= 0x931e8875u;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t r = 0xca01f9ddu * x - 0x4973f715u * y;
    return r ^ (r >> 16);
}

void gd_sfc64_seed(const uint32_t *entropy, int count, uint64_t *state) {
    uint32_t pool[4], hash_const = 0x43b0d7e5u;
    for (int i = 0; i < 4; i++)
        pool[i] = hashmix(i < count ? entropy[i] : 0, &hash_const);
    for (int src = 0; src < 4; src++)
        for (int dst = 0; dst < 4; dst++)
            if (src != dst)
                pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
    for (int src = 4; src < count; src++)
        for (int dst = 0; dst < 4; dst++)
            pool[dst] = mix(pool[dst], hashmix(entropy[src], &hash_const));
    uint32_t words[6], out_const = 0x8b51f9ddu;
    for (int i = 0; i < 6; i++) {
        uint32_t v = pool[i % 4] ^ out_const;
        out_const *= 0x58f38dedu;
        v *= out_const;
        words[i] = v ^ (v >> 16);
    }
    uint64_t a = words[0] | (uint64_t)words[1] << 32, b = words[2] | (uint64_t)words[3] << 32,
             c = words[4] | (uint64_t)words[5] << 32, w = 1;
    for (int i = 0; i < 12; i++) {
        uint64_t tmp = a + b + w++;
        a = b ^ (b >> 11);
        b = c + (c << 3);
        c = ((c << 24) | (c >> 40)) + tmp;
    }
    state[0] = a;
    state[1] = b;
    state[2] = c;
    state[3] = w;
}

/* The first j distinct positions of the stream (w * n) >> 64 over the SFC64 words w that
 * continue `state` (see gd_sfc64_raw), marked in `bitmap` (ceil(n / 64) words, zero on entry);
 * then written ascending into out (room for 2 more than it returns): the marked positions, or
 * with `complement` the n - j unmarked ones. n < 2**63, j <= n. Returns how many positions
 * were written. */
int64_t gd_choice_sorted(const uint64_t *state, int64_t n, int64_t j, int complement,
                         uint64_t *bitmap, int64_t *out) {
    uint64_t a = state[0], b = state[1], c = state[2], w = state[3];
    for (int64_t found = 0; found < j;) {
        uint64_t tmp = a + b + w++;
        a = b ^ (b >> 11);
        b = c + (c << 3);
        c = ((c << 24) | (c >> 40)) + tmp;
        uint64_t pos = (uint64_t)(((unsigned __int128)tmp * (uint64_t)n) >> 64);
        uint64_t bit = (uint64_t)1 << (pos & 63);
        if (!(bitmap[pos >> 6] & bit)) {
            bitmap[pos >> 6] |= bit;
            found++;
        }
    }
    /* the set bits in order; at a sparsifier's density most words hold 0, 1 or 2 of them, so
     * the first two are written without a branch (out has room for 2 more than it returns) */
    int64_t words = (n + 63) >> 6, o = 0;
    for (int64_t i = 0; i < words; i++) {
        uint64_t bits = complement ? ~bitmap[i] : bitmap[i];
        if (i == words - 1 && (n & 63))
            bits &= ((uint64_t)1 << (n & 63)) - 1;
        int64_t base = i << 6;
        out[o] = base + __builtin_ctzll(bits | ((uint64_t)1 << 63));
        o += bits != 0;
        bits &= bits - 1;
        out[o] = base + __builtin_ctzll(bits | ((uint64_t)1 << 63));
        o += bits != 0;
        bits &= bits - 1;
        while (bits) {
            out[o++] = base + __builtin_ctzll(bits);
            bits &= bits - 1;
        }
    }
    return o;
}

/* signsgd's two-phase server step in one pass (see vote_feedback_scalar): payloads[r] is rank
 * r's signsgd payload for this chunk of n elements; slot <- error of slot + vote, dec <- its
 * sign, the sign code's planes into out_neg and out_zero (ceil(n/8) bytes each); returns 1 if
 * slot + vote holds a NaN or an Inf. */
int gd_sign_vote_feedback_f32(const uint8_t *const *payloads, int ranks, int64_t n, float *slot,
                              uint8_t *out_neg, uint8_t *out_zero, float *dec) {
    switch (gd_vector_bits()) {
#ifdef GD_X86
    case 512: return vote_feedback_avx512(payloads, ranks, n, slot, out_neg, out_zero, dec);
    case 256: return vote_feedback_avx2(payloads, ranks, n, slot, out_neg, out_zero, dec);
#endif
    default: return vote_feedback_scalar(payloads, ranks, 0, n, slot, out_neg, out_zero, dec);
    }
}
