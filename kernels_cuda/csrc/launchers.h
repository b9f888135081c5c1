// Host launchers of the cuda_sm70 kernels: plain pointers and a stream, no torch types, so the .cu files
// build without torch headers (binding.cpp turns tensors into these arguments). Each returns a cudaError_t
// (the launch's), or cudaErrorInvalidValue for a shape a kernel does not take.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace q35 {

// dtype codes shared with binding.cpp: activations are fp16 or fp32 (bf16 is converted by the Python layer).
enum DType : int { kF32 = 0, kF16 = 1 };

struct GatingArgs {
  const float* g;     // fp32 log-decay, or null with raw gating
  const void* beta;   // dtype beta_half
  const void* a;      // raw gating: a, b (dtype ab_half), A_log, dt_bias (their own dtype flags)
  const void* b;
  const void* A_log;
  const void* dt_bias;
  int beta_half, ab_half, alog_half, dtb_half;
  int64_t stride;     // elements between token rows of the gating tensors
  int raw;
};

// ---------------------------------------------------------------- norms
cudaError_t rms_norm(int dtype, const void* x, const void* z, int z_half, const void* residual, const void* w,
                     int w_half, void* y, void* s, int64_t rows, int n, float eps, int gated, int zero_centered,
                     cudaStream_t stream);

// ---------------------------------------------------------------- causal conv1d
cudaError_t conv_prefill(int dtype, const void* x, const void* w, int w_half, const void* bias, int bias_half,
                         void* y, const void* cu, int cu64, const void* pool, int64_t pool_stride,
                         const void* slots, int slots64, const bool* has_init, int64_t T, int D, int W, int N,
                         int silu, cudaStream_t stream);
cudaError_t conv_prefill_history(int dtype, const void* x, void* pool, int64_t pool_stride, const void* cu, int cu64,
                                 const void* slots, int slots64, const bool* has_init, int64_t T, int D, int W,
                                 int N, cudaStream_t stream);
cudaError_t conv_update(int dtype, const void* x, const void* w, int w_half, const void* bias, int bias_half,
                        void* y, void* pool, int64_t pool_stride, const void* slots, int slots64, int B, int D,
                        int W, int silu, cudaStream_t stream);

// ---------------------------------------------------------------- GDN
cudaError_t gdn_step(int dtype, const void* q, const void* k, const void* v, GatingArgs gating, float* pool,
                     int64_t pool_stride, const void* slots, int slots64, void* out, float scale, int use_l2,
                     int B, int T, int H, int HV, int K, int V, cudaStream_t stream);

// Chunked prefill, three launches (see gdn_chunk.cu). seq_first [N + 1] int32: each sequence's first chunk
// row, then the number of chunks (varlen only; cu null means one sequence of T tokens and no table).
cudaError_t gdn_chunk_table(const void* cu, int cu64, int N, int32_t* seq_first, cudaStream_t stream);
// Bytes of one (chunk row, value head) workspace record; -1 for head dims over 128.
int64_t gdn_record_bytes(int dtype, int K, int V);
// A window of chunk rows r0 .. r1 - 1 (of T / 64 + N rows for a varlen batch, ceil(T / 64) otherwise): the
// workspace holds (r1 - r0) * HV records; the scan of the window follows its prepare, windows in order.
cudaError_t gdn_prepare(int dtype, const void* q, const void* k, const void* v, GatingArgs gating, const void* cu,
                        int cu64, const int32_t* seq_first, int N, int64_t r0, int64_t r1, void* ws, float scale,
                        int use_l2, int64_t T, int H, int HV, int K, int V, cudaStream_t stream);
// State in: pool (slots, has_init) or a [N, HV, K, V] tensor or zeros; out: pool slot, tensor, or none.
// carry [N, HV, K, V] fp32: the running states of sequences that cross a window boundary (null: one window).
cudaError_t gdn_scan(int dtype, const void* ws, const int32_t* seq_first, const void* cu, int cu64, void* out,
                     const float* state_in, float* state_out, int64_t state_stride, const void* slots, int slots64,
                     const bool* has_init, float* carry, int64_t r0, int64_t r1, int N, int64_t T, int HV, int K,
                     int V, cudaStream_t stream);

// ---------------------------------------------------------------- MoE
cudaError_t moe_route(int logits_dtype, const void* logits, float* weights, int32_t* ids, int M, int E, int top_k,
                      int renormalize, cudaStream_t stream);
// Picks grouped by local expert, each group padded to block_m rows: sorted [cap] pick ids (m * k + j, -1 pad),
// block_expert [max_blocks] (-1 past the end), meta [2] (used blocks, used rows).
cudaError_t moe_align(const int32_t* ids, const void* expert_map, int map64, int M, int top_k, int E_local,
                      int block_m, int32_t* sorted, int32_t* block_expert, int32_t* meta, int max_blocks,
                      cudaStream_t stream);
// Rows per alignment block that the GEMMs of a dtype take: tiled (gemv 0) or weight-streaming (gemv 1).
int moe_block_m(int dtype, int gemv);
cudaError_t moe_gate_up(int dtype, const void* x, const void* w13, void* h, const int32_t* sorted,
                        const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m, int M,
                        int top_k, int H, int I, cudaStream_t stream);
cudaError_t moe_down(int dtype, const void* h, const void* w2, void* y, const float* weights, const int32_t* sorted,
                     const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m, int M,
                     int top_k, int H, int I, cudaStream_t stream);
// The weight-streaming form for a few tokens (alignment blocks of moe_block_m(dtype, 1) picks), see moe.cu.
cudaError_t moe_gemv_gate_up(int dtype, const void* x, const void* w13, void* h, const int32_t* sorted,
                             const int32_t* block_expert, const int32_t* meta, int max_blocks, int block_m,
                             int top_k, int H, int I, cudaStream_t stream);
cudaError_t moe_gemv_down(int dtype, const void* h, const void* w2, void* y, const float* weights,
                          const int32_t* sorted, const int32_t* block_expert, const int32_t* meta, int max_blocks,
                          int block_m, int top_k, int H, int I, cudaStream_t stream);
cudaError_t moe_combine(int dtype, const void* y, const int32_t* ids, const void* expert_map, int map64,
                        const void* extra, void* out, int M, int top_k, int H, cudaStream_t stream);

}  // namespace q35
