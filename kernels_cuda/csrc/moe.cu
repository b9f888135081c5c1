// MoE: routing (softmax -> top-k -> renormalise), alignment of the picks by expert, the expert MLPs as grouped
// GEMMs over expert-aligned blocks of picks, and the fixed-order combine.
//
// A pick is (token m, slot j), id p = m * top_k + j. The alignment lists each local expert's picks in blocks of
// block_m rows (the last one padded with -1) and names each block's expert; the GEMMs run one program per
// (block, output tile) and stop at once past the used blocks, so the launch shapes depend on M only (no host
// synchronisation: a fixed-M call is CUDA-graph capturable). Each pick's output row is computed on its own, so
// where in its expert's blocks a pick lands changes no bit of the result.
//
//   gate_up: h[p] = silu(x[m] w13[e][:I]^T) * (x[m] w13[e][I:]^T)        [M * top_k, I]  activation dtype
//   down:    y[p] = weight[p] * (h[p] w2[e]^T)                           [M * top_k, H]  activation dtype
//   combine: out[m] = sum over j of y[m * top_k + j] (picks of experts held here), in order, fp32
//
// Two GEMM forms: tiled (64-row blocks; fp16 operands into WMMA m16n16k16 with fp32 accumulation, fp32 on CUDA
// cores with 32-row blocks), and for a few tokens a weight-streaming form (blocks of 8 picks, fp32 4): each
// program streams its rows of the expert's weights once with 16-byte loads, many in flight, and multiplies
// them into the block's picks on CUDA cores; a decode step is bound by reading the weights.
#include <mma.h>

#include "common.cuh"
#include "launchers.h"

namespace q35 {
namespace {

using namespace nvcuda;

// ------------------------------------------------------------------------------------------ routing
template <int EPL>  // logits per lane: E <= 32 * EPL (32 lanes)
__global__ void __launch_bounds__(128) moe_route_kernel(FPtr logits, float* __restrict__ weights,
                                                        int32_t* __restrict__ ids, int M, int E, int top_k,
                                                        int renormalize) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t m = static_cast<int64_t>(blockIdx.x) * 4 + warp;  // a warp per token
  if (m >= M) return;
  float val[EPL];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + kWarp * i;
    val[i] = e < E ? logits[m * E + e] : -INFINITY;
    mx = fmaxf(mx, val[i]);
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1)  // butterfly over 32 lanes
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if (lane + kWarp * i < E) sum += expf(val[i] - mx);
  sum = warp_sum(sum);
  uint32_t taken = 0;
  float picked_sum = 0.0f, my_w = 0.0f;
  int my_id = 0;
  for (int t = 0; t < top_k; ++t) {
    // this lane's best untaken logit (ids ascending within a lane: strict > keeps the lowest)
    float best = -INFINITY;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + kWarp * i;
      if (e < E && !(taken >> i & 1u) && (val[i] > best || best_e == 0x7fffffff)) {
        best = val[i];
        best_e = e;
      }
    }
    // warp argmax over 32 lanes, ties to the lowest expert id
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ov > best || (ov == best && oe < best_e)) {
        best = ov;
        best_e = oe;
      }
    }
    if (best_e % kWarp == lane) taken |= 1u << (best_e / kWarp);
    const float p = expf(best - mx) / sum;
    picked_sum += p;
    if (lane == t) {
      my_w = p;
      my_id = best_e;
    }
  }
  if (lane < top_k) {
    weights[m * top_k + lane] = renormalize ? my_w / picked_sum : my_w;
    ids[m * top_k + lane] = my_id;
  }
}

// ------------------------------------------------------------------------------------------ alignment
constexpr int kAlignThreads = 1024;

__device__ __forceinline__ int local_expert(const int32_t* ids, IPtr map, int64_t p) {
  const int g = ids[p];
  return map.p ? static_cast<int>(map[g]) : g;
}

__global__ void __launch_bounds__(kAlignThreads)
moe_align_kernel(const int32_t* __restrict__ ids, IPtr map, int picks, int E, int block_m, int32_t* sorted,
                 int32_t* block_expert, int32_t* meta, int max_blocks) {
  extern __shared__ int sh[];  // cnt[E], first block[E], cursor[E]
  int* cnt = sh;
  int* first = sh + E;
  int* cursor = sh + 2 * E;
  __shared__ int warp_tot[kAlignThreads / kWarp];
  __shared__ int total;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kAlignThreads) cnt[e] = cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < picks; p += kAlignThreads) {
    const int e = local_expert(ids, map, p);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // exclusive scan of blocks per expert, kAlignThreads experts at a time
  int carry = 0;
  for (int base = 0; base < E; base += kAlignThreads) {
    const int e = base + tid;
    const int nb = e < E ? (cnt[e] + block_m - 1) / block_m : 0;
    int v = nb;
    const int lane = tid % kWarp, warp = tid / kWarp;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {  // 32 lanes
      const int n = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += n;
    }
    if (lane == kWarp - 1) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {  // 32 lanes scan the 32 warp totals (kAlignThreads / 32 == 32 warps)
      int w = warp_tot[lane];
#pragma unroll
      for (int o = 1; o < kWarp; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += n;
      }
      warp_tot[lane] = w;
      if (lane == kWarp - 1) total = w;
    }
    __syncthreads();
    const int incl = v + (warp > 0 ? warp_tot[warp - 1] : 0);
    if (e < E) first[e] = carry + incl - nb;
    carry += total;
    __syncthreads();
  }
  const int used = carry;
  for (int b = tid; b < max_blocks; b += kAlignThreads) block_expert[b] = -1;
  for (int64_t i = tid; i < static_cast<int64_t>(max_blocks) * block_m; i += kAlignThreads) sorted[i] = -1;
  __syncthreads();
  for (int e = tid; e < E; e += kAlignThreads) {
    const int nb = (cnt[e] + block_m - 1) / block_m;
    for (int b = 0; b < nb; ++b) block_expert[first[e] + b] = e;
  }
  for (int p = tid; p < picks; p += kAlignThreads) {
    const int e = local_expert(ids, map, p);
    if (e >= 0) sorted[first[e] * block_m + atomicAdd(&cursor[e], 1)] = p;
  }
  if (tid == 0) {
    meta[0] = used;
    meta[1] = used * block_m;
  }
}

// ------------------------------------------------------------------------------------------ tiled GEMM, fp16
constexpr int kBM = 64, kBN = 128, kBK = 32, kLDK = kBK + 8;  // fp16 tiles; 4 warps of 32 x 64
constexpr int kGemmThreads = 128;

struct GemmArgs {
  const void* a;           // gate_up: x [M, H]; down: h [M * top_k, I]
  const void* w;           // gate_up: w13 [E, 2I, H]; down: w2 [E, H, I]
  void* out;               // gate_up: h; down: y
  const float* weights;    // down: [M * top_k] router weights
  const int32_t* sorted;
  const int32_t* block_expert;
  const int32_t* meta;
  int block_m, top_k, H, I;
};

// gate_up: weight row of the tile's smem row rho (gate and up rows interleaved by 16: 32j..32j+15 gate,
// 32j+16..32j+31 up, j = 0..3), or -1 past I. hn0: the tile's first h column.
__device__ __forceinline__ int gate_up_row(int rho, int hn0, int I) {
  const int j = rho / 32, w = rho % 32;
  const int hc = hn0 + 16 * j + (w & 15);
  if (hc >= I) return -1;
  return w < 16 ? hc : I + hc;
}

template <int MODE>  // 0: gate_up, 1: down
__global__ void __launch_bounds__(kGemmThreads) moe_gemm_f16_kernel(GemmArgs g) {
  __shared__ __align__(128) __half As[2][kBM][kLDK];
  __shared__ __align__(128) __half Bs[2][kBN][kLDK];
  const int blk = blockIdx.x;
  if (blk >= g.meta[0]) return;
  const int e = g.block_expert[blk];
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int Kd = MODE == 0 ? g.H : g.I;
  const int n0 = blockIdx.y * (MODE == 0 ? kBN / 2 : kBN);  // first h column (gate_up) / output column (down)
  const __half* A = static_cast<const __half*>(g.a);
  const __half* W = static_cast<const __half*>(g.w);

  // Each thread loads 2 A vectors and 4 B vectors (8 halves each) per k tile, rows fixed across k tiles.
  const __half* arow[2];
  const __half* brow[4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = (tid + kGemmThreads * i) / 4;
    const int p = g.sorted[blk * kBM + r];
    arow[i] = p < 0 ? nullptr : (MODE == 0 ? A + static_cast<int64_t>(p / g.top_k) * g.H : A + static_cast<int64_t>(p) * g.I);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int rho = (tid + kGemmThreads * i) / 4;
    if (MODE == 0) {
      const int n = gate_up_row(rho, n0, g.I);
      brow[i] = n < 0 ? nullptr : W + (static_cast<int64_t>(e) * 2 * g.I + n) * g.H;
    } else {
      const int n = n0 + rho;
      brow[i] = n < g.H ? W + (static_cast<int64_t>(e) * g.H + n) * g.I : nullptr;
    }
  }
  const int cv = (tid % 4) * 8;  // this thread's 8 columns of the k tile
  uint4 ra[2], rb[4];
  auto load = [&](int k0) {
    const bool kok = k0 + cv < Kd;  // Kd is a multiple of 8
#pragma unroll
    for (int i = 0; i < 2; ++i)
      ra[i] = (arow[i] && kok) ? *reinterpret_cast<const uint4*>(arow[i] + k0 + cv) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      rb[i] = (brow[i] && kok) ? *reinterpret_cast<const uint4*>(brow[i] + k0 + cv) : make_uint4(0, 0, 0, 0);
  };
  auto stash = [&](int buf) {
#pragma unroll
    for (int i = 0; i < 2; ++i) *reinterpret_cast<uint4*>(&As[buf][(tid + kGemmThreads * i) / 4][cv]) = ra[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(&Bs[buf][(tid + kGemmThreads * i) / 4][cv]) = rb[i];
  };

  const int wm = warp / 2, wn = warp % 2;  // warp tile: rows 32 wm .. +32, columns 64 wn .. +64
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int nk = (Kd + kBK - 1) / kBK;
  load(0);
  stash(0);
  __syncthreads();
  for (int kt = 0; kt < nk; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < nk) load((kt + 1) * kBK);  // in flight during this tile's products
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &As[buf][wm * 32 + 16 * i][ks * 16], kLDK);
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(fb[j], &Bs[buf][wn * 64 + 16 * j][ks * 16], kLDK);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    if (kt + 1 < nk) stash(buf ^ 1);
    __syncthreads();
  }

  // Epilogue through a per-warp fp32 tile in the (now idle) operand buffers.
  float* scratch = reinterpret_cast<float*>(&As[0][0][0]) + warp * 256;
  __half* out = static_cast<__half*>(g.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < (MODE == 0 ? 2 : 4); ++j) {
      int col0;
      if constexpr (MODE == 0) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> hf;  // same fragment type: same element layout
#pragma unroll
        for (int x = 0; x < hf.num_elements; ++x) hf.x[x] = silu(acc[i][2 * j].x[x]) * acc[i][2 * j + 1].x[x];
        wmma::store_matrix_sync(scratch, hf, 16, wmma::mem_row_major);
        col0 = n0 + 16 * (2 * wn + j);
      } else {
        wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
        col0 = n0 + wn * 64 + 16 * j;
      }
      __syncwarp();
      const int ncols = MODE == 0 ? g.I : g.H;
      for (int x = lane; x < 256; x += kWarp) {  // 32 lanes over the tile
        const int r = wm * 32 + 16 * i + x / 16, c = col0 + x % 16;
        const int p = g.sorted[blk * kBM + r];
        if (p >= 0 && c < ncols) {
          float v = scratch[x];
          if (MODE == 1) v *= g.weights[p];
          out[static_cast<int64_t>(p) * ncols + c] = __float2half_rn(v);
        }
      }
      __syncwarp();
    }
  }
}

// ------------------------------------------------------------------------------------------ tiled GEMM, fp32
constexpr int kFM = 32, kFN = 64, kFK = 32;  // fp32 tiles on CUDA cores, 256 threads of 2 rows x 4 columns

template <int MODE>
__global__ void __launch_bounds__(256) moe_gemm_f32_kernel(GemmArgs g) {
  constexpr int WR = MODE == 0 ? 2 * kFN : kFN;  // weight rows per tile: gate rows then up rows (gate_up)
  __shared__ float As[kFM][kFK + 1];
  __shared__ float Ws[WR][kFK + 1];
  const int blk = blockIdx.x;
  if (blk >= g.meta[0]) return;
  const int e = g.block_expert[blk];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int Kd = MODE == 0 ? g.H : g.I;
  const int ncols = MODE == 0 ? g.I : g.H;
  const int n0 = blockIdx.y * kFN;
  const float* A = static_cast<const float*>(g.a);
  const float* W = static_cast<const float*>(g.w);
  float acc[2][4], acc_u[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = acc_u[i][j] = 0.0f;
  for (int k0 = 0; k0 < Kd; k0 += kFK) {
    for (int idx = tid; idx < kFM * kFK; idx += 256) {
      const int r = idx / kFK, c = idx % kFK;
      const int p = g.sorted[blk * kFM + r];
      float v = 0.0f;
      if (p >= 0 && k0 + c < Kd)
        v = MODE == 0 ? A[static_cast<int64_t>(p / g.top_k) * g.H + k0 + c] : A[static_cast<int64_t>(p) * g.I + k0 + c];
      As[r][c] = v;
    }
    for (int idx = tid; idx < WR * kFK; idx += 256) {
      const int r = idx / kFK, c = idx % kFK;
      float v = 0.0f;
      if (k0 + c < Kd) {
        if (MODE == 0) {
          const int hc = n0 + (r % kFN);
          if (hc < g.I) v = W[(static_cast<int64_t>(e) * 2 * g.I + (r < kFN ? hc : g.I + hc)) * g.H + k0 + c];
        } else if (n0 + r < g.H) {
          v = W[(static_cast<int64_t>(e) * g.H + n0 + r) * g.I + k0 + c];
        }
      }
      Ws[r][c] = v;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kFK; ++kk) {
      const float a0 = As[ty][kk], a1 = As[ty + 16][kk];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float w = Ws[tx + 16 * j][kk];
        acc[0][j] += a0 * w;
        acc[1][j] += a1 * w;
        if (MODE == 0) {
          const float wu = Ws[kFN + tx + 16 * j][kk];
          acc_u[0][j] += a0 * wu;
          acc_u[1][j] += a1 * wu;
        }
      }
    }
    __syncthreads();
  }
  float* out = static_cast<float*>(g.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int p = g.sorted[blk * kFM + ty + 16 * i];
    if (p < 0) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = n0 + tx + 16 * j;
      if (c >= ncols) continue;
      out[static_cast<int64_t>(p) * ncols + c] =
          MODE == 0 ? silu(acc[i][j]) * acc_u[i][j] : acc[i][j] * g.weights[p];
    }
  }
}

// ------------------------------------------------------------------------------------------ weight streaming
// A block of R picks of one expert per program; each warp streams whole weight rows (16-byte vectors, UNROLL
// in flight per row per lane) against the picks' rows staged in shared memory, then reduces across its 32 lanes.
constexpr int kGemvThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
struct Vec {  // 16 bytes of T
  static constexpr int N = 16 / sizeof(T);
};

// Dot product of 16 bytes of weights with 16 bytes of a staged row (one 16-byte shared load).
template <typename T>
__device__ __forceinline__ float dot16(const uint4& w, const T* x) {
  const uint4 xv = *reinterpret_cast<const uint4*>(x);
  const T* wv = reinterpret_cast<const T*>(&w);
  const T* xs = reinterpret_cast<const T*>(&xv);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) s += to_f(wv[i]) * to_f(xs[i]);
  return s;
}

// Stage the block's pick rows (Kd values each, activation dtype) into shared memory; returns how many there are.
template <typename T, int R, int MODE>
__device__ int stage_rows(T* xs, const GemmArgs& g, int blk, int Kd) {
  int rows = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) rows += g.sorted[blk * R + r] >= 0;
  const T* A = static_cast<const T*>(g.a);
  const int vpr = Kd / Vec<T>::N;
  for (int idx = threadIdx.x; idx < rows * vpr; idx += kGemvThreads) {
    const int r = idx / vpr, v = idx % vpr;
    const int p = g.sorted[blk * R + r];
    const T* src = MODE == 0 ? A + static_cast<int64_t>(p / g.top_k) * g.H : A + static_cast<int64_t>(p) * g.I;
    reinterpret_cast<uint4*>(xs + r * Kd)[v] = reinterpret_cast<const uint4*>(src)[v];
  }
  __syncthreads();
  return rows;
}

template <typename T, int R>
__global__ void __launch_bounds__(kGemvThreads) moe_gemv_gate_up_kernel(GemmArgs g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);
  const int blk = blockIdx.x;
  if (blk >= g.meta[0]) return;
  const int e = g.block_expert[blk];
  const int rows = stage_rows<T, R, 0>(xs, g, blk, g.H);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  constexpr int VN = Vec<T>::N;
  const int nv = g.H / VN;
  const T* W = static_cast<const T*>(g.w) + static_cast<int64_t>(e) * 2 * g.I * g.H;
  T* out = static_cast<T*>(g.out);
  // this warp's h columns: 2 of the program's 16
  for (int q = 0; q < 2; ++q) {
    const int hc = blockIdx.y * 16 + warp * 2 + q;
    if (hc >= g.I) break;
    const uint4* wg = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(hc) * g.H);
    const uint4* wu = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(g.I + hc) * g.H);
    float ag[R], au[R];
#pragma unroll
    for (int r = 0; r < R; ++r) ag[r] = au[r] = 0.0f;
    for (int v0 = lane; v0 < nv; v0 += kWarp * kUnroll) {
      uint4 bg[kUnroll], bu[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * kWarp;
        bg[u] = v < nv ? wg[v] : make_uint4(0, 0, 0, 0);
        bu[u] = v < nv ? wu[v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * kWarp;
        if (v < nv) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r < rows) {
              ag[r] += dot16<T>(bg[u], xs + r * g.H + v * VN);
              au[r] += dot16<T>(bu[u], xs + r * g.H + v * VN);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < rows) {
        const float gs = warp_sum(ag[r]), us = warp_sum(au[r]);
        if (lane == 0) out[static_cast<int64_t>(g.sorted[blk * R + r]) * g.I + hc] = from_f<T>(silu(gs) * us);
      }
    }
  }
}

template <typename T, int R>
__global__ void __launch_bounds__(kGemvThreads) moe_gemv_down_kernel(GemmArgs g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* hs = reinterpret_cast<T*>(smem_raw);
  const int blk = blockIdx.x;
  if (blk >= g.meta[0]) return;
  const int e = g.block_expert[blk];
  const int rows = stage_rows<T, R, 1>(hs, g, blk, g.I);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  constexpr int VN = Vec<T>::N;
  constexpr int NR = 4;  // output columns (weight rows) per pass of a warp
  const int nv = g.I / VN;
  const T* W = static_cast<const T*>(g.w) + static_cast<int64_t>(e) * g.H * g.I;
  T* out = static_cast<T*>(g.out);
  for (int pass = 0; pass < 2; ++pass) {  // 8 columns per warp, 64 per program
    const int c0 = blockIdx.y * 64 + warp * 8 + pass * NR;
    float acc[NR][R];
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[n][r] = 0.0f;
    for (int v0 = lane; v0 < nv; v0 += kWarp * 2) {
      uint4 b[NR][2];
#pragma unroll
      for (int n = 0; n < NR; ++n)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int v = v0 + u * kWarp;
          b[n][u] = (c0 + n < g.H && v < nv)
                        ? reinterpret_cast<const uint4*>(W + static_cast<int64_t>(c0 + n) * g.I)[v]
                        : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int v = v0 + u * kWarp;
        if (v < nv) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r < rows) {
#pragma unroll
              for (int n = 0; n < NR; ++n) acc[n][r] += dot16<T>(b[n][u], hs + r * g.I + v * VN);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < rows) {
        const int p = g.sorted[blk * R + r];
#pragma unroll
        for (int n = 0; n < NR; ++n) {
          const float s = warp_sum(acc[n][r]);
          if (lane == 0 && c0 + n < g.H) out[static_cast<int64_t>(p) * g.H + c0 + n] = from_f<T>(s * g.weights[p]);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ combine
template <typename T>
__global__ void moe_combine_kernel(const T* __restrict__ y, const int32_t* __restrict__ ids, IPtr map,
                                   const T* __restrict__ extra, T* __restrict__ out, int M, int top_k, int H) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(M) * H) return;
  const int64_t m = idx / H;
  const int c = static_cast<int>(idx % H);
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t p = m * top_k + j;
    if (local_expert(ids, map, p) >= 0) acc += to_f(y[p * H + c]);
  }
  if (extra != nullptr) acc += to_f(extra[idx]);
  out[idx] = from_f<T>(acc);
}

template <typename T>
constexpr int gemv_rows() {
  return sizeof(T) == 2 ? 8 : 4;
}

}  // namespace

cudaError_t moe_route(int logits_dtype, const void* logits, float* weights, int32_t* ids, int M, int E, int top_k,
                      int renormalize, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (E > 1024 || top_k > 32 || top_k > E) return cudaErrorInvalidValue;
  const FPtr lp{logits, logits_dtype == kF16};
  const int blocks = cdiv(M, 4);
  if (E <= 128) moe_route_kernel<4><<<blocks, 128, 0, stream>>>(lp, weights, ids, M, E, top_k, renormalize);
  else if (E <= 256) moe_route_kernel<8><<<blocks, 128, 0, stream>>>(lp, weights, ids, M, E, top_k, renormalize);
  else if (E <= 512) moe_route_kernel<16><<<blocks, 128, 0, stream>>>(lp, weights, ids, M, E, top_k, renormalize);
  else moe_route_kernel<32><<<blocks, 128, 0, stream>>>(lp, weights, ids, M, E, top_k, renormalize);
  return cudaGetLastError();
}

cudaError_t moe_align(const int32_t* ids, const void* expert_map, int map64, int M, int top_k, int E_local,
                      int block_m, int32_t* sorted, int32_t* block_expert, int32_t* meta, int max_blocks,
                      cudaStream_t stream) {
  if (E_local > 4096) return cudaErrorInvalidValue;
  const int bytes = 3 * E_local * static_cast<int>(sizeof(int));
  moe_align_kernel<<<1, kAlignThreads, bytes, stream>>>(ids, IPtr{expert_map, map64}, M * top_k, E_local, block_m,
                                                        sorted, block_expert, meta, max_blocks);
  return cudaGetLastError();
}

int moe_block_m(int dtype, int gemv) {
  if (gemv) return dtype == kF16 ? gemv_rows<__half>() : gemv_rows<float>();
  return dtype == kF16 ? kBM : kFM;
}

cudaError_t moe_gate_up(int dtype, const void* x, const void* w13, void* h, const int32_t* sorted,
                        const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m, int M,
                        int top_k, int H, int I, cudaStream_t stream) {
  if (max_blocks <= 0) return cudaSuccess;
  const GemmArgs g{x, w13, h, nullptr, sorted, block_expert, meta, block_m, top_k, H, I};
  if (dtype == kF16) {
    if (block_m != kBM || H % 8) return cudaErrorInvalidValue;
    moe_gemm_f16_kernel<0><<<dim3(max_blocks, cdiv(I, kBN / 2)), kGemmThreads, 0, stream>>>(g);
  } else {
    if (block_m != kFM) return cudaErrorInvalidValue;
    moe_gemm_f32_kernel<0><<<dim3(max_blocks, cdiv(I, kFN)), 256, 0, stream>>>(g);
  }
  return cudaGetLastError();
}

cudaError_t moe_down(int dtype, const void* h, const void* w2, void* y, const float* weights, const int32_t* sorted,
                     const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m, int M,
                     int top_k, int H, int I, cudaStream_t stream) {
  if (max_blocks <= 0) return cudaSuccess;
  const GemmArgs g{h, w2, y, weights, sorted, block_expert, meta, block_m, top_k, H, I};
  if (dtype == kF16) {
    if (block_m != kBM || I % 8) return cudaErrorInvalidValue;
    moe_gemm_f16_kernel<1><<<dim3(max_blocks, cdiv(H, kBN)), kGemmThreads, 0, stream>>>(g);
  } else {
    if (block_m != kFM) return cudaErrorInvalidValue;
    moe_gemm_f32_kernel<1><<<dim3(max_blocks, cdiv(H, kFN)), 256, 0, stream>>>(g);
  }
  return cudaGetLastError();
}

// Launch a weight-streaming kernel with `bytes` of staged rows (its shared-memory limit raised to the SM70 budget
// once per device).
template <void (*Kernel)(GemmArgs)>
cudaError_t launch_gemv(dim3 grid, int bytes, const GemmArgs& g, cudaStream_t stream) {
  if (bytes > kMaxSmem) return cudaErrorInvalidValue;
  static unsigned long long done = 0;
  const cudaError_t attr = bytes > 48 * 1024 ? smem_limit(Kernel, kMaxSmem, done) : cudaSuccess;
  if (attr != cudaSuccess) return attr;
  Kernel<<<grid, kGemvThreads, bytes, stream>>>(g);
  return cudaGetLastError();
}

cudaError_t moe_gemv_gate_up(int dtype, const void* x, const void* w13, void* h, const int32_t* sorted,
                             const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m,
                             int top_k, int H, int I, cudaStream_t stream) {
  if (max_blocks <= 0) return cudaSuccess;
  const GemmArgs g{x, w13, h, nullptr, sorted, block_expert, meta, block_m, top_k, H, I};
  const dim3 grid(max_blocks, cdiv(I, 16));
  if (dtype == kF16) {
    constexpr int R = gemv_rows<__half>();
    if (block_m != R || H % 8) return cudaErrorInvalidValue;
    return launch_gemv<moe_gemv_gate_up_kernel<__half, R>>(grid, R * H * 2, g, stream);
  }
  constexpr int R = gemv_rows<float>();
  if (block_m != R || H % 4) return cudaErrorInvalidValue;
  return launch_gemv<moe_gemv_gate_up_kernel<float, R>>(grid, R * H * 4, g, stream);
}

cudaError_t moe_gemv_down(int dtype, const void* h, const void* w2, void* y, const float* weights,
                          const int32_t* sorted, const int32_t* block_expert, const int32_t* meta, int max_blocks,
                          int block_m, int top_k, int H, int I, cudaStream_t stream) {
  if (max_blocks <= 0) return cudaSuccess;
  const GemmArgs g{h, w2, y, weights, sorted, block_expert, meta, block_m, top_k, H, I};
  const dim3 grid(max_blocks, cdiv(H, 64));
  if (dtype == kF16) {
    constexpr int R = gemv_rows<__half>();
    if (block_m != R || I % 8) return cudaErrorInvalidValue;
    return launch_gemv<moe_gemv_down_kernel<__half, R>>(grid, R * I * 2, g, stream);
  }
  constexpr int R = gemv_rows<float>();
  if (block_m != R || I % 4) return cudaErrorInvalidValue;
  return launch_gemv<moe_gemv_down_kernel<float, R>>(grid, R * I * 4, g, stream);
}

cudaError_t moe_combine(int dtype, const void* y, const int32_t* ids, const void* expert_map, int map64,
                        const void* extra, void* out, int M, int top_k, int H, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(M) * H;
  if (n <= 0) return cudaSuccess;
  const int blocks = cdiv(n, 256);
  const IPtr mp{expert_map, map64};
  if (dtype == kF16)
    moe_combine_kernel<__half><<<blocks, 256, 0, stream>>>(static_cast<const __half*>(y), ids, mp,
                                                          static_cast<const __half*>(extra),
                                                          static_cast<__half*>(out), M, top_k, H);
  else
    moe_combine_kernel<float><<<blocks, 256, 0, stream>>>(static_cast<const float*>(y), ids, mp,
                                                         static_cast<const float*>(extra), static_cast<float*>(out),
                                                         M, top_k, H);
  return cudaGetLastError();
}

}  // namespace q35
