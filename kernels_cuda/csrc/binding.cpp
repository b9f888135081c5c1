// Torch binding of the cuda_sm70 launchers: tensors in, pointers and the current stream out. The Python layer
// (kernels_cuda/sm70.py) validates shapes and prepares dtypes and layouts; the checks here guard the pointer
// casts (dtype, device, contiguity) so that a mistake there raises instead of reading the wrong memory.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>

#include "launchers.h"

namespace {

using at::Tensor;
using OptT = std::optional<Tensor>;

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "cuda_sm70 ", what, ": ", cudaGetErrorString(err));
}

int act_code(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "cuda_sm70: ", name, " must be a CUDA tensor");
  if (t.scalar_type() == at::kHalf) return q35::kF16;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "cuda_sm70: ", name, " must be float16 or float32, got ",
              t.scalar_type());
  return q35::kF32;
}

// A float tensor of either dtype whose pointer is read through an fp16 / fp32 flag.
int half_flag(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat, "cuda_sm70: ", name,
              " must be float16 or float32, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? 1 : 0;
}

int index_flag(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "cuda_sm70: ", name,
              " must be int32 or int64");
  TORCH_CHECK(t.is_contiguous(), "cuda_sm70: ", name, " must be contiguous");
  return t.scalar_type() == at::kLong ? 1 : 0;
}

void contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "cuda_sm70: ", name, " must be contiguous");
}

const void* ptr(const OptT& t) { return t.has_value() ? t->data_ptr() : nullptr; }

cudaStream_t stream_of(const Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

// ---------------------------------------------------------------- norms
void rms_norm(const Tensor& x, const OptT& z, const OptT& residual, const Tensor& w, const Tensor& y, const OptT& s,
              double eps, bool gated, bool zero_centered) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int dt = act_code(x, "x");
  contiguous(x, "x");
  contiguous(y, "y");
  contiguous(w, "weight");
  if (z) contiguous(*z, "z");
  if (residual) contiguous(*residual, "residual");
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  check_cuda(q35::rms_norm(dt, x.data_ptr(), ptr(z), z ? half_flag(*z, "z") : 0, ptr(residual), w.data_ptr(),
                           half_flag(w, "weight"), y.data_ptr(), s ? s->data_ptr() : nullptr, rows,
                           static_cast<int>(n), static_cast<float>(eps), gated, zero_centered, stream_of(x)),
             "rms_norm");
}

// ---------------------------------------------------------------- conv1d
void conv_prefill(const Tensor& x, const Tensor& w, const OptT& bias, const Tensor& y, const OptT& cu,
                  const OptT& pool, const OptT& slots, const OptT& has_init, bool silu) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int dt = act_code(x, "x");
  contiguous(x, "x");
  contiguous(w, "weight");
  const int64_t T = x.size(0);
  const int D = static_cast<int>(x.size(1)), W = static_cast<int>(w.size(1));
  const int N = cu ? static_cast<int>(cu->numel()) - 1 : 1;
  const int cu64 = cu ? index_flag(*cu, "cu_seqlens") : 0;
  const int s64 = slots ? index_flag(*slots, "conv_slots") : 0;
  const int64_t pstride = pool ? pool->stride(0) : 0;
  const bool* hi = has_init ? has_init->data_ptr<bool>() : nullptr;
  check_cuda(q35::conv_prefill(dt, x.data_ptr(), w.data_ptr(), half_flag(w, "weight"), ptr(bias),
                               bias ? half_flag(*bias, "bias") : 0, y.data_ptr(), ptr(cu), cu64, ptr(pool), pstride,
                               ptr(slots), s64, hi, T, D, W, N, silu, stream_of(x)),
             "conv_prefill");
  if (pool)
    check_cuda(q35::conv_prefill_history(dt, x.data_ptr(), pool->data_ptr(), pstride, ptr(cu), cu64, ptr(slots), s64,
                                         hi, T, D, W, N, stream_of(x)),
               "conv_prefill history");
}

void conv_update(const Tensor& x, const Tensor& w, const OptT& bias, const Tensor& y, const Tensor& pool,
                 const Tensor& slots, bool silu) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int dt = act_code(x, "x");
  contiguous(x, "x");
  contiguous(w, "weight");
  check_cuda(q35::conv_update(dt, x.data_ptr(), w.data_ptr(), half_flag(w, "weight"), ptr(bias),
                              bias ? half_flag(*bias, "bias") : 0, y.data_ptr(), pool.data_ptr(), pool.stride(0),
                              slots.data_ptr(), index_flag(slots, "conv_slots"), static_cast<int>(x.size(0)),
                              static_cast<int>(x.size(1)), static_cast<int>(w.size(1)), silu, stream_of(x)),
             "conv_update");
}

// ---------------------------------------------------------------- GDN
q35::GatingArgs gating_args(const OptT& g, const OptT& beta, const OptT& a, const OptT& b, const OptT& A_log,
                            const OptT& dt_bias, int64_t stride) {
  q35::GatingArgs ga{};
  ga.stride = stride;
  if (g) {
    TORCH_CHECK(g->scalar_type() == at::kFloat, "cuda_sm70: g must be float32");
    ga.g = g->data_ptr<float>();
    ga.beta = beta->data_ptr();
    ga.beta_half = half_flag(*beta, "beta");
    ga.raw = 0;
  } else {
    ga.a = a->data_ptr();
    ga.b = b->data_ptr();
    TORCH_CHECK(a->scalar_type() == b->scalar_type(), "cuda_sm70: a and b must have one dtype");
    ga.ab_half = half_flag(*a, "a");
    ga.A_log = A_log->data_ptr();
    ga.alog_half = half_flag(*A_log, "A_log");
    ga.dt_bias = dt_bias->data_ptr();
    ga.dtb_half = half_flag(*dt_bias, "dt_bias");
    ga.raw = 1;
  }
  return ga;
}

void gdn_step(const Tensor& q, const Tensor& k, const Tensor& v, const OptT& g, const OptT& beta, const OptT& a,
              const OptT& b, const OptT& A_log, const OptT& dt_bias, int64_t gate_stride, const Tensor& pool,
              const Tensor& slots, const Tensor& out, double scale, bool use_l2) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int dt = act_code(q, "q");
  contiguous(q, "q");
  contiguous(k, "k");
  contiguous(v, "v");
  contiguous(out, "out");
  TORCH_CHECK(pool.scalar_type() == at::kFloat, "cuda_sm70: state_pool must be float32");
  check_cuda(q35::gdn_step(dt, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                           gating_args(g, beta, a, b, A_log, dt_bias, gate_stride), pool.data_ptr<float>(),
                           pool.stride(0), slots.data_ptr(), index_flag(slots, "state_slots"), out.data_ptr(),
                           static_cast<float>(scale), use_l2, static_cast<int>(q.size(0)),
                           static_cast<int>(q.size(1)), static_cast<int>(q.size(2)), static_cast<int>(v.size(2)),
                           static_cast<int>(q.size(3)), static_cast<int>(v.size(3)), stream_of(q)),
             "gdn_step");
}

int64_t gdn_record_bytes(int64_t dtype, int64_t K, int64_t V) {
  return q35::gdn_record_bytes(static_cast<int>(dtype), static_cast<int>(K), static_cast<int>(V));
}

void gdn_chunk_table(const Tensor& cu, const Tensor& seq_first) {
  const c10::cuda::CUDAGuard guard(cu.device());
  TORCH_CHECK(seq_first.scalar_type() == at::kInt && seq_first.numel() == cu.numel(),
              "cuda_sm70: seq_first must be int32 [N + 1]");
  check_cuda(q35::gdn_chunk_table(cu.data_ptr(), index_flag(cu, "cu_seqlens"), static_cast<int>(cu.numel()) - 1,
                                  seq_first.data_ptr<int32_t>(), stream_of(cu)),
             "gdn_chunk_table");
}

void gdn_prepare(const Tensor& q, const Tensor& k, const Tensor& v, const OptT& g, const OptT& beta, const OptT& a,
                 const OptT& b, const OptT& A_log, const OptT& dt_bias, int64_t gate_stride, const OptT& cu,
                 const OptT& seq_first, int64_t r0, int64_t r1, const Tensor& ws, double scale, bool use_l2) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int dt = act_code(q, "q");
  contiguous(q, "q");
  contiguous(k, "k");
  contiguous(v, "v");
  const int N = cu ? static_cast<int>(cu->numel()) - 1 : 1;
  check_cuda(q35::gdn_prepare(dt, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                              gating_args(g, beta, a, b, A_log, dt_bias, gate_stride), ptr(cu),
                              cu ? index_flag(*cu, "cu_seqlens") : 0,
                              seq_first ? seq_first->data_ptr<int32_t>() : nullptr, N, r0, r1, ws.data_ptr(),
                              static_cast<float>(scale), use_l2, q.size(0), static_cast<int>(q.size(1)),
                              static_cast<int>(v.size(1)), static_cast<int>(q.size(2)), static_cast<int>(v.size(2)),
                              stream_of(q)),
             "gdn_prepare");
}

void gdn_scan(const Tensor& ws, const OptT& seq_first, const OptT& cu, const Tensor& out, const OptT& state_in,
              const OptT& state_out, int64_t state_stride, const OptT& slots, const OptT& has_init, const OptT& carry,
              int64_t r0, int64_t r1, int64_t N, int64_t T, int64_t K) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int dt = act_code(out, "out");
  contiguous(out, "out");
  auto fptr = [](const OptT& t) -> float* {
    if (!t) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat, "cuda_sm70: states must be float32");
    return t->data_ptr<float>();
  };
  check_cuda(q35::gdn_scan(dt, ws.data_ptr(), seq_first ? seq_first->data_ptr<int32_t>() : nullptr, ptr(cu),
                           cu ? index_flag(*cu, "cu_seqlens") : 0, out.data_ptr(), fptr(state_in), fptr(state_out),
                           state_stride, ptr(slots), slots ? index_flag(*slots, "state_slots") : 0,
                           has_init ? has_init->data_ptr<bool>() : nullptr, fptr(carry), r0, r1,
                           static_cast<int>(N), T, static_cast<int>(out.size(1)), static_cast<int>(K),
                           static_cast<int>(out.size(2)), stream_of(out)),
             "gdn_scan");
}

// ---------------------------------------------------------------- MoE
void moe_route(const Tensor& logits, const Tensor& weights, const Tensor& ids, int64_t top_k, bool renormalize) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int dt = act_code(logits, "router_logits");
  contiguous(logits, "router_logits");
  check_cuda(q35::moe_route(dt, logits.data_ptr(), weights.data_ptr<float>(), ids.data_ptr<int32_t>(),
                            static_cast<int>(logits.size(0)), static_cast<int>(logits.size(1)),
                            static_cast<int>(top_k), renormalize, stream_of(logits)),
             "moe_route");
}

int64_t moe_block_m(int64_t dtype, bool gemv) { return q35::moe_block_m(static_cast<int>(dtype), gemv); }

void moe_align(const Tensor& ids, const OptT& expert_map, int64_t E_local, int64_t block_m, const Tensor& sorted,
               const Tensor& block_expert, const Tensor& meta) {
  const c10::cuda::CUDAGuard guard(ids.device());
  TORCH_CHECK(ids.scalar_type() == at::kInt, "cuda_sm70: topk_ids must be int32 here");
  contiguous(ids, "topk_ids");
  check_cuda(q35::moe_align(ids.data_ptr<int32_t>(), ptr(expert_map), expert_map ? index_flag(*expert_map, "expert_map") : 0,
                            static_cast<int>(ids.size(0)), static_cast<int>(ids.size(1)), static_cast<int>(E_local),
                            static_cast<int>(block_m), sorted.data_ptr<int32_t>(), block_expert.data_ptr<int32_t>(),
                            meta.data_ptr<int32_t>(), static_cast<int>(block_expert.numel()), stream_of(ids)),
             "moe_align");
}

void moe_gate_up(const Tensor& x, const Tensor& w13, const Tensor& h, const Tensor& sorted,
                 const Tensor& block_expert, const Tensor& meta, int64_t block_m, int64_t top_k, bool gemv) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int dt = act_code(x, "x");
  contiguous(x, "x");
  contiguous(w13, "w13");
  const int H = static_cast<int>(x.size(1)), I = static_cast<int>(w13.size(1) / 2);
  const int mb = static_cast<int>(block_expert.numel());
  cudaError_t err;
  if (gemv)
    err = q35::moe_gemv_gate_up(dt, x.data_ptr(), w13.data_ptr(), h.data_ptr(), sorted.data_ptr<int32_t>(),
                                block_expert.data_ptr<int32_t>(), meta.data_ptr<int32_t>(), mb,
                                static_cast<int>(block_m), static_cast<int>(top_k), H, I, stream_of(x));
  else
    err = q35::moe_gate_up(dt, x.data_ptr(), w13.data_ptr(), h.data_ptr(), sorted.data_ptr<int32_t>(),
                           block_expert.data_ptr<int32_t>(), meta.data_ptr<int32_t>(), mb, static_cast<int>(block_m),
                           static_cast<int>(x.size(0)), static_cast<int>(top_k), H, I, stream_of(x));
  check_cuda(err, "moe gate_up");
}

void moe_down(const Tensor& h, const Tensor& w2, const Tensor& y, const Tensor& weights, const Tensor& sorted,
              const Tensor& block_expert, const Tensor& meta, int64_t block_m, int64_t top_k, bool gemv) {
  const c10::cuda::CUDAGuard guard(h.device());
  const int dt = act_code(h, "h");
  contiguous(w2, "w2");
  contiguous(weights, "topk_weights");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "cuda_sm70: topk_weights must be float32 here");
  const int H = static_cast<int>(w2.size(1)), I = static_cast<int>(w2.size(2));
  const int mb = static_cast<int>(block_expert.numel());
  cudaError_t err;
  if (gemv)
    err = q35::moe_gemv_down(dt, h.data_ptr(), w2.data_ptr(), y.data_ptr(), weights.data_ptr<float>(),
                             sorted.data_ptr<int32_t>(), block_expert.data_ptr<int32_t>(), meta.data_ptr<int32_t>(), mb,
                             static_cast<int>(block_m), static_cast<int>(top_k), H, I, stream_of(h));
  else
    err = q35::moe_down(dt, h.data_ptr(), w2.data_ptr(), y.data_ptr(), weights.data_ptr<float>(),
                        sorted.data_ptr<int32_t>(), block_expert.data_ptr<int32_t>(), meta.data_ptr<int32_t>(), mb,
                        static_cast<int>(block_m), 0, static_cast<int>(top_k), H, I, stream_of(h));
  check_cuda(err, "moe down");
}

void moe_combine(const Tensor& y, const Tensor& ids, const OptT& expert_map, const OptT& extra, const Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int dt = act_code(out, "out");
  if (extra) contiguous(*extra, "shared expert output");
  check_cuda(q35::moe_combine(dt, y.data_ptr(), ids.data_ptr<int32_t>(), ptr(expert_map),
                              expert_map ? index_flag(*expert_map, "expert_map") : 0, ptr(extra), out.data_ptr(),
                              static_cast<int>(out.size(0)), static_cast<int>(ids.size(1)),
                              static_cast<int>(out.size(1)), stream_of(out)),
             "moe_combine");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qwen35 cuda_sm70 kernels (SM70 feature set); called through kernels_cuda.sm70";
  m.def("rms_norm", &rms_norm);
  m.def("conv_prefill", &conv_prefill);
  m.def("conv_update", &conv_update);
  m.def("gdn_step", &gdn_step);
  m.def("gdn_record_bytes", &gdn_record_bytes);
  m.def("gdn_chunk_table", &gdn_chunk_table);
  m.def("gdn_prepare", &gdn_prepare);
  m.def("gdn_scan", &gdn_scan);
  m.def("moe_route", &moe_route);
  m.def("moe_block_m", &moe_block_m);
  m.def("moe_align", &moe_align);
  m.def("moe_gate_up", &moe_gate_up);
  m.def("moe_down", &moe_down);
  m.def("moe_combine", &moe_combine);
}
