// Plain (torch-free) storage types and scalar conversions for bfloat16 / float16.
//
// The conversions are bit-exact with c10::BFloat16 / c10::Half (round to nearest even, NaN kept) and
// are written as branch-free integer/float code so that loops over them auto-vectorize.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dcp {

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float to_f32(bf16_t x) { return bits_to_f32(static_cast<uint32_t>(x.bits) << 16); }

inline bf16_t bf16_from_f32(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16_t{static_cast<uint16_t>(rounded >> 16)};
}

// IEEE half -> float (algorithm of the FP16 library, as used by c10::Half).
inline float to_f32(fp16_t x) {
  const uint32_t w = static_cast<uint32_t>(x.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = bits_to_f32((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_to_f32((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_to_bits(denormalized) : f32_to_bits(normalized));
  return bits_to_f32(result);
}

// float -> IEEE half, round to nearest even (FP16 library algorithm).
inline fp16_t fp16_from_f32(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return fp16_t{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

// Load a stored element as compute type T (float or double).
template <typename T>
inline T load_as(double x) { return static_cast<T>(x); }
template <typename T>
inline T load_as(float x) { return static_cast<T>(x); }
template <typename T>
inline T load_as(bf16_t x) { return static_cast<T>(to_f32(x)); }
template <typename T>
inline T load_as(fp16_t x) { return static_cast<T>(to_f32(x)); }

// Store a compute value as storage type S.
template <typename S>
struct StoreAs;
template <>
struct StoreAs<double> {
  template <typename T>
  static double cvt(T x) { return static_cast<double>(x); }
};
template <>
struct StoreAs<float> {
  template <typename T>
  static float cvt(T x) { return static_cast<float>(x); }
};
template <>
struct StoreAs<bf16_t> {
  template <typename T>
  static bf16_t cvt(T x) { return bf16_from_f32(static_cast<float>(x)); }
};
template <>
struct StoreAs<fp16_t> {
  template <typename T>
  static fp16_t cvt(T x) { return fp16_from_f32(static_cast<float>(x)); }
};

}  // namespace dcp
