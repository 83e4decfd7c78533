// mlx_mtp's C kernels (row_dot.c: the row kernel, the bf16 kernel and the expert kernel;
// gdn_steps.c; attn_rows.c: a verify's attention rows) as lazy MLX graph ops (CPU only).
//
// The eager ctypes path (mlx_mtp/cpu/row_kernel.py, mlx_mtp/models/qwen3_5/gdn_kernel.py)
// evaluates each kernel's inputs (a host sync), converts them to numpy, runs the C function and
// wraps its output: dozens of syncs per verify on a realistic-size pair. Here each kernel is an MLX
// Primitive whose eval_cpu queues the same C function on the CPU stream after the work that
// makes its inputs, so a verify builds one graph and syncs once, when its result is read.
// The C files are compiled with the same flags as the ctypes libraries (see CMakeLists.txt),
// so the ops' bytes equal the eager path's.
//
// Built by mlx_mtp/cpu/lazy_ops.py with CMake against the installed MLX; the nanobind used
// must be ABI-compatible with the one mlx.core was built with (mlx 0.32: nanobind 3.x).

#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

extern "C" {
int row_dot_f32(const float* x, std::ptrdiff_t T, std::ptrdiff_t ldx, std::ptrdiff_t K,
                const float* w, std::ptrdiff_t N, float* y, std::ptrdiff_t ldy, int threads);
int bf16_dot_f32(const float* x, std::ptrdiff_t T, std::ptrdiff_t ldx, std::ptrdiff_t K,
                 const std::uint16_t* w, std::ptrdiff_t N, float* y, std::ptrdiff_t ldy,
                 int threads);
int expert_dot(const float* x, std::ptrdiff_t ldx, std::ptrdiff_t K, const std::uint32_t* idx,
               std::ptrdiff_t n, std::ptrdiff_t per_row, const void* w, int wsize,
               std::ptrdiff_t expert_stride, std::ptrdiff_t E, std::ptrdiff_t N, float* y,
               int threads);
int gdn_steps_f32_each(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, const float* state, float* y, float* const* states,
                       std::ptrdiff_t B, std::ptrdiff_t T, std::ptrdiff_t Hk, std::ptrdiff_t Hv,
                       std::ptrdiff_t Dk, std::ptrdiff_t Dv);
int attn_scores(const float* q, const float* base, std::ptrdiff_t base_len,
                std::ptrdiff_t base_stride, const float* extra, std::ptrdiff_t E,
                std::ptrdiff_t extra_stride, std::ptrdiff_t G, std::ptrdiff_t n_rep,
                std::ptrdiff_t w, std::ptrdiff_t D, const std::int32_t* n,
                const std::int32_t* ov_start, const std::int32_t* ov_pos,
                const std::int32_t* ov_src, float* scores, std::ptrdiff_t S, void* sgemm,
                int threads);
int attn_values(const float* const* probs, const float* base, std::ptrdiff_t base_len,
                std::ptrdiff_t base_stride, const float* extra, std::ptrdiff_t E,
                std::ptrdiff_t extra_stride, std::ptrdiff_t G, std::ptrdiff_t n_rep,
                std::ptrdiff_t w, std::ptrdiff_t D, const std::int32_t* n,
                const std::int32_t* ov_start, const std::int32_t* ov_pos,
                const std::int32_t* ov_src, float* out, int threads);
}

namespace nb = nanobind;
using namespace mlx::core;

namespace {

constexpr int LAZY_OPS_ABI = 4;  // mlx_mtp.cpu.lazy_ops.ABI: the Python side that calls it

Stream cpu_stream() { return default_stream(Device::cpu); }

// A row-contiguous float32 copy of x where it is not one already (a no-op graph node where it is).
array dense_f32(const array& x, const Stream& s) {
  return contiguous(astype(x, float32, s), false, s);
}

void check_dense(const array& a, const char* what) {
  if (a.dtype() != float32 || !a.flags().row_contiguous)
    throw std::invalid_argument(std::string("mlx_mtp lazy kernel: ") + what +
                                " must be a row-contiguous float32 array");
}

// y = x @ w[:columns].T for x [R, K], in BLIS's one-row order (row_dot.c); with bf16 the
// weight is bfloat16, widened as it is read (bf16_dot_f32).
class RowDot : public UnaryPrimitive {
 public:
  RowDot(Stream s, int columns, int threads, bool bf16 = false)
      : UnaryPrimitive(s), columns_(columns), threads_(threads), bf16_(bf16) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    check_dense(x, "the row kernel's input");
    if (bf16_) {
      if (w.dtype() != bfloat16 || !w.flags().row_contiguous)
        throw std::invalid_argument(
            "mlx_mtp lazy kernel: the bf16 kernel's weight must be a row-contiguous bfloat16 "
            "array");
    } else {
      check_dense(w, "the row kernel's weight");
    }
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const float* xp = x.data<float>();
    float* yp = out.data<float>();
    const std::ptrdiff_t R = x.shape(0), K = x.shape(1), N = columns_;
    const int threads = threads_;
    if (bf16_) {
      const std::uint16_t* wp = w.data<std::uint16_t>();  // the bfloat16 bit patterns
      encoder.dispatch([=]() {
        if (bf16_dot_f32(xp, R, K, K, wp, N, yp, N, threads))
          throw std::runtime_error("mlx_mtp bf16 kernel failed");
      });
      return;
    }
    const float* wp = w.data<float>();
    encoder.dispatch([=]() {
      if (row_dot_f32(xp, R, K, K, wp, N, yp, N, threads))
        throw std::runtime_error("mlx_mtp row kernel failed");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("mlx_mtp's row kernel runs on the CPU only");
  }
  const char* name() const override { return bf16_ ? "MlxMtpBf16Dot" : "MlxMtpRowDot"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const RowDot&>(other);
    return columns_ == o.columns_ && threads_ == o.threads_ && bf16_ == o.bf16_;
  }

 private:
  int columns_;
  int threads_;
  bool bf16_;
};

// y [X * k, N]: entry i = (row i / k, slot i % k) is x's row times the transpose of expert
// idx[i]'s weight (w [E, N, K], each expert's [N, K] row-major; the experts may sit at any
// stride, as the halves of a fused gate/up stack do), grouped by expert so each expert's weight
// streams once for all its rows (row_dot.c's expert_dot; float32 or bfloat16 weights).
class ExpertDot : public UnaryPrimitive {
 public:
  ExpertDot(Stream s, int threads) : UnaryPrimitive(s), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& x = inputs[0];
    const array& idx = inputs[1];
    const array& w = inputs[2];
    check_dense(x, "the expert kernel's input");
    if (idx.dtype() != uint32 || !idx.flags().row_contiguous)
      throw std::invalid_argument(
          "mlx_mtp lazy kernel: the expert kernel's indices must be row-contiguous uint32");
    const std::ptrdiff_t E = w.shape(0), N = w.shape(1), K = w.shape(2);
    if ((w.dtype() != float32 && w.dtype() != bfloat16) || w.strides()[2] != 1 ||
        w.strides()[1] != K)
      throw std::invalid_argument(
          "mlx_mtp lazy kernel: the expert kernel's weight must be float32 or bfloat16 "
          "[E, N, K] with each expert's rows contiguous");
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(idx);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const float* xp = x.data<float>();
    const std::uint32_t* ip = idx.data<std::uint32_t>();
    const void* wp = w.data<void>();
    float* yp = out.data<float>();
    const std::ptrdiff_t X = x.shape(0), k = idx.shape(1), stride = w.strides()[0];
    const int wsize = w.dtype() == bfloat16 ? 2 : 4, threads = threads_;
    encoder.dispatch([=]() {
      if (expert_dot(xp, K, K, ip, X * k, k, wp, wsize, stride, E, N, yp, threads))
        throw std::runtime_error("mlx_mtp expert kernel failed");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("mlx_mtp's expert kernel runs on the CPU only");
  }
  const char* name() const override { return "MlxMtpExpertDot"; }
  bool is_equivalent(const Primitive& other) const override {
    return threads_ == static_cast<const ExpertDot&>(other).threads_;
  }

 private:
  int threads_;
};

// The GatedDeltaNet recurrence over T tokens (gdn_steps.c): outputs y and the T states.
class GdnSteps : public Primitive {
 public:
  explicit GdnSteps(Stream s) : Primitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    static const char* names[] = {"q", "k", "v", "g", "beta", "state"};
    for (int i = 0; i < 6; i++) check_dense(inputs[i], names[i]);
    const array& q = inputs[0];
    const array& v = inputs[2];
    const std::ptrdiff_t B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
    const std::ptrdiff_t Hv = v.shape(2), Dv = v.shape(3);
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    std::vector<float*> states;
    for (size_t i = 0; i < outputs.size(); i++) {
      outputs[i].set_data(allocator::malloc(outputs[i].nbytes()));
      encoder.set_output_array(outputs[i]);
      if (i) states.push_back(outputs[i].data<float>());
    }
    const float* in[6];
    for (int i = 0; i < 6; i++) in[i] = inputs[i].data<float>();
    float* y = outputs[0].data<float>();
    encoder.dispatch([=, states = std::move(states)]() {
      if (gdn_steps_f32_each(in[0], in[1], in[2], in[3], in[4], in[5], y, states.data(), B, T,
                             Hk, Hv, Dk, Dv))
        throw std::runtime_error("mlx_mtp gdn kernel failed");
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("mlx_mtp's gdn kernel runs on the CPU only");
  }
  const char* name() const override { return "MlxMtpGdnSteps"; }
};

array row_dot(const array& x, const array& w, int columns, int threads) {
  if (x.ndim() != 2 || w.ndim() != 2 || w.shape(1) != x.shape(1) || columns % 8 ||
      columns < 0 || columns > w.shape(0))
    throw std::invalid_argument("mlx_mtp row kernel: needs x [R, K], w [N, K], columns a "
                                "multiple of 8 and at most N");
  auto s = cpu_stream();
  auto xs = dense_f32(x, s);
  return array({x.shape(0), columns}, float32, std::make_shared<RowDot>(s, columns, threads),
               {xs, w});
}

array bf16_dot(const array& x, const array& w, int threads) {
  if (x.ndim() != 2 || w.ndim() != 2 || w.shape(1) != x.shape(1) || w.dtype() != bfloat16)
    throw std::invalid_argument("mlx_mtp bf16 kernel: needs x [R, K], w [N, K] bfloat16");
  auto s = cpu_stream();
  auto xs = dense_f32(x, s);
  auto ws = contiguous(w, false, s);
  return array({x.shape(0), w.shape(0)}, float32,
               std::make_shared<RowDot>(s, w.shape(0), threads, true), {xs, ws});
}

array expert_dot_op(const array& x, const array& idx, const array& w, int threads) {
  if (x.ndim() != 2 || idx.ndim() != 2 || w.ndim() != 3 || idx.shape(0) != x.shape(0) ||
      w.shape(2) != x.shape(1) || (w.dtype() != float32 && w.dtype() != bfloat16) ||
      (w.dtype() == float32 && w.shape(1) % 8))
    throw std::invalid_argument(
        "mlx_mtp expert kernel: needs x [X, K], idx [X, k], w [E, N, K] float32 (N a multiple "
        "of 8) or bfloat16");
  auto s = cpu_stream();
  auto xs = dense_f32(x, s);
  auto is = contiguous(astype(idx, uint32, s), false, s);
  return array({x.shape(0) * idx.shape(1), w.shape(1)}, float32,
               std::make_shared<ExpertDot>(s, threads), {xs, is, w});
}

std::vector<array> gdn_steps(const array& q, const array& k, const array& v, const array& g,
                             const array& beta, const array& state) {
  if (q.ndim() != 4 || v.ndim() != 4 || k.shape() != q.shape() || q.shape(1) < 1)
    throw std::invalid_argument("mlx_mtp gdn kernel: needs q, k [B, T, Hk, Dk], T >= 1");
  auto s = cpu_stream();
  const int B = q.shape(0), T = q.shape(1), Hv = v.shape(2), Dv = v.shape(3), Dk = q.shape(3);
  std::vector<Shape> shapes{{B, T, Hv, Dv}};
  for (int t = 0; t < T; t++) shapes.push_back({B, Hv, Dv, Dk});
  std::vector<Dtype> dtypes(shapes.size(), float32);
  std::vector<array> inputs;
  for (auto* a : {&q, &k, &v, &g, &beta, &state}) inputs.push_back(dense_f32(*a, s));
  return array::make_arrays(std::move(shapes), dtypes, std::make_shared<GdnSteps>(s), inputs);
}


// ---- a verify's attention rows (attn_rows.c) ------------------------------------------------
// Which keys each verify row sees: n[i] positions, position s the base's row s unless row i
// overrides it with a row of the extra array (entries ov_start[i]..ov_start[i + 1]).
struct RowsLayout {
  int G, n_rep, w, D;
  std::vector<std::int32_t> n, ov_start, ov_pos, ov_src;
  bool operator==(const RowsLayout& o) const {
    return G == o.G && n_rep == o.n_rep && w == o.w && D == o.D && n == o.n &&
           ov_start == o.ov_start && ov_pos == o.ov_pos && ov_src == o.ov_src;
  }
};

// The BLAS MLX is bound to (mlx_mtp.cpu.blas loads it RTLD_GLOBAL before mlx.core): the scores'
// last n % 8 keys are its own one-row call.
void* bound_sgemm() {
  void* f = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  if (!f) throw std::runtime_error("mlx_mtp attention kernel: no cblas_sgemm in the process");
  return f;
}

// [G, rows, D] float32 at some head stride, each head's rows contiguous: its data and the
// stride, or a packed copy in `copy` where the array is laid out otherwise.
const float* head_rows(const array& a, std::vector<float>& copy, std::ptrdiff_t& stride) {
  const int G = a.shape(1), rows = a.shape(2), D = a.shape(3);
  const auto& st = a.strides();
  if (a.dtype() != float32) throw std::invalid_argument("mlx_mtp attention kernel: K/V must be float32");
  if (st[3] == 1 && (st[2] == D || rows == 1)) {
    stride = G == 1 ? std::ptrdiff_t(rows) * D : st[1];
    return a.data<float>();
  }
  copy.resize(std::size_t(G) * rows * D);
  const float* p = a.data<float>();
  for (int g = 0; g < G; g++)
    for (int r = 0; r < rows; r++)
      for (int d = 0; d < D; d++)
        copy[(std::size_t(g) * rows + r) * D + d] = p[g * st[1] + r * st[2] + d * st[3]];
  stride = std::ptrdiff_t(rows) * D;
  return copy.data();
}

class AttnScores : public UnaryPrimitive {
 public:
  AttnScores(Stream s, RowsLayout layout, int S, int threads)
      : UnaryPrimitive(s), l_(std::move(layout)), S_(S), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& q = inputs[0];
    check_dense(q, "the attention kernel's queries");
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    auto base = inputs[1], extra = inputs[2];
    const float* qp = q.data<float>();
    float* yp = out.data<float>();
    void* gemm = bound_sgemm();
    encoder.dispatch([=, l = l_, S = S_, threads = threads_]() {
      std::vector<float> bcopy, ecopy;
      std::ptrdiff_t bs, es;
      const float* bp = head_rows(base, bcopy, bs);
      const float* ep = head_rows(extra, ecopy, es);
      if (attn_scores(qp, bp, base.shape(2), bs, ep, extra.shape(2), es, l.G, l.n_rep, l.w, l.D,
                      l.n.data(), l.ov_start.data(), l.ov_pos.data(), l.ov_src.data(), yp, S,
                      gemm, threads))
        throw std::runtime_error("mlx_mtp attention kernel (scores) failed");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("mlx_mtp's attention kernel runs on the CPU only");
  }
  const char* name() const override { return "MlxMtpAttnScores"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttnScores&>(other);
    return l_ == o.l_ && S_ == o.S_ && threads_ == o.threads_;
  }

 private:
  RowsLayout l_;
  int S_;
  int threads_;
};

class AttnValues : public UnaryPrimitive {
 public:
  AttnValues(Stream s, RowsLayout layout, int threads)
      : UnaryPrimitive(s), l_(std::move(layout)), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const RowsLayout& l = l_;
    // the probabilities: input 2 + i is row i's [G * n_rep, n[i]], one pointer per query row
    const std::ptrdiff_t R = std::ptrdiff_t(l.n_rep) * l.w;
    std::vector<const float*> probs(std::size_t(l.G) * R);
    for (int i = 0; i < l.w; i++) {
      check_dense(inputs[2 + i], "the attention kernel's probabilities");
      const float* p = inputs[2 + i].data<float>();
      for (int g = 0; g < l.G; g++)
        for (int rep = 0; rep < l.n_rep; rep++)
          probs[g * R + rep * l.w + i] = p + std::ptrdiff_t(g * l.n_rep + rep) * l.n[i];
    }
    auto base = inputs[0], extra = inputs[1];
    float* yp = out.data<float>();
    encoder.dispatch([=, l = l_, probs = std::move(probs), threads = threads_]() {
      std::vector<float> bcopy, ecopy;
      std::ptrdiff_t bs, es;
      const float* bp = head_rows(base, bcopy, bs);
      const float* ep = head_rows(extra, ecopy, es);
      if (attn_values(probs.data(), bp, base.shape(2), bs, ep, extra.shape(2), es, l.G, l.n_rep,
                      l.w, l.D, l.n.data(), l.ov_start.data(), l.ov_pos.data(),
                      l.ov_src.data(), yp, threads))
        throw std::runtime_error("mlx_mtp attention kernel (values) failed");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("mlx_mtp's attention kernel runs on the CPU only");
  }
  const char* name() const override { return "MlxMtpAttnValues"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttnValues&>(other);
    return l_ == o.l_ && threads_ == o.threads_;
  }

 private:
  RowsLayout l_;
  int threads_;
};

RowsLayout rows_layout(const array& base, const array& extra, int n_heads, int w,
                       std::vector<std::int32_t> n, std::vector<std::int32_t> ov_start,
                       std::vector<std::int32_t> ov_pos, std::vector<std::int32_t> ov_src) {
  if (base.ndim() != 4 || extra.ndim() != 4 || base.shape(0) != 1 || extra.shape(0) != 1 ||
      extra.shape(1) != base.shape(1) || extra.shape(3) != base.shape(3) || extra.shape(2) < 1)
    throw std::invalid_argument("mlx_mtp attention kernel: needs base [1, G, rows, D] and extra "
                                "[1, G, E >= 1, D]");
  const int G = base.shape(1);
  if (w < 1 || n_heads % G || int(n.size()) != w || int(ov_start.size()) != w + 1 ||
      ov_pos.size() != ov_src.size() || ov_start.back() != int(ov_pos.size()))
    throw std::invalid_argument("mlx_mtp attention kernel: bad row layout");
  return RowsLayout{G, n_heads / G, w, base.shape(3), std::move(n), std::move(ov_start),
                    std::move(ov_pos), std::move(ov_src)};
}

array attn_scores_op(const array& q, const array& base, const array& extra,
                     std::vector<std::int32_t> n, std::vector<std::int32_t> ov_start,
                     std::vector<std::int32_t> ov_pos, std::vector<std::int32_t> ov_src,
                     int threads) {
  if (q.ndim() != 3 || q.shape(2) != base.shape(3))
    throw std::invalid_argument("mlx_mtp attention kernel: needs q [H, w, D]");
  auto l = rows_layout(base, extra, q.shape(0), q.shape(1), std::move(n), std::move(ov_start),
                       std::move(ov_pos), std::move(ov_src));
  int S = 0;
  for (auto k : l.n) S = std::max(S, int(k));
  auto s = cpu_stream();
  Shape shape{q.shape(0), q.shape(1), S};
  return array(shape, float32, std::make_shared<AttnScores>(s, std::move(l), S, threads),
               {dense_f32(q, s), base, dense_f32(extra, s)});
}

array attn_values_op(const std::vector<array>& probs, const array& base, const array& extra,
                     std::vector<std::int32_t> n, std::vector<std::int32_t> ov_start,
                     std::vector<std::int32_t> ov_pos, std::vector<std::int32_t> ov_src,
                     int threads) {
  if (probs.empty() || probs[0].ndim() != 2)
    throw std::invalid_argument("mlx_mtp attention kernel: needs each row's probabilities "
                                "[H, n]");
  const int H = probs[0].shape(0), w = int(probs.size());
  auto l = rows_layout(base, extra, H, w, std::move(n), std::move(ov_start), std::move(ov_pos),
                       std::move(ov_src));
  auto s = cpu_stream();
  std::vector<array> inputs{base, dense_f32(extra, s)};
  for (int i = 0; i < w; i++) {
    if (probs[i].ndim() != 2 || probs[i].shape(0) != H || probs[i].shape(1) != l.n[i])
      throw std::invalid_argument("mlx_mtp attention kernel: row probabilities of the wrong "
                                  "shape");
    inputs.push_back(dense_f32(probs[i], s));
  }
  Shape shape{H, w, l.D};
  return array(shape, float32, std::make_shared<AttnValues>(s, std::move(l), threads),
               std::move(inputs));
}

}  // namespace

NB_MODULE(_mlx_mtp_lazy, m) {
  m.doc() = "mlx_mtp's C kernels as lazy MLX ops (CPU stream)";
  m.def("abi", []() { return LAZY_OPS_ABI; });
  m.def("row_dot", &row_dot, nb::arg("x"), nb::arg("w"), nb::arg("columns"),
        nb::arg("threads"),
        "x @ w[:columns].T (x [R, K], w [N, K]) in BLIS's one-row order, lazily");
  m.def("bf16_dot", &bf16_dot, nb::arg("x"), nb::arg("w"), nb::arg("threads"),
        "x @ w.T (x [R, K] float32, w [N, K] bfloat16) summed in float32, lazily");
  m.def("expert_dot", &expert_dot_op, nb::arg("x"), nb::arg("idx"), nb::arg("w"),
        nb::arg("threads"),
        "[X * k, N]: row i // k of x [X, K] times expert idx[i]'s weight of w [E, N, K] "
        "transposed, in BLIS's one-row order, grouped by expert, lazily");
  m.def("gdn_steps", &gdn_steps, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("state"),
        "[y, state_1, ..., state_T] of the GatedDeltaNet recurrence, lazily");
  m.def("attn_scores", &attn_scores_op, nb::arg("q"), nb::arg("base"), nb::arg("extra"),
        nb::arg("n"), nb::arg("ov_start"), nb::arg("ov_pos"), nb::arg("ov_src"),
        nb::arg("threads"),
        "[H, w, max n]: each verify row's attention scores in one-query decode's order, lazily");
  m.def("attn_values", &attn_values_op, nb::arg("probs"), nb::arg("base"), nb::arg("extra"),
        nb::arg("n"), nb::arg("ov_start"), nb::arg("ov_pos"), nb::arg("ov_src"),
        nb::arg("threads"),
        "[H, w, D]: each verify row's probabilities times its values in one-query decode's "
        "order, lazily");
}
