// Chunked Gated DeltaNet prefill (varlen, grouped value heads, fused gating), in three launches.
//
// Per chunk of C = 64 tokens of one value head, with chunk-local cumulative decays G_i = g_0 + .. + g_i,
// normalised k^_i = k_i rk_i, scaled q^_i = q_i rq_i, gamma_ij = exp(G_i - G_j) for i >= j only:
//     A    = strict_lower(diag(beta) K^ K^T * gamma),        T = (I + A)^-1
//     W    = T diag(beta e^G) K^,                            U = T diag(beta) V
//     V'   = U - W S,                                        O = diag(e^G) Q^ S + (Q^ K^T * gamma)_{i>=j} V'
//     S   <- e^{G_last} S + (diag(e^{G_last - G}) K^)^T V'
// Every exp() is of a difference G_i - G_j with i >= j or of G_i itself: never positive, never overflowing,
// whatever the sequence length or decay.
//
// 1. gdn_chunk_table_kernel: each sequence's first chunk in the batch (a prefix sum over ceil(len / 64)).
// 2. gdn_prepare_kernel, one block per (chunk, value head), all chunks in parallel: gating, norms, the Gram
//    products K K^T and Q K^T, A, the inverse T (16-row diagonal blocks by substitution, then two block
//    merges T_21 = -T_22 A_21 T_11, all fp32), and the chunk's workspace record:
//        Wn = -W, Qs = diag(rq e^G) Q, Ks = diag(rk e^{G_last - G}) K   [64, P] in the operand dtype,
//        Aqk = (Q^ K^T * gamma)_{i>=j}  [64, 64] operand dtype,   U [64, P] fp32,   e^{G_last} fp32.
//    Rows past the chunk's end and columns past K / V are zero, so the scan needs no masks.
// 3. gdn_scan_kernel, one block per (sequence, value head, 32-column V block): walks the sequence's chunks in
//    order with its state slice S[:, block] on chip (fp32), computing V' = U + Wn S, O = Qs S + Aqk V' and
//    S <- e^{G_last} S + Ks^T V'.
//
// fp16 activations: operands fp16 into WMMA m16n16k16 with fp32 accumulation (the state is an fp32 accumulator
// fragment across chunks; its fp16 copy is an operand). fp32 activations: the same algorithm with fp32 CUDA-core
// arithmetic (no tensor cores), which keeps fp32 accuracy.
#include <mma.h>

#include "common.cuh"
#include "launchers.h"

namespace q35 {
namespace {

using namespace nvcuda;

constexpr int C = 64;            // tokens per chunk
constexpr int kThreads = 256;    // 8 warps, every GDN chunk kernel
constexpr int kWarps = kThreads / kWarp;
constexpr int kScanBV = 32;      // V columns per scan block
constexpr int kTail = 128;       // bytes after U in a record (e^{G_last}), keeps records 128-byte aligned

// ------------------------------------------------------------------------------------------ record layout
template <typename T>
struct Record {
  int P;
  __host__ __device__ int64_t wn() const { return 0; }
  __host__ __device__ int64_t qs() const { return static_cast<int64_t>(C) * P * sizeof(T); }
  __host__ __device__ int64_t ks() const { return 2 * static_cast<int64_t>(C) * P * sizeof(T); }
  __host__ __device__ int64_t aq() const { return 3 * static_cast<int64_t>(C) * P * sizeof(T); }
  __host__ __device__ int64_t u() const { return aq() + static_cast<int64_t>(C) * C * sizeof(T); }
  __host__ __device__ int64_t ec() const { return u() + static_cast<int64_t>(C) * P * sizeof(float); }
  __host__ __device__ int64_t bytes() const { return ec() + kTail; }
};

// Sequences of the batch and their chunks.
struct Batch {
  IPtr cu;                   // [N + 1] offsets; cu.p null: one sequence of T tokens
  const int32_t* seq_first;  // [N + 1] first chunk of each sequence (varlen only)
  int N;
  int64_t T;
  __device__ __forceinline__ int64_t start(int n) const { return cu.p ? cu[n] : 0; }
  __device__ __forceinline__ int64_t end(int n) const { return cu.p ? cu[n + 1] : T; }
  __device__ __forceinline__ int64_t first_chunk(int n) const { return cu.p ? seq_first[n] : 0; }
  __device__ __forceinline__ int64_t end_chunk(int n) const { return cu.p ? seq_first[n + 1] : (T + C - 1) / C; }
  // (first token, end token) of chunk row r of the batch; end <= first for rows past the last chunk.
  __device__ __forceinline__ void chunk(int64_t r, int64_t& s, int64_t& e) const {
    if (!cu.p) {
      s = r * C;
      e = s + C < T ? s + C : T;
      return;
    }
    if (r >= seq_first[N]) {
      s = e = 0;
      return;
    }
    int lo = 0, hi = N - 1;  // the sequence n with seq_first[n] <= r < seq_first[n + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (seq_first[mid] <= r) lo = mid; else hi = mid - 1;
    }
    // empty sequences share their seq_first with the next one: take the last n whose range holds r
    s = cu[lo] + (r - seq_first[lo]) * C;
    e = s + C < cu[lo + 1] ? s + C : cu[lo + 1];
  }
};

// ------------------------------------------------------------------------------------------ chunk table
// Block-wide inclusive scan of one int per thread (kThreads threads); returns the block total in *total.
__device__ int block_scan(int v, int* warp_tot, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {  // 32 lanes
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  if (lane == kWarp - 1) warp_tot[warp] = v;
  __syncthreads();
  if (warp == 0) {  // the warp totals scanned by one warp of 32 lanes (kWarps <= 32)
    int w = lane < kWarps ? warp_tot[lane] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < kWarps) warp_tot[lane] = w;
    if (lane == kWarps - 1) *total = w;
  }
  __syncthreads();
  const int out = v + (warp > 0 ? warp_tot[warp - 1] : 0);
  __syncthreads();  // warp_tot and total are reused by the next call
  return out;
}

__global__ void __launch_bounds__(kThreads) gdn_chunk_table_kernel(IPtr cu, int N, int32_t* seq_first) {
  __shared__ int warp_tot[kWarps];
  __shared__ int total;
  int carry = 0;
  for (int base = 0; base < N; base += kThreads) {
    const int n = base + threadIdx.x;
    const int cnt = n < N ? static_cast<int>((cu[n + 1] - cu[n] + C - 1) / C) : 0;
    const int incl = block_scan(cnt, warp_tot, &total);
    if (n < N) seq_first[n] = carry + incl - cnt;
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) seq_first[N] = carry;
}

// ------------------------------------------------------------------------------------------ prepare
template <typename T, int P>
struct PrepLayout {
  static constexpr bool kTC = sizeof(T) == 2;           // fp16: WMMA, tiles staged in shared memory
  static constexpr int LD = kTC ? P + 8 : P + 1;         // row stride (elements) of staged [64, P] tiles
  static constexpr int LDA = kTC ? 72 : 65;              // row stride (floats) of the [64, 64] fp32 tiles
  static constexpr int kraw = 0;                                              // T [64][LD]  raw k
  static constexpr int qv = kraw + C * LD * static_cast<int>(sizeof(T));      // T [64][LD]  raw q, then v (fp16)
  static constexpr int abuf = qv + (kTC ? C * LD * 2 : 0);                    // f32 [64][LDA] Gram kk, A, then T diag
  static constexpr int tbuf = abuf + C * LDA * 4;                             // f32 [64][LDA] Gram qk, T, scratch
  static constexpr int pbuf = tbuf + C * LDA * 4;                             // f32 [32][33] merge products
  static constexpr int vec = pbuf + 32 * 33 * 4;                              // f32 [6][64] G, beta, rk, rq, cw, cu
  static constexpr int bytes = vec + 6 * C * 4;
  static_assert(bytes <= kMaxSmem, "prepare shared memory over the SM70 budget");
  static_assert(!kTC || 2 * C * LDA * 2 <= C * LDA * 4, "T diag halves must fit the A buffer");
  static_assert(!kTC || kWarps * 256 * 4 <= C * LDA * 4, "per-warp scratch must fit the T buffer");
};

struct PrepArgs {
  const void* q;
  const void* k;
  const void* v;
  Gating gating;
  Batch batch;
  unsigned char* ws;
  int64_t rec_bytes;
  int64_t r0;  // the window's first chunk row (its record is the workspace's first)
  float scale;
  int use_l2, H, HV, K, V;
};

template <typename T, int P>
__global__ void __launch_bounds__(kThreads) gdn_prepare_kernel(PrepArgs a) {
  using L_ = PrepLayout<T, P>;
  constexpr bool kTC = L_::kTC;
  constexpr int LD = L_::LD, LDA = L_::LDA;
  extern __shared__ __align__(128) unsigned char smem[];
  T* kraw = reinterpret_cast<T*>(smem + L_::kraw);
  __half* qvh = reinterpret_cast<__half*>(smem + L_::qv);
  float* abuf = reinterpret_cast<float*>(smem + L_::abuf);
  float* tbuf = reinterpret_cast<float*>(smem + L_::tbuf);
  float* pbuf = reinterpret_cast<float*>(smem + L_::pbuf);
  float* G = reinterpret_cast<float*>(smem + L_::vec);
  float* beta = G + C;
  float* rk = G + 2 * C;
  float* rq = G + 3 * C;
  float* cw = G + 4 * C;  // column scales of T for W: beta e^G rk
  float* cb = G + 5 * C;  // column scales of T for U: beta

  const int hv = static_cast<int>(blockIdx.x % a.HV);
  const int64_t r = a.r0 + blockIdx.x / a.HV;
  int64_t s, e;
  a.batch.chunk(r, s, e);
  if (e <= s) return;
  const int L = static_cast<int>(e - s);
  const int h = hv / (a.HV / a.H);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int K = a.K, V = a.V;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const int64_t qk_row = static_cast<int64_t>(a.H) * K;   // elements between tokens of q / k
  const int64_t v_row = static_cast<int64_t>(a.HV) * V;
  const T* qc = q + s * qk_row + static_cast<int64_t>(h) * K;
  const T* kc = k + s * qk_row + static_cast<int64_t>(h) * K;
  const T* vc = v + s * v_row + static_cast<int64_t>(hv) * V;
  const Record<T> rec{P};
  unsigned char* base = a.ws + ((r - a.r0) * a.HV + hv) * a.rec_bytes;
  T* out_wn = reinterpret_cast<T*>(base + rec.wn());
  T* out_qs = reinterpret_cast<T*>(base + rec.qs());
  T* out_ks = reinterpret_cast<T*>(base + rec.ks());
  T* out_aq = reinterpret_cast<T*>(base + rec.aq());
  float* out_u = reinterpret_cast<float*>(base + rec.u());
  float* out_ec = reinterpret_cast<float*>(base + rec.ec());

  // ---- gating and its chunk-local cumulative sum (warps 0 and 1, 32 lanes each)
  if (warp < 2) {
    float gv = 0.0f, bv = 0.0f;
    if (tid < L) a.gating.at(s + tid, hv, gv, bv);
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const float n = __shfl_up_sync(0xffffffffu, gv, o);
      if (lane >= o) gv += n;
    }
    G[tid] = gv;
    beta[tid] = bv;
  }
  // ---- stage raw k (and q, fp16) rows, zero past the chunk end and past K
  for (int idx = tid; idx < C * P; idx += kThreads) {
    const int i = idx / P, c = idx % P;
    const bool ok = i < L && c < K;
    kraw[i * LD + c] = ok ? kc[i * qk_row + c] : from_f<T>(0.0f);
    if constexpr (kTC) qvh[i * LD + c] = ok ? static_cast<const __half*>(a.q)[(s + i) * qk_row + h * K + c] : __float2half(0.f);
  }
  __syncthreads();
  if (tid >= kWarp && tid < 2 * kWarp) G[tid] += G[kWarp - 1];
  // ---- row norms: 8 rows per warp, lanes over columns
  for (int i = warp; i < C; i += kWarps) {
    float sk = 0.0f, sq = 0.0f;
    for (int c = lane; c < P; c += kWarp) {
      const float kv = to_f(kraw[i * LD + c]);
      sk += kv * kv;
      float qv;
      if constexpr (kTC) qv = __half2float(qvh[i * LD + c]);
      else qv = (i < L && c < K) ? to_f(qc[i * qk_row + c]) : 0.0f;
      sq += qv * qv;
    }
    sk = warp_sum(sk);
    sq = warp_sum(sq);
    if (lane == 0) {
      rk[i] = a.use_l2 ? rsqrtf(sk + 1e-6f) : 1.0f;
      rq[i] = (a.use_l2 ? rsqrtf(sq + 1e-6f) : 1.0f) * a.scale;
    }
  }

  // ---- Gram products: K K^T into abuf, Q K^T into tbuf (tiles on and below the diagonal)
  if constexpr (kTC) {
    for (int job = warp; job < 20; job += kWarps) {
      const bool is_qk = job >= 10;
      int t = is_qk ? job - 10 : job;  // lower tiles (ti, tj), tj <= ti, in order
      int ti = 0;
      while (t > ti) { t -= ti + 1; ++ti; }
      const int tj = t;
      const __half* arow = is_qk ? qvh : reinterpret_cast<const __half*>(kraw);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < P / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, arow + ti * 16 * LD + kk * 16, LD);
        wmma::load_matrix_sync(fb, reinterpret_cast<const __half*>(kraw) + tj * 16 * LD + kk * 16, LD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync((is_qk ? tbuf : abuf) + ti * 16 * LDA + tj * 16, acc, LDA, wmma::mem_row_major);
    }
  }
  __syncthreads();
  if constexpr (!kTC) {
    // fp32: lanes over j (columns of k, conflict-free with the odd row stride), i shared by the warp
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      if (j > i) continue;
      float skk = 0.0f, sqk = 0.0f;
      const bool qrow = i < L;
      for (int c = 0; c < K; ++c) {
        const float kj = to_f(kraw[j * LD + c]);
        skk += to_f(kraw[i * LD + c]) * kj;
        if (qrow) sqk += to_f(qc[i * qk_row + c]) * kj;
      }
      abuf[i * LDA + j] = skk;
      tbuf[i * LDA + j] = sqk;
    }
    __syncthreads();
  }

  // ---- A (in place), Aqk, Qs and Ks to the record
  for (int idx = tid; idx < C * C; idx += kThreads) {
    const int i = idx / C, j = idx % C;
    float av = 0.0f, aq = 0.0f;
    if (i < L && j <= i) {
      const float gamma = expf(G[i] - G[j]);  // i >= j: a non-positive exponent
      aq = rq[i] * rk[j] * tbuf[i * LDA + j] * gamma;
      if (j < i) av = beta[i] * rk[i] * rk[j] * abuf[i * LDA + j] * gamma;
    }
    abuf[i * LDA + j] = av;
    out_aq[idx] = from_f<T>(aq);
  }
  {
    const float g_last = G[L - 1];
    for (int idx = tid; idx < C * P; idx += kThreads) {
      const int i = idx / P, c = idx % P;
      float qv = 0.0f, kv = 0.0f;
      if (i < L && c < K) {
        if constexpr (kTC) qv = __half2float(qvh[i * LD + c]);
        else qv = to_f(qc[i * qk_row + c]);
        qv *= rq[i] * expf(G[i]);
        kv = to_f(kraw[i * LD + c]) * rk[i] * expf(g_last - G[i]);
      }
      out_qs[idx] = from_f<T>(qv);
      out_ks[idx] = from_f<T>(kv);
    }
    if (tid < C) {
      cw[tid] = beta[tid] * expf(G[tid]) * rk[tid];
      cb[tid] = beta[tid];
    }
    if (tid == 0) *out_ec = expf(g_last);
  }
  __syncthreads();

  // ---- T = (I + A)^-1, fp32: zero, 16-row diagonal blocks by substitution, merges 16 -> 32 -> 64
  for (int idx = tid; idx < C * C; idx += kThreads) tbuf[(idx / C) * LDA + idx % C] = 0.0f;
  __syncthreads();
  if (tid < C) {
    const int b0 = (tid / 16) * 16, col = tid % 16;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = i == col ? 1.0f : 0.0f;
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      if (i > col) {
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < i; ++m) acc += abuf[(b0 + i) * LDA + b0 + m] * x[m];
        x[i] = -acc;
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tbuf[(b0 + i) * LDA + b0 + col] = x[i];
  }
  __syncthreads();
  for (int idx = tid; idx < 512; idx += kThreads) {  // P21 = A21 T11 of both 32-row blocks
    const int b2 = idx >> 8, i = (idx >> 4) & 15, j = idx & 15, o = 32 * b2;
    float acc = 0.0f;
    for (int m = j; m < 16; ++m) acc += abuf[(o + 16 + i) * LDA + o + m] * tbuf[(o + m) * LDA + o + j];
    pbuf[(b2 * 16 + i) * 33 + j] = acc;
  }
  __syncthreads();
  for (int idx = tid; idx < 512; idx += kThreads) {  // T21 = -T22 P21
    const int b2 = idx >> 8, i = (idx >> 4) & 15, j = idx & 15, o = 32 * b2;
    float acc = 0.0f;
    for (int m = 0; m <= i; ++m) acc += tbuf[(o + 16 + i) * LDA + o + 16 + m] * pbuf[(b2 * 16 + m) * 33 + j];
    tbuf[(o + 16 + i) * LDA + o + j] = -acc;
  }
  __syncthreads();
  for (int idx = tid; idx < 1024; idx += kThreads) {  // P21 = A21 T11 of the two 32-row halves
    const int i = idx >> 5, j = idx & 31;
    float acc = 0.0f;
    for (int m = j; m < 32; ++m) acc += abuf[(32 + i) * LDA + m] * tbuf[m * LDA + j];
    pbuf[i * 33 + j] = acc;
  }
  __syncthreads();
  for (int idx = tid; idx < 1024; idx += kThreads) {  // T21 = -T22 P21
    const int i = idx >> 5, j = idx & 31;
    float acc = 0.0f;
    for (int m = 0; m <= i; ++m) acc += tbuf[(32 + i) * LDA + 32 + m] * pbuf[m * 33 + j];
    tbuf[(32 + i) * LDA + j] = -acc;
  }
  __syncthreads();

  // ---- Wn = -T diag(cw) K and U = T diag(cb) V
  if constexpr (kTC) {
    __half* tw = reinterpret_cast<__half*>(abuf);       // [64][LDA] fp16 T diag(cw)
    __half* tu = tw + C * LDA;                            // [64][LDA] fp16 T diag(cb)
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      const float t = tbuf[i * LDA + j];
      tw[i * LDA + j] = __float2half_rn(t * cw[j]);
      tu[i * LDA + j] = __float2half_rn(t * cb[j]);
    }
    for (int idx = tid; idx < C * P; idx += kThreads) {  // v rows over the q tile
      const int i = idx / P, c = idx % P;
      qvh[i * LD + c] = (i < L && c < V) ? static_cast<const __half*>(a.v)[(s + i) * v_row + hv * V + c]
                                         : __float2half(0.f);
    }
    __syncthreads();
    float* scratch = tbuf + warp * 256;  // T is consumed: the buffer is per-warp scratch now
    const __half* kh = reinterpret_cast<const __half*>(kraw);
    for (int t = warp; t < 2 * 4 * (P / 16); t += kWarps) {
      const bool is_u = t >= 4 * (P / 16);
      const int tt = is_u ? t - 4 * (P / 16) : t;
      const int rt = tt / (P / 16), ct = tt % (P / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int kk = 0; kk <= rt; ++kk) {  // T is lower triangular
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, (is_u ? tu : tw) + rt * 16 * LDA + kk * 16, LDA);
        wmma::load_matrix_sync(fb, (is_u ? qvh : kh) + kk * 16 * LD + ct * 16, LD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      if (is_u) {
        wmma::store_matrix_sync(out_u + rt * 16 * P + ct * 16, acc, P, wmma::mem_row_major);
      } else {
        wmma::store_matrix_sync(scratch, acc, 16, wmma::mem_row_major);
        __syncwarp();
        for (int x = lane; x < 256; x += kWarp)  // 32 lanes over the tile
          out_wn[(rt * 16 + x / 16) * P + ct * 16 + x % 16] = __float2half_rn(-scratch[x]);
        __syncwarp();
      }
    }
  } else {
    // fp32: lanes over columns c, a warp per row i (T row broadcast, K rows conflict-free)
    for (int idx = tid; idx < C * P; idx += kThreads) {
      const int i = idx / P, c = idx % P;
      float w = 0.0f, u = 0.0f;
      for (int j = 0; j <= i; ++j) {
        const float t = tbuf[i * LDA + j];
        w += t * cw[j] * to_f(kraw[j * LD + c]);
        if (j < L && c < V) u += t * cb[j] * to_f(vc[j * v_row + c]);
      }
      out_wn[idx] = from_f<T>(-w);
      out_u[idx] = u;
    }
  }
}

// ------------------------------------------------------------------------------------------ scan
struct ScanArgs {
  const unsigned char* ws;
  int64_t rec_bytes;
  Batch batch;
  void* out;
  const float* state_in;   // pool or [N, HV, K, V]; null: zeros
  float* state_out;        // pool or [N, HV, K, V]; null: not written
  int64_t state_stride;    // elements between slots / sequences
  IPtr slots;              // pool slots (slots.p null: per-sequence tensors)
  const bool* has_init;
  float* carry;            // [N, HV, K, V] running states between windows (null: one window)
  int64_t r0, r1;          // the window: chunk rows r0 .. r1 - 1 (and their workspace records)
  int HV, K, V;
};

// State row/column of sequence n's slice, or -1 when it reads zeros (in) / is not written (out).
__device__ __forceinline__ int64_t state_row(const ScanArgs& a, int n, bool in) {
  if (a.slots.p == nullptr) return n;
  const int64_t slot = a.slots[n];
  if (slot < 0) return -1;
  if (in && a.has_init != nullptr && !a.has_init[n]) return -1;
  return slot;
}

// Where sequence n's state comes from and goes to in this window, and its chunk rows here. False: the
// sequence has no chunk in this window (an empty sequence is handled in the first window only).
struct StateIO {
  const float* in;   // [K, V] slice base of this value head, or null: zeros
  float* out;        // or null: not written
  int64_t row_lo, row_hi;
};

__device__ __forceinline__ bool state_io(const ScanArgs& a, int n, int hv, StateIO& io) {
  const int64_t first = a.batch.first_chunk(n), last = a.batch.end_chunk(n);
  const int64_t head = static_cast<int64_t>(hv) * a.K * a.V;
  const int64_t carry_at = (static_cast<int64_t>(n) * a.HV) * a.K * a.V + head;
  bool starts, ends;
  if (first == last) {  // empty sequence: its initial state is its final state
    if (a.r0 != 0) return false;
    starts = ends = true;
  } else {
    if (first >= a.r1 || last <= a.r0) return false;
    starts = first >= a.r0;
    ends = last <= a.r1;
  }
  io.row_lo = first > a.r0 ? first : a.r0;
  io.row_hi = last < a.r1 ? last : a.r1;
  io.in = nullptr;
  io.out = nullptr;
  if (!starts) {
    io.in = a.carry + carry_at;
  } else if (a.state_in != nullptr) {
    const int64_t r = state_row(a, n, true);
    if (r >= 0) io.in = a.state_in + r * a.state_stride + head;
  }
  if (!ends) {
    io.out = a.carry + carry_at;
  } else if (a.state_out != nullptr) {
    const int64_t r = state_row(a, n, false);
    if (r >= 0) io.out = a.state_out + r * a.state_stride + head;
  }
  return true;
}

template <int P>
struct ScanLayoutH {
  static constexpr int LD = P + 8;       // half row stride of the [64, P] operands
  static constexpr int LDS = kScanBV + 8;  // half row stride of S's copy and V'
  static constexpr int sop = 0;                       // half [P][LDS]
  static constexpr int wn = sop + P * LDS * 2;        // half [64][LD]
  static constexpr int qs = wn + C * LD * 2;          // half [64][LD]
  static constexpr int ks = qs + C * LD * 2;          // half [64][LD]
  static constexpr int aq = ks + C * LD * 2;          // half [64][72]
  static constexpr int vp = aq + C * 72 * 2;          // half [64][LDS]
  static constexpr int scratch = vp + C * LDS * 2;    // f32 [8][256]
  static constexpr int ec = scratch + kWarps * 256 * 4;
  static constexpr int bytes = ec + 128;
  static_assert(bytes <= kMaxSmem, "scan shared memory over the SM70 budget");
};

// Copy rows x cols halves (row stride src_ld in global, dst_ld in shared; both multiples of 8) with 16-byte
// vectors.
__device__ __forceinline__ void copy_tile(__half* dst, int dst_ld, const __half* src, int src_ld, int rows,
                                          int cols) {
  const int vpr = cols / 8;
  for (int idx = threadIdx.x; idx < rows * vpr; idx += kThreads) {
    const int i = idx / vpr, c = (idx % vpr) * 8;
    *reinterpret_cast<uint4*>(dst + i * dst_ld + c) = *reinterpret_cast<const uint4*>(src + i * src_ld + c);
  }
}

template <int P>
__global__ void __launch_bounds__(kThreads) gdn_scan_kernel_f16(ScanArgs a) {
  using SL = ScanLayoutH<P>;
  constexpr int LD = SL::LD, LDS = SL::LDS;
  constexpr int NT = (P / 16) * (kScanBV / 16);  // state tiles
  constexpr int TPW = (NT + kWarps - 1) / kWarps;  // state tiles per warp (at most)
  extern __shared__ __align__(128) unsigned char smem[];
  __half* sop = reinterpret_cast<__half*>(smem + SL::sop);
  __half* wn = reinterpret_cast<__half*>(smem + SL::wn);
  __half* qs = reinterpret_cast<__half*>(smem + SL::qs);
  __half* ks = reinterpret_cast<__half*>(smem + SL::ks);
  __half* aq = reinterpret_cast<__half*>(smem + SL::aq);
  __half* vp = reinterpret_cast<__half*>(smem + SL::vp);
  float* ec_s = reinterpret_cast<float*>(smem + SL::ec);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  float* scratch = reinterpret_cast<float*>(smem + SL::scratch) + warp * 256;

  const int nvb = (a.V + kScanBV - 1) / kScanBV;
  const int vb = static_cast<int>(blockIdx.x % nvb);
  const int64_t pair = blockIdx.x / nvb;
  const int hv = static_cast<int>(pair % a.HV);
  const int n = static_cast<int>(pair / a.HV);
  const int K = a.K, V = a.V;
  StateIO io;
  if (!state_io(a, n, hv, io)) return;
  const int64_t s0 = a.batch.start(n), e0 = a.batch.end(n);
  const int64_t first = a.batch.first_chunk(n);
  const Record<__half> rec{P};

  // State tiles owned by this warp: tile t -> rows 16 (t / 2), columns 16 (t % 2) of the [P, 32] slice.
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> S[TPW];
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int t = warp + i * kWarps;
    wmma::fill_fragment(S[i], 0.0f);
    if (t < NT && io.in != nullptr) {
      const int r0 = (t / 2) * 16, c0 = vb * kScanBV + (t % 2) * 16;
      const float* src = io.in;
      for (int x = lane; x < 256; x += kWarp) {
        const int rr = r0 + x / 16, cc = c0 + x % 16;
        scratch[x] = (rr < K && cc < V) ? src[static_cast<int64_t>(rr) * V + cc] : 0.0f;
      }
      __syncwarp();
      wmma::load_matrix_sync(S[i], scratch, 16, wmma::mem_row_major);
      __syncwarp();
    }
  }

  const int rt = warp >> 1, ct = warp & 1;  // this warp's V' / O tile (8 tiles of the [64, 32] block)
  for (int64_t row = io.row_lo; row < io.row_hi; ++row) {
    const int64_t cs = s0 + (row - first) * C;
    const int L = static_cast<int>(e0 - cs < C ? e0 - cs : C);
    const unsigned char* base = a.ws + ((row - a.r0) * a.HV + hv) * a.rec_bytes;
    copy_tile(wn, LD, reinterpret_cast<const __half*>(base + rec.wn()), P, C, P);
    copy_tile(qs, LD, reinterpret_cast<const __half*>(base + rec.qs()), P, C, P);
    copy_tile(ks, LD, reinterpret_cast<const __half*>(base + rec.ks()), P, C, P);
    copy_tile(aq, 72, reinterpret_cast<const __half*>(base + rec.aq()), C, C, C);
    if (tid == 0) *ec_s = *reinterpret_cast<const float*>(base + rec.ec());
    // fp16 copy of the state, the operand of this chunk's products
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int t = warp + i * kWarps;
      if (t < NT) {
        wmma::store_matrix_sync(scratch, S[i], 16, wmma::mem_row_major);
        __syncwarp();
        for (int x = lane; x < 256; x += kWarp)
          sop[((t / 2) * 16 + x / 16) * LDS + (t % 2) * 16 + x % 16] = __float2half_rn(scratch[x]);
        __syncwarp();
      }
    }
    __syncthreads();

    // V' = U + Wn S and the state part of O: Qs S
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> vnew, o;
    const float* u = reinterpret_cast<const float*>(base + rec.u()) + rt * 16 * P + vb * kScanBV + ct * 16;
    wmma::load_matrix_sync(vnew, u, P, wmma::mem_row_major);
    wmma::fill_fragment(o, 0.0f);
#pragma unroll
    for (int kk = 0; kk < P / 16; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fw, fq;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fs;
      wmma::load_matrix_sync(fs, sop + kk * 16 * LDS + ct * 16, LDS);
      wmma::load_matrix_sync(fw, wn + rt * 16 * LD + kk * 16, LD);
      wmma::load_matrix_sync(fq, qs + rt * 16 * LD + kk * 16, LD);
      wmma::mma_sync(vnew, fw, fs, vnew);
      wmma::mma_sync(o, fq, fs, o);
    }
    wmma::store_matrix_sync(scratch, vnew, 16, wmma::mem_row_major);
    __syncwarp();
    for (int x = lane; x < 256; x += kWarp)
      vp[(rt * 16 + x / 16) * LDS + ct * 16 + x % 16] = __float2half_rn(scratch[x]);
    __syncthreads();

    // O += Aqk V' (lower triangular), stored; S <- e^{G_last} S + Ks^T V'
    for (int kk = 0; kk <= rt; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fv;
      wmma::load_matrix_sync(fa, aq + rt * 16 * 72 + kk * 16, 72);
      wmma::load_matrix_sync(fv, vp + kk * 16 * LDS + ct * 16, LDS);
      wmma::mma_sync(o, fa, fv, o);
    }
    wmma::store_matrix_sync(scratch, o, 16, wmma::mem_row_major);
    __syncwarp();
    __half* out = static_cast<__half*>(a.out);
    for (int x = lane; x < 256; x += kWarp) {
      const int i = rt * 16 + x / 16, col = vb * kScanBV + ct * 16 + x % 16;
      if (i < L && col < V) out[((cs + i) * a.HV + hv) * V + col] = __float2half_rn(scratch[x]);
    }
    const float ec = *ec_s;
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int t = warp + i * kWarps;
      if (t < NT) {
        const int srt = t / 2, sct = t % 2;
#pragma unroll
        for (int x = 0; x < S[i].num_elements; ++x) S[i].x[x] *= ec;  // a uniform scale of the whole tile
#pragma unroll
        for (int kk = 0; kk < C / 16; ++kk) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::col_major> fk;  // Ks^T
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fv;
          wmma::load_matrix_sync(fk, ks + kk * 16 * LD + srt * 16, LD);
          wmma::load_matrix_sync(fv, vp + kk * 16 * LDS + sct * 16, LDS);
          wmma::mma_sync(S[i], fk, fv, S[i]);
        }
      }
    }
    __syncthreads();  // the next chunk overwrites every shared tile
  }

  if (io.out == nullptr) return;
  float* dst = io.out;
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int t = warp + i * kWarps;
    if (t < NT) {
      wmma::store_matrix_sync(scratch, S[i], 16, wmma::mem_row_major);
      __syncwarp();
      const int r0 = (t / 2) * 16, c0 = vb * kScanBV + (t % 2) * 16;
      for (int x = lane; x < 256; x += kWarp) {
        const int rr = r0 + x / 16, cc = c0 + x % 16;
        if (rr < K && cc < V) dst[static_cast<int64_t>(rr) * V + cc] = scratch[x];
      }
      __syncwarp();
    }
  }
}

template <int P>
struct ScanLayoutF {
  static constexpr int LDS = kScanBV + 1;
  static constexpr int st = 0;                    // f32 [P][LDS] the state slice
  static constexpr int vp = st + P * LDS * 4;     // f32 [64][LDS] V'
  static constexpr int bytes = vp + C * LDS * 4;
  static_assert(bytes <= 48 * 1024, "fp32 scan uses static-sized shared memory");
};

template <int P>
__global__ void __launch_bounds__(kThreads) gdn_scan_kernel_f32(ScanArgs a) {
  using SL = ScanLayoutF<P>;
  constexpr int LDS = SL::LDS;
  extern __shared__ __align__(128) unsigned char smem[];
  float* S = reinterpret_cast<float*>(smem + SL::st);
  float* vp = reinterpret_cast<float*>(smem + SL::vp);
  const int tid = threadIdx.x;
  const int c = tid % kWarp, grp = tid / kWarp;  // 32 lanes: lane = column of the V block, warp = row group

  const int nvb = (a.V + kScanBV - 1) / kScanBV;
  const int vb = static_cast<int>(blockIdx.x % nvb);
  const int64_t pair = blockIdx.x / nvb;
  const int hv = static_cast<int>(pair % a.HV);
  const int n = static_cast<int>(pair / a.HV);
  const int K = a.K, V = a.V;
  const int col = vb * kScanBV + c;
  StateIO io;
  if (!state_io(a, n, hv, io)) return;
  const int64_t s0 = a.batch.start(n), e0 = a.batch.end(n);
  const int64_t first = a.batch.first_chunk(n);
  const Record<float> rec{P};
  const float* src = io.in;
  for (int kr = grp; kr < P; kr += kWarps)
    S[kr * LDS + c] = (src != nullptr && kr < K && col < V) ? src[static_cast<int64_t>(kr) * V + col] : 0.0f;
  __syncthreads();

  constexpr int RPG = C / kWarps;  // V' / O rows per warp
  for (int64_t row = io.row_lo; row < io.row_hi; ++row) {
    const int64_t cs = s0 + (row - first) * C;
    const int L = static_cast<int>(e0 - cs < C ? e0 - cs : C);
    const unsigned char* base = a.ws + ((row - a.r0) * a.HV + hv) * a.rec_bytes;
    const float* wn = reinterpret_cast<const float*>(base + rec.wn());
    const float* qs = reinterpret_cast<const float*>(base + rec.qs());
    const float* ks = reinterpret_cast<const float*>(base + rec.ks());
    const float* aq = reinterpret_cast<const float*>(base + rec.aq());
    const float* u = reinterpret_cast<const float*>(base + rec.u());
    const float ec = *reinterpret_cast<const float*>(base + rec.ec());
    float av[RPG], ao[RPG];
#pragma unroll
    for (int ii = 0; ii < RPG; ++ii) {
      av[ii] = u[(grp * RPG + ii) * P + vb * kScanBV + c];
      ao[ii] = 0.0f;
    }
    for (int kk = 0; kk < P; kk += 4) {
      const float s_0 = S[kk * LDS + c], s_1 = S[(kk + 1) * LDS + c];
      const float s_2 = S[(kk + 2) * LDS + c], s_3 = S[(kk + 3) * LDS + c];
#pragma unroll
      for (int ii = 0; ii < RPG; ++ii) {
        const int i = grp * RPG + ii;
        const float4 w4 = *reinterpret_cast<const float4*>(wn + i * P + kk);  // warp-uniform: a broadcast
        const float4 q4 = *reinterpret_cast<const float4*>(qs + i * P + kk);
        av[ii] += w4.x * s_0 + w4.y * s_1 + w4.z * s_2 + w4.w * s_3;
        ao[ii] += q4.x * s_0 + q4.y * s_1 + q4.z * s_2 + q4.w * s_3;
      }
    }
#pragma unroll
    for (int ii = 0; ii < RPG; ++ii) vp[(grp * RPG + ii) * LDS + c] = av[ii];
    __syncthreads();
    float* out = static_cast<float*>(a.out);
#pragma unroll
    for (int ii = 0; ii < RPG; ++ii) {
      const int i = grp * RPG + ii;
      float acc = ao[ii];
      for (int j = 0; j <= i; ++j) acc += aq[i * C + j] * vp[j * LDS + c];
      if (i < L && col < V) out[((cs + i) * a.HV + hv) * V + col] = acc;
    }
    for (int kr = grp; kr < P; kr += kWarps) {
      float acc = ec * S[kr * LDS + c];
      for (int j = 0; j < C; ++j) acc += ks[j * P + kr] * vp[j * LDS + c];
      S[kr * LDS + c] = acc;
    }
    __syncthreads();
  }

  if (io.out == nullptr) return;
  float* dst = io.out;
  for (int kr = grp; kr < K; kr += kWarps)
    if (col < V) dst[static_cast<int64_t>(kr) * V + col] = S[kr * LDS + c];
}

// ------------------------------------------------------------------------------------------ host side
int pad_dim(int K, int V) {
  const int m = K > V ? K : V;
  return m <= 32 ? 32 : m <= 64 ? 64 : m <= 128 ? 128 : -1;
}

template <typename T, int P>
cudaError_t launch_prepare(const PrepArgs& a, int64_t blocks, cudaStream_t stream) {
  constexpr int bytes = PrepLayout<T, P>::bytes;
  static unsigned long long done = 0;
  const cudaError_t attr = smem_limit(gdn_prepare_kernel<T, P>, bytes, done);
  if (attr != cudaSuccess) return attr;
  gdn_prepare_kernel<T, P><<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <int P>
cudaError_t launch_scan(int dtype, const ScanArgs& a, int64_t blocks, cudaStream_t stream) {
  if (dtype == kF16) {
    constexpr int bytes = ScanLayoutH<P>::bytes;
    static unsigned long long done = 0;
    const cudaError_t attr = smem_limit(gdn_scan_kernel_f16<P>, bytes, done);
    if (attr != cudaSuccess) return attr;
    gdn_scan_kernel_f16<P><<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(a);
  } else {
    gdn_scan_kernel_f32<P><<<static_cast<unsigned>(blocks), kThreads, ScanLayoutF<P>::bytes, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t gdn_record_bytes(int dtype, int K, int V) {
  const int P = pad_dim(K, V);
  if (P < 0) return -1;
  return dtype == kF16 ? Record<__half>{P}.bytes() : Record<float>{P}.bytes();
}

cudaError_t gdn_chunk_table(const void* cu, int cu64, int N, int32_t* seq_first, cudaStream_t stream) {
  gdn_chunk_table_kernel<<<1, kThreads, 0, stream>>>(IPtr{cu, cu64}, N, seq_first);
  return cudaGetLastError();
}

cudaError_t gdn_prepare(int dtype, const void* q, const void* k, const void* v, GatingArgs gating, const void* cu,
                        int cu64, const int32_t* seq_first, int N, int64_t r0, int64_t r1, void* ws, float scale,
                        int use_l2, int64_t T, int H, int HV, int K, int V, cudaStream_t stream) {
  const int P = pad_dim(K, V);
  if (P < 0) return cudaErrorInvalidValue;
  const int64_t blocks = (r1 - r0) * HV;
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  PrepArgs a{q, k, v, make_gating(gating), Batch{IPtr{cu, cu64}, seq_first, N, T},
             static_cast<unsigned char*>(ws), gdn_record_bytes(dtype, K, V), r0, scale, use_l2, H, HV, K, V};
  if (dtype == kF16) {
    if (P == 32) return launch_prepare<__half, 32>(a, blocks, stream);
    if (P == 64) return launch_prepare<__half, 64>(a, blocks, stream);
    return launch_prepare<__half, 128>(a, blocks, stream);
  }
  if (P == 32) return launch_prepare<float, 32>(a, blocks, stream);
  if (P == 64) return launch_prepare<float, 64>(a, blocks, stream);
  return launch_prepare<float, 128>(a, blocks, stream);
}

cudaError_t gdn_scan(int dtype, const void* ws, const int32_t* seq_first, const void* cu, int cu64, void* out,
                     const float* state_in, float* state_out, int64_t state_stride, const void* slots, int slots64,
                     const bool* has_init, float* carry, int64_t r0, int64_t r1, int N, int64_t T, int HV, int K,
                     int V, cudaStream_t stream) {
  const int P = pad_dim(K, V);
  if (P < 0) return cudaErrorInvalidValue;
  const int64_t blocks = static_cast<int64_t>(N) * HV * ((V + kScanBV - 1) / kScanBV);
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  ScanArgs a{static_cast<const unsigned char*>(ws), gdn_record_bytes(dtype, K, V),
             Batch{IPtr{cu, cu64}, seq_first, N, T}, out, state_in, state_out, state_stride,
             IPtr{slots, slots64}, has_init, carry, r0, r1, HV, K, V};
  if (P == 32) return launch_scan<32>(dtype, a, blocks, stream);
  if (P == 64) return launch_scan<64>(dtype, a, blocks, stream);
  return launch_scan<128>(dtype, a, blocks, stream);
}

}  // namespace q35
