// RMSNorms over the last dim of rows of n values: the GDN output norm y = x / rms(x) * w * silu(z) and the
// zero-centred y = x / rms(x) * (1 + w), optionally over s = x + residual (rounded to x's dtype, stored as the
// next residual). fp32 arithmetic throughout.
//
// A row is held in registers by ROW_THREADS threads, VPT values each (columns t, t + ROW_THREADS, ...: loads
// coalesced): a warp per row for n <= 1024 (several rows per block), a block of 256 / 1024 threads per row
// beyond. One pass over global memory.
#include "common.cuh"
#include "launchers.h"

namespace q35 {
namespace {

template <int ROW_THREADS>
__device__ __forceinline__ float row_sum(float v, float* red) {
  v = warp_sum(v);
  if (ROW_THREADS == kWarp) return v;
  // Block-wide: one partial per warp (32 lanes), summed by every thread.
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < ROW_THREADS / kWarp; ++i) total += red[i];
  return total;
}

template <typename T, int ROW_THREADS, int VPT>
__global__ void __launch_bounds__(ROW_THREADS == kWarp ? 256 : ROW_THREADS)
rms_norm_kernel(const T* __restrict__ x, FPtr z, const T* __restrict__ residual, FPtr w, T* __restrict__ y,
                T* __restrict__ s, int64_t rows, int n, float eps, int gated, int zero_centered) {
  __shared__ float red[ROW_THREADS / kWarp];
  const int rows_per_block = blockDim.x / ROW_THREADS;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / ROW_THREADS;
  const int t = threadIdx.x % ROW_THREADS;
  const bool live = row < rows;  // uniform per row group; a block-per-row block is always live
  const int64_t base = row * n;
  float v[VPT];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = t + i * ROW_THREADS;
    v[i] = 0.0f;
    if (live && c < n) {
      float xv = to_f(x[base + c]);
      if (residual != nullptr) {
        const T sum = from_f<T>(xv + to_f(residual[base + c]));  // rounded to x's dtype, as the reference
        s[base + c] = sum;
        xv = to_f(sum);
      }
      v[i] = xv;
      ss += xv * xv;
    }
  }
  const float r = rsqrtf(row_sum<ROW_THREADS>(ss, red) / n + eps);
  if (!live) return;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = t + i * ROW_THREADS;
    if (c < n) {
      float wv = w[c];
      if (zero_centered) wv += 1.0f;
      float out = v[i] * r * wv;
      if (gated) out *= silu(z[base + c]);
      y[base + c] = from_f<T>(out);
    }
  }
}

template <typename T, int ROW_THREADS, int VPT>
cudaError_t launch(const void* x, FPtr z, const void* residual, FPtr w, void* y, void* s, int64_t rows, int n,
                   float eps, int gated, int zc, cudaStream_t stream) {
  const int threads = ROW_THREADS == kWarp ? 256 : ROW_THREADS;
  const int per_block = threads / ROW_THREADS;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  rms_norm_kernel<T, ROW_THREADS, VPT><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const T*>(x), z, static_cast<const T*>(residual), w, static_cast<T*>(y), static_cast<T*>(s),
      rows, n, eps, gated, zc);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch(const void* x, FPtr z, const void* residual, FPtr w, void* y, void* s, int64_t rows, int n,
                     float eps, int gated, int zc, cudaStream_t stream) {
  if (n <= 128) return launch<T, 32, 4>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 256) return launch<T, 32, 8>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 1024) return launch<T, 32, 32>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 2048) return launch<T, 256, 8>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 4096) return launch<T, 256, 16>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 8192) return launch<T, 256, 32>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  if (n <= 32768) return launch<T, 1024, 32>(x, z, residual, w, y, s, rows, n, eps, gated, zc, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t rms_norm(int dtype, const void* x, const void* z, int z_half, const void* residual, const void* w,
                     int w_half, void* y, void* s, int64_t rows, int n, float eps, int gated, int zero_centered,
                     cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  const FPtr zp{z, z_half}, wp{w, w_half};
  if (dtype == kF16) return dispatch<__half>(x, zp, residual, wp, y, s, rows, n, eps, gated, zero_centered, stream);
  return dispatch<float>(x, zp, residual, wp, y, s, rows, n, eps, gated, zero_centered, stream);
}

}  // namespace q35
