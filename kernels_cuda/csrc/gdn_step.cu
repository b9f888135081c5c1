// Gated DeltaNet decode step: 1..8 tokens per sequence, recurrent form, fp32 state pool updated in place.
//
// One block per (row, value head, 32-column V block): 4 warps, lane c owns column c of the block (32 lanes) and
// warp w owns state rows [w * KP / 4, (w + 1) * KP / 4): the slice S[:, block] lives in registers for the
// whole step, read from the pool once and written back once (the op is bound by that traffic). Per token, with
// the normalised k, scaled q and d = beta (v - e^g S^T k):
//     S' = e^g S + k d^T,    o = S'^T q = e^g S^T q + d (k . q)
// S^T k and S^T q are partial sums per warp, combined through shared memory (two barriers per token; the
// shared arrays alternate between tokens so a third is not needed). Padding rows (slot < 0) write zero output
// and leave the pool alone. fp32 arithmetic throughout.
#include "common.cuh"
#include "launchers.h"

namespace q35 {
namespace {

constexpr int kStepWarps = 8;
constexpr int kStepThreads = kStepWarps * kWarp;
constexpr int kStepBV = kWarp;  // 32 lanes: one V column per lane

template <typename T, int KP>
__global__ void __launch_bounds__(kStepThreads, 3)
gdn_step_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, Gating gating,
                float* __restrict__ pool, int64_t pool_stride, IPtr slots, T* __restrict__ out, float scale,
                int use_l2, int B, int Tn, int H, int HV, int K, int V) {
  static_assert(KP % kStepWarps == 0 && KP <= kStepThreads, "KP rows over 4 warps, one q/k element per thread");
  constexpr int RW = KP / kStepWarps;  // state rows per thread
  __shared__ float qs[2][KP], ks[2][KP];
  __shared__ float red[2][kStepWarps][3];
  __shared__ float part[2][2][kStepWarps][kStepBV];
  __shared__ float gb[2][2];

  const int nvb = (V + kStepBV - 1) / kStepBV;
  const int64_t blk = blockIdx.x;
  const int vb = static_cast<int>(blk % nvb);
  const int64_t pair = blk / nvb;
  const int hv = static_cast<int>(pair % HV);
  const int row = static_cast<int>(pair / HV);
  const int h = hv / (HV / H);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int col = vb * kStepBV + lane;
  const bool col_ok = col < V;
  const int64_t slot = slots[row];

  if (slot < 0) {  // padding row
    if (warp == 0 && col_ok)
      for (int t = 0; t < Tn; ++t) out[((static_cast<int64_t>(row) * Tn + t) * HV + hv) * V + col] = from_f<T>(0.0f);
    return;
  }
  float* S_base = pool + slot * pool_stride + static_cast<int64_t>(hv) * K * V;
  float S[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int kr = warp * RW + r;
    S[r] = (kr < K && col_ok) ? S_base[static_cast<int64_t>(kr) * V + col] : 0.0f;
  }

  for (int t = 0; t < Tn; ++t) {
    const int buf = t & 1;
    const int64_t tok = static_cast<int64_t>(row) * Tn + t;
    float qv = 0.0f, kv = 0.0f;
    if (tid < K) {
      qv = to_f(q[(tok * H + h) * K + tid]);
      kv = to_f(k[(tok * H + h) * K + tid]);
    }
    const float sq = warp_sum(qv * qv), sk = warp_sum(kv * kv), sqk = warp_sum(qv * kv);
    if (lane == 0) {
      red[buf][warp][0] = sq;
      red[buf][warp][1] = sk;
      red[buf][warp][2] = sqk;
    }
    if (tid < KP) {
      qs[buf][tid] = qv;
      ks[buf][tid] = kv;
    }
    if (tid == 0) gating.at(tok, hv, gb[buf][0], gb[buf][1]);
    __syncthreads();

    float sumq = 0.0f, sumk = 0.0f, sumqk = 0.0f;
#pragma unroll
    for (int w = 0; w < kStepWarps; ++w) {
      sumq += red[buf][w][0];
      sumk += red[buf][w][1];
      sumqk += red[buf][w][2];
    }
    const float rq = (use_l2 ? rsqrtf(sumq + 1e-6f) : 1.0f) * scale;
    const float rk = use_l2 ? rsqrtf(sumk + 1e-6f) : 1.0f;
    const float decay = expf(gb[buf][0]);
    const float beta = gb[buf][1];
    float pk = 0.0f, pq = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      pk += S[r] * ks[buf][warp * RW + r];
      pq += S[r] * qs[buf][warp * RW + r];
    }
    part[buf][0][warp][lane] = pk;
    part[buf][1][warp][lane] = pq;
    __syncthreads();

    float Sk = 0.0f, Sq = 0.0f;
#pragma unroll
    for (int w = 0; w < kStepWarps; ++w) {
      Sk += part[buf][0][w][lane];
      Sq += part[buf][1][w][lane];
    }
    Sk *= rk;
    Sq *= rq;
    const float vv = col_ok ? to_f(v[(tok * HV + hv) * V + col]) : 0.0f;
    const float d = beta * (vv - decay * Sk);
    const float o = decay * Sq + d * (sumqk * rk * rq);
    if (warp == 0 && col_ok) out[(tok * HV + hv) * V + col] = from_f<T>(o);
#pragma unroll
    for (int r = 0; r < RW; ++r) S[r] = S[r] * decay + ks[buf][warp * RW + r] * rk * d;
  }

#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int kr = warp * RW + r;
    if (kr < K && col_ok) S_base[static_cast<int64_t>(kr) * V + col] = S[r];
  }
}

template <typename T, int KP>
cudaError_t launch_step(const void* q, const void* k, const void* v, Gating gating, float* pool, int64_t pool_stride,
                        IPtr slots, void* out, float scale, int use_l2, int B, int Tn, int H, int HV, int K, int V,
                        cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(B) * HV * ((V + kStepBV - 1) / kStepBV);
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  gdn_step_kernel<T, KP><<<static_cast<unsigned>(blocks), kStepThreads, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), gating, pool, pool_stride, slots,
      static_cast<T*>(out), scale, use_l2, B, Tn, H, HV, K, V);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_step(const void* q, const void* k, const void* v, Gating gating, float* pool,
                          int64_t pool_stride, IPtr slots, void* out, float scale, int use_l2, int B, int Tn, int H,
                          int HV, int K, int V, cudaStream_t stream) {
  if (K <= 32)
    return launch_step<T, 32>(q, k, v, gating, pool, pool_stride, slots, out, scale, use_l2, B, Tn, H, HV, K, V,
                              stream);
  if (K <= 64)
    return launch_step<T, 64>(q, k, v, gating, pool, pool_stride, slots, out, scale, use_l2, B, Tn, H, HV, K, V,
                              stream);
  if (K <= 128)
    return launch_step<T, 128>(q, k, v, gating, pool, pool_stride, slots, out, scale, use_l2, B, Tn, H, HV, K, V,
                               stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t gdn_step(int dtype, const void* q, const void* k, const void* v, GatingArgs gating, float* pool,
                     int64_t pool_stride, const void* slots, int slots64, void* out, float scale, int use_l2,
                     int B, int T, int H, int HV, int K, int V, cudaStream_t stream) {
  const Gating g = make_gating(gating);
  const IPtr sp{slots, slots64};
  if (dtype == kF16)
    return dispatch_step<__half>(q, k, v, g, pool, pool_stride, sp, out, scale, use_l2, B, T, H, HV, K, V, stream);
  return dispatch_step<float>(q, k, v, g, pool, pool_stride, sp, out, scale, use_l2, B, T, H, HV, K, V, stream);
}

}  // namespace q35
