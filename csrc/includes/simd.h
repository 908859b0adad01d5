// SIMD registers of float32 lanes behind one small interface, so each kernel is written once.
//
// The builder (op_builder/cpu_adam.py) defines one of __AVX512__, __AVX256__, __NEON__ or __SCALAR__ from the
// CPU's features; every narrower path is compiled too, so a test can run each width on one machine. All paths
// evaluate the same operations in the same order (an explicit fused multiply-add wherever one is used, built with
// -ffp-contract=off so the compiler adds none), so every width gives the same bits, tails included.
//
// Half-precision values travel as uint16_t bit patterns. float -> bf16 and float -> fp16 round to nearest even,
// as torch's casts do; a NaN becomes a quiet NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512__) && !defined(__AVX256__)
#define __AVX256__
#endif

#if defined(__AVX512__) || defined(__AVX256__)
#include <immintrin.h>
#endif
#if defined(__NEON__)
#include <arm_neon.h>
#endif

namespace ds {

enum class Dtype : int { f32 = 0, bf16 = 1, f16 = 2 };

inline uint32_t float_bits(float value)
{
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
}

inline float bits_float(uint32_t bits)
{
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float value)
{
    if (std::isnan(value)) return 0x7fc0;
    uint32_t bits = float_bits(value);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

// IEEE binary16 <-> binary32 in integer arithmetic (used by the scalar path and for tails everywhere).
inline float f16_to_float(uint16_t h)
{
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    if (mantissa == 0) return bits_float(sign);
    // Subnormal half: normalise into a float.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
    }
    mantissa &= 0x3ffu;
    return bits_float(sign | uint32_t(113 - shift) << 23 | (mantissa << 13));
}

inline uint16_t float_to_f16(float value)
{
    const uint32_t bits = float_bits(value);
    const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;      // NaN
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;     // rounds to >= 65520: infinity
    if (magnitude < 0x38800000u) {                           // below the smallest normal half
        if (magnitude < 0x33000000u) return sign;            // below half of the smallest subnormal
        const uint32_t exponent = magnitude >> 23;
        const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exponent;              // 14..24
        uint32_t half = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
        return sign | uint16_t(half);
    }
    uint32_t half = ((magnitude >> 13) - (112u << 10));
    const uint32_t rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
    return sign | uint16_t(half);
}

inline float load_one(Dtype dtype, const void* src, int64_t i)
{
    switch (dtype) {
        case Dtype::bf16: return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
        case Dtype::f16: return f16_to_float(static_cast<const uint16_t*>(src)[i]);
        default: return static_cast<const float*>(src)[i];
    }
}

inline void store_one(Dtype dtype, void* dst, int64_t i, float value)
{
    switch (dtype) {
        case Dtype::bf16: static_cast<uint16_t*>(dst)[i] = float_to_bf16(value); break;
        case Dtype::f16: static_cast<uint16_t*>(dst)[i] = float_to_f16(value); break;
        default: static_cast<float*>(dst)[i] = value;
    }
}

// One lane: the reference every wider path must agree with bit for bit.
struct Scalar {
    using reg = float;
    static constexpr int width = 1;
    static reg load(const float* p) { return *p; }
    static void store(float* p, reg v) { *p = v; }
    static reg set1(float v) { return v; }
    static reg add(reg a, reg b) { return a + b; }
    static reg sub(reg a, reg b) { return a - b; }
    static reg mul(reg a, reg b) { return a * b; }
    static reg div(reg a, reg b) { return a / b; }
    static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }  // a * b + c, one rounding
    static reg sqrt(reg a) { return std::sqrt(a); }
    // x86's maxps rule: the first operand only when it is greater (so b on ties and NaNs); every path follows it.
    static reg max(reg a, reg b) { return a > b ? a : b; }
    static reg load_as_float(Dtype dtype, const void* src, int64_t i) { return load_one(dtype, src, i); }
    static void store_from_float(Dtype dtype, void* dst, int64_t i, reg v) { store_one(dtype, dst, i, v); }
};

#if defined(__AVX256__)
struct Avx2 {
    using reg = __m256;
    static constexpr int width = 8;
    static reg load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
    static reg set1(float v) { return _mm256_set1_ps(v); }
    static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
    static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
    static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
    static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
    static reg load_as_float(Dtype dtype, const void* src, int64_t i)
    {
        if (dtype == Dtype::f32) return load(static_cast<const float*>(src) + i);
        const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
        if (dtype == Dtype::f16) return _mm256_cvtph_ps(halves);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    }
    static void store_from_float(Dtype dtype, void* dst, int64_t i, reg v)
    {
        if (dtype == Dtype::f32) return store(static_cast<float*>(dst) + i, v);
        __m128i* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i);
        if (dtype == Dtype::f16) return _mm_storeu_si128(out, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        rounded = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), is_nan));
        const __m256i shifted = _mm256_srli_epi32(rounded, 16);
        // Pack 8 x 32-bit (values < 2^16) to 8 x 16-bit, in order.
        const __m128i low = _mm256_castsi256_si128(shifted);
        const __m128i high = _mm256_extracti128_si256(shifted, 1);
        _mm_storeu_si128(out, _mm_packus_epi32(low, high));
    }
};
#endif

#if defined(__AVX512__)
struct Avx512 {
    using reg = __m512;
    static constexpr int width = 16;
    static reg load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
    static reg set1(float v) { return _mm512_set1_ps(v); }
    static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
    static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
    static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
    static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
    static reg load_as_float(Dtype dtype, const void* src, int64_t i)
    {
        if (dtype == Dtype::f32) return load(static_cast<const float*>(src) + i);
        const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
        if (dtype == Dtype::f16) return _mm512_cvtph_ps(halves);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    }
    static void store_from_float(Dtype dtype, void* dst, int64_t i, reg v)
    {
        if (dtype == Dtype::f32) return store(static_cast<float*>(dst) + i, v);
        __m256i* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i);
        if (dtype == Dtype::f16) return _mm256_storeu_si256(out, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc00000));
        _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
};
#endif

#if defined(__NEON__)
struct Neon {
    using reg = float32x4_t;
    static constexpr int width = 4;
    static reg load(const float* p) { return vld1q_f32(p); }
    static void store(float* p, reg v) { vst1q_f32(p, v); }
    static reg set1(float v) { return vdupq_n_f32(v); }
    static reg add(reg a, reg b) { return vaddq_f32(a, b); }
    static reg sub(reg a, reg b) { return vsubq_f32(a, b); }
    static reg mul(reg a, reg b) { return vmulq_f32(a, b); }
    static reg div(reg a, reg b) { return vdivq_f32(a, b); }
    static reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
    static reg sqrt(reg a) { return vsqrtq_f32(a); }
    // Scalar::max's rule; vmaxq_f32 propagates NaNs and orders signed zeros differently.
    static reg max(reg a, reg b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
    static reg load_as_float(Dtype dtype, const void* src, int64_t i)
    {
        if (dtype == Dtype::f32) return load(static_cast<const float*>(src) + i);
        const uint16x4_t halves = vld1_u16(static_cast<const uint16_t*>(src) + i);
        if (dtype == Dtype::f16) return vcvt_f32_f16(vreinterpret_f16_u16(halves));
        return vreinterpretq_f32_u32(vshll_n_u16(halves, 16));
    }
    static void store_from_float(Dtype dtype, void* dst, int64_t i, reg v)
    {
        if (dtype == Dtype::f32) return store(static_cast<float*>(dst) + i, v);
        uint16_t* out = static_cast<uint16_t*>(dst) + i;
        if (dtype == Dtype::f16) return vst1_u16(out, vreinterpret_u16_f16(vcvt_f16_f32(v)));
        uint32x4_t bits = vreinterpretq_u32_f32(v);
        const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
        bits = vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
        bits = vbslq_u32(vceqq_f32(v, v), bits, vdupq_n_u32(0x7fc00000));
        vst1_u16(out, vshrn_n_u32(bits, 16));
    }
};
#endif

}  // namespace ds
