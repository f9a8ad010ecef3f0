// FP8 (e4m3fn) quantization per group of 128 channels, bit for bit as kernels/quant.py:
//
//   amax  = max(max |v| over the group, 1e-4)   (NaN if the group holds one)
//   scale = amax / 448                       (IEEE division; with UE8M0: the next power of two)
//   code  = e4m3fn(v / scale)                (IEEE division, round to nearest even, saturating)
//
// The e4m3 byte is built from the fp32 bits, as kernels/quant.py e4m3_bits does, and every
// floating-point operation is an explicit round-to-nearest intrinsic so that no contraction or
// fast-math flag can change a bit.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace moe_comm {

constexpr int kGroup = 128;  // channels per scale; one warp covers one group, 4 channels a lane
constexpr float kE4M3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

// fp32 -> e4m3fn byte: round to nearest even, saturate at +-448; NaN -> 0x7F with its sign.
__device__ __forceinline__ uint32_t e4m3_bits(float v) {
  const uint32_t sign = __float_as_uint(v) >> 31;
  const float a = fminf(fabsf(v), kE4M3Max);
  const uint32_t abits = __float_as_uint(a);
  const uint32_t r = abits + 0x7FFFFu + ((abits >> 20) & 1u);  // keep 3 mantissa bits, RNE
  const uint32_t normal = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);  // bias 7 = 127 - 120
  // subnormals: multiples of 2**-9, rounded to nearest even by the 2**23 trick
  const uint32_t sub = static_cast<uint32_t>(
      __fsub_rn(__fadd_rn(__fmul_rn(a, 512.0f), 8388608.0f), 8388608.0f));
  uint32_t code = a >= 0.015625f ? normal : sub;
  if ((__float_as_uint(v) & 0x7FFFFFFFu) > 0x7F800000u) code = 0x7Fu;  // fminf dropped the NaN
  return (code & 0xFFu) | (sign << 7);
}

// Smallest power of two >= s (positive), and its biased exponent byte; NaN and infinity give
// exponent 255 (E8M0's NaN) and an infinite scale.
__device__ __forceinline__ float ue8m0_scale(float s, uint32_t* exponent) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t e = min((bits >> 23) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u), 255u);
  *exponent = e & 0xFFu;
  return __uint_as_float(e << 23);
}

// fmaxf drops a NaN operand; torch's amax (the reference) keeps it.
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7FC00000) : fmaxf(a, b);
}

struct QuantGroup {
  uint32_t codes;     // this lane's 4 e4m3 bytes, channel order, little-endian
  float scale;        // the group's scale (every lane)
  uint32_t exponent;  // its biased exponent (UE8M0)
};

// Warp-collective: quantizes one group of 128 channels, `v` = this lane's 4 consecutive values.
__device__ __forceinline__ QuantGroup quantize_group(const float v[4], bool ue8m0) {
  float amax = max_keep_nan(max_keep_nan(fabsf(v[0]), fabsf(v[1])),
                            max_keep_nan(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    amax = max_keep_nan(amax, __shfl_xor_sync(kFullMask, amax, o));
  }
  amax = max_keep_nan(amax, kAmaxFloor);  // a NaN in the group makes the scale NaN, as torch
  QuantGroup q;
  q.scale = __fdiv_rn(amax, kE4M3Max);
  q.exponent = 0;
  if (ue8m0) q.scale = ue8m0_scale(q.scale, &q.exponent);
  q.codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.codes |= e4m3_bits(__fdiv_rn(v[i], q.scale)) << (8 * i);
  return q;
}

// This lane's 4 consecutive channels h..h+3 of a row of `dtype`, as fp32 (exact for 16-bit types).
__device__ __forceinline__ void load4_as_float(const char* row, int32_t dtype, int h,
                                               float v[4]) {
  if (dtype == kF32) {
    const float4 f = *reinterpret_cast<const float4*>(row + static_cast<int64_t>(h) * 4);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    return;
  }
  const uint2 raw = *reinterpret_cast<const uint2*>(row + static_cast<int64_t>(h) * 2);
  const uint16_t bits[4] = {static_cast<uint16_t>(raw.x), static_cast<uint16_t>(raw.x >> 16),
                            static_cast<uint16_t>(raw.y), static_cast<uint16_t>(raw.y >> 16)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = dtype == kBF16 ? bf16_bits_to_float(bits[i])
                          : __half2float(__ushort_as_half(bits[i]));
  }
}

// Stores a quantized group into a slot laid out as [H code bytes][scales]: fp32 scales at byte
// H + 4 g, or exponent bytes at H + g (UE8M0). `h` is this lane's first channel.
__device__ __forceinline__ void store_group(char* slot, int H, int g, int h, const QuantGroup& q,
                                            bool ue8m0, int lane) {
  *reinterpret_cast<uint32_t*>(slot + h) = q.codes;
  if (lane == 0) {
    if (ue8m0) {
      reinterpret_cast<uint8_t*>(slot + H)[g] = static_cast<uint8_t>(q.exponent);
    } else {
      reinterpret_cast<float*>(slot + H)[g] = q.scale;
    }
  }
}

}  // namespace moe_comm
