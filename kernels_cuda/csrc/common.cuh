// Shared device helpers of the cuda_sm70 kernels.
//
// Feature set: SM70 (Volta) only. No cp.async, ldmatrix, bf16 arithmetic, TMA, wgmma, redux, mbarrier,
// no mma shape beyond WMMA m16n16k16; shared memory <= 96 KB per block (<= 48 KB static). Tensor-core work
// goes through nvcuda::wmma m16n16k16 with fp16 operands and fp32 accumulators.
//
// Warp width: NVIDIA warps are 32 lanes and WMMA is defined for them. Every place that relies on 32 lanes
// (shuffle masks, lane -> column maps, per-warp tile ownership) says so with "32 lanes" in a comment.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"

namespace q35 {

// 32 lanes: the shuffle reductions and the lane -> column maps below assume a 32-lane warp.
constexpr int kWarp = 32;
constexpr int kMaxSmem = 96 * 1024;  // Volta's opt-in shared memory per block: the budget of every kernel

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// A read-only float tensor whose dtype (fp16 or fp32) is a runtime flag: weights, biases, gates that may come
// in either dtype whatever the activations' dtype.
struct FPtr {
  const void* p;
  int is_half;
  __device__ __forceinline__ float operator[](int64_t i) const {
    return is_half ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  __device__ __forceinline__ bool null() const { return p == nullptr; }
};

// An index tensor (offsets, slots) of int32 or int64.
struct IPtr {
  const void* p;
  int is64;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
  }
};

// 32 lanes: butterfly over the full warp.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplus(float x) {
  return x > 20.0f ? x : fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Gating of one (token row, value head): g (log-decay <= 0) and beta, from (g, beta) or the raw projections.
struct Gating {
  const float* g;  // [rows, stride] fp32, or null with raw gating
  FPtr beta, a, b, A_log, dt_bias;
  int64_t stride;  // elements between token rows of g / beta / a / b
  int raw;
  __device__ __forceinline__ void at(int64_t row, int hv, float& g_out, float& beta_out) const {
    if (raw) {
      float x = a[row * stride + hv] + dt_bias[hv];
      g_out = -expf(A_log[hv]) * softplus(x);
      beta_out = sigmoid(b[row * stride + hv]);
    } else {
      g_out = g[row * stride + hv];
      beta_out = beta[row * stride + hv];
    }
  }
};

inline Gating make_gating(const GatingArgs& a) {
  return Gating{a.g, FPtr{a.beta, a.beta_half}, FPtr{a.a, a.ab_half}, FPtr{a.b, a.ab_half},
                FPtr{a.A_log, a.alog_half}, FPtr{a.dt_bias, a.dtb_half}, a.stride, a.raw};
}

// Raise `kernel`'s dynamic shared-memory limit to `bytes` on the current device (needed above 48 KB), once per
// device: the attribute is per device, so a process that serves several GPUs sets it on each. `done` is the
// kernel's own bit set of devices already raised (a benign race: two threads may both set it).
template <typename Kern>
inline cudaError_t smem_limit(Kern kernel, int bytes, unsigned long long& done) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = dev < 64 ? 1ull << dev : 0ull;
  if (bit != 0 && (done & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done |= bit;
  return err;
}

inline int cdiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace q35
