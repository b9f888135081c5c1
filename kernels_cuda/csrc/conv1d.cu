// Depthwise causal conv1d over D channels, window W <= 8, optional bias and SiLU: varlen prefill with per-slot
// history, and the one-token decode update. fp32 arithmetic.
//
// Prefill is two launches. conv_prefill_kernel: a thread per (channel, run of kRun tokens), channels across the
// threads of a block (coalesced), each output from the W inputs before it; a tap before its sequence's start
// reads the slot's history (has_initial_state and a slot >= 0) or zero. conv_history_kernel, after it: a
// thread per (sequence, channel) writes the slot's new history, the last W - 1 inputs of [old history,
// sequence]; it reads everything it needs before writing, and no other thread touches that (slot, channel), so
// the in-place update is race-free.
#include "common.cuh"
#include "launchers.h"

namespace q35 {
namespace {

constexpr int kMaxW = 8;
constexpr int kRun = 16;        // tokens per prefill thread
constexpr int kChannels = 128;  // channels per block

struct Seqs {
  IPtr cu;   // [N + 1] offsets, or cu.p null: one sequence of T tokens
  int N;
  int64_t T;
  __device__ __forceinline__ int64_t start(int n) const { return cu.p ? cu[n] : 0; }
  __device__ __forceinline__ int64_t end(int n) const { return cu.p ? cu[n + 1] : T; }
  // The sequence holding token t: the largest n with start(n) <= t < end(n) (empty sequences skipped).
  __device__ __forceinline__ int find(int64_t t) const {
    if (!cu.p) return 0;
    int lo = 0, hi = N - 1;
    while (lo < hi) {  // first n with end(n) > t
      const int mid = (lo + hi) >> 1;
      if (cu[mid + 1] > t) hi = mid; else lo = mid + 1;
    }
    return lo;
  }
};

template <typename T>
__global__ void __launch_bounds__(kChannels)
conv_prefill_kernel(const T* __restrict__ x, FPtr w, FPtr bias, T* __restrict__ y, Seqs seqs,
                    const T* __restrict__ pool, int64_t pool_stride, IPtr slots, const bool* __restrict__ has_init,
                    int D, int W, int silu_on) {
  const int d = blockIdx.y * kChannels + threadIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRun;
  if (d >= D || t0 >= seqs.T) return;
  const int64_t t1 = t0 + kRun < seqs.T ? t0 + kRun : seqs.T;
  float wt[kMaxW];
#pragma unroll
  for (int j = 0; j < kMaxW; ++j) wt[j] = j < W ? w[static_cast<int64_t>(d) * W + j] : 0.0f;
  const float b0 = bias.null() ? 0.0f : bias[d];
  int n = seqs.find(t0);
  int64_t s = seqs.start(n), e = seqs.end(n);
  const T* hist = nullptr;
  auto history = [&](int seq) -> const T* {
    if (pool == nullptr) return nullptr;
    const int64_t slot = slots[seq];
    if (slot < 0 || (has_init != nullptr && !has_init[seq])) return nullptr;
    return pool + slot * pool_stride + static_cast<int64_t>(d) * (W - 1);
  };
  hist = history(n);
  for (int64_t t = t0; t < t1; ++t) {
    while (t >= e) {  // next non-empty sequence
      ++n;
      s = seqs.start(n);
      e = seqs.end(n);
      hist = history(n);
    }
    float acc = b0;
#pragma unroll
    for (int j = 0; j < kMaxW; ++j) {
      if (j < W) {
        const int64_t p = t - (W - 1) + j;
        float xv = 0.0f;
        if (p >= s) xv = to_f(x[p * D + d]);
        else if (hist != nullptr) xv = to_f(hist[p - s + W - 1]);  // history column: oldest first
        acc += wt[j] * xv;
      }
    }
    if (silu_on) acc = silu(acc);
    y[t * D + d] = from_f<T>(acc);
  }
}

template <typename T>
__global__ void conv_history_kernel(const T* __restrict__ x, T* __restrict__ pool, int64_t pool_stride, Seqs seqs,
                                    IPtr slots, const bool* __restrict__ has_init, int D, int W) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(seqs.N) * D) return;
  const int n = static_cast<int>(idx / D), d = static_cast<int>(idx % D);
  const int64_t slot = slots[n];
  if (slot < 0) return;
  T* hist = pool + slot * pool_stride + static_cast<int64_t>(d) * (W - 1);
  const bool use_old = has_init == nullptr || has_init[n];
  const int64_t s = seqs.start(n), e = seqs.end(n);
  T col[kMaxW];
#pragma unroll
  for (int c = 0; c < kMaxW - 1; ++c) {
    if (c < W - 1) {
      const int64_t p = e - (W - 1) + c;
      if (p >= s) col[c] = x[p * D + d];
      else col[c] = use_old ? hist[p - s + W - 1] : from_f<T>(0.0f);
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxW - 1; ++c)
    if (c < W - 1) hist[c] = col[c];
}

template <typename T>
__global__ void conv_update_kernel(const T* __restrict__ x, FPtr w, FPtr bias, T* __restrict__ y,
                                   T* __restrict__ pool, int64_t pool_stride, IPtr slots, int B, int D, int W,
                                   int silu_on) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(B) * D) return;
  const int r = static_cast<int>(idx / D), d = static_cast<int>(idx % D);
  const int64_t slot = slots[r];
  if (slot < 0) {  // padding row: zero output, pool untouched
    y[idx] = from_f<T>(0.0f);
    return;
  }
  T* hist = pool + slot * pool_stride + static_cast<int64_t>(d) * (W - 1);
  T win[kMaxW];
#pragma unroll
  for (int j = 0; j < kMaxW; ++j)
    if (j < W) win[j] = j < W - 1 ? hist[j] : x[idx];
  float acc = bias.null() ? 0.0f : bias[d];
#pragma unroll
  for (int j = 0; j < kMaxW; ++j)
    if (j < W) acc += w[static_cast<int64_t>(d) * W + j] * to_f(win[j]);
  if (silu_on) acc = silu(acc);
  y[idx] = from_f<T>(acc);
#pragma unroll
  for (int j = 0; j < kMaxW - 1; ++j)
    if (j < W - 1) hist[j] = win[j + 1];
}

}  // namespace

cudaError_t conv_prefill(int dtype, const void* x, const void* w, int w_half, const void* bias, int bias_half,
                         void* y, const void* cu, int cu64, const void* pool, int64_t pool_stride,
                         const void* slots, int slots64, const bool* has_init, int64_t T, int D, int W, int N,
                         int silu_on, cudaStream_t stream) {
  if (W < 1 || W > kMaxW) return cudaErrorInvalidValue;
  if (T <= 0 || D <= 0) return cudaSuccess;
  const Seqs seqs{IPtr{cu, cu64}, N, T};
  const dim3 grid(cdiv(T, kRun), cdiv(D, kChannels));
  if (grid.y > 65535) return cudaErrorInvalidValue;
  const FPtr wp{w, w_half}, bp{bias, bias_half};
  const IPtr sp{slots, slots64};
  if (dtype == kF16)
    conv_prefill_kernel<__half><<<grid, kChannels, 0, stream>>>(
        static_cast<const __half*>(x), wp, bp, static_cast<__half*>(y), seqs, static_cast<const __half*>(pool),
        pool_stride, sp, has_init, D, W, silu_on);
  else
    conv_prefill_kernel<float><<<grid, kChannels, 0, stream>>>(
        static_cast<const float*>(x), wp, bp, static_cast<float*>(y), seqs, static_cast<const float*>(pool),
        pool_stride, sp, has_init, D, W, silu_on);
  return cudaGetLastError();
}

cudaError_t conv_prefill_history(int dtype, const void* x, void* pool, int64_t pool_stride, const void* cu, int cu64,
                                 const void* slots, int slots64, const bool* has_init, int64_t T, int D, int W,
                                 int N, cudaStream_t stream) {
  if (W < 2 || N <= 0 || D <= 0) return cudaSuccess;
  const Seqs seqs{IPtr{cu, cu64}, N, T};
  const int threads = 256;
  const int blocks = cdiv(static_cast<int64_t>(N) * D, threads);
  const IPtr sp{slots, slots64};
  if (dtype == kF16)
    conv_history_kernel<__half><<<blocks, threads, 0, stream>>>(static_cast<const __half*>(x),
                                                                static_cast<__half*>(pool), pool_stride, seqs, sp,
                                                                has_init, D, W);
  else
    conv_history_kernel<float><<<blocks, threads, 0, stream>>>(static_cast<const float*>(x),
                                                               static_cast<float*>(pool), pool_stride, seqs, sp,
                                                               has_init, D, W);
  return cudaGetLastError();
}

cudaError_t conv_update(int dtype, const void* x, const void* w, int w_half, const void* bias, int bias_half,
                        void* y, void* pool, int64_t pool_stride, const void* slots, int slots64, int B, int D,
                        int W, int silu_on, cudaStream_t stream) {
  if (W < 1 || W > kMaxW) return cudaErrorInvalidValue;
  if (B <= 0 || D <= 0) return cudaSuccess;
  const int threads = 256;
  const int blocks = cdiv(static_cast<int64_t>(B) * D, threads);
  const FPtr wp{w, w_half}, bp{bias, bias_half};
  const IPtr sp{slots, slots64};
  if (dtype == kF16)
    conv_update_kernel<__half><<<blocks, threads, 0, stream>>>(static_cast<const __half*>(x), wp, bp,
                                                               static_cast<__half*>(y), static_cast<__half*>(pool),
                                                               pool_stride, sp, B, D, W, silu_on);
  else
    conv_update_kernel<float><<<blocks, threads, 0, stream>>>(static_cast<const float*>(x), wp, bp,
                                                              static_cast<float*>(y), static_cast<float*>(pool),
                                                              pool_stride, sp, B, D, W, silu_on);
  return cudaGetLastError();
}

}  // namespace q35
