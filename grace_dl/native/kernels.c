/* grace_dl's compiled kernels: single passes over a gradient where NumPy/torch need several.
 *
 * Plain C with no Python API (loaded through ctypes by grace_dl/native/__init__.py), so it
 * builds without Python's headers and any framework can call it on a raw buffer. Each kernel
 * has a portable scalar loop and, on x86-64, wider versions picked at run time from the CPU's
 * features (GCC/Clang target attributes), so one build runs on any x86-64 host.
 */
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
    /* branch-free: every block stores its hits' positions with one compress-store */
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
        _mm512_mask_compressstoreu_epi32(out + c, m, idx);
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
