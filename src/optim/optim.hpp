// SPDX-License-Identifier: Apache-2.0
#pragma once
// The optimizer kernels, once for every component that updates parameters: the accumulator's
// apply (SGD and row-wise Adagrad on the touched rows) and the sharded parameter's step (SGD,
// momentum, Adam, AdamW on its slice).
//
// Elementwise float arithmetic without fused multiply-add, so every rank and every run gives the
// same bits.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace gradsync::optim {

// The optimizers of a table's rows (the accumulator's apply, the sharded embedding's push); the
// values are gradsync_optimizer_kind's. Adam is sparse ("lazy") Adam on the touched rows.
enum class RowOptimizer : int32_t { Sgd = 0, RowAdagrad = 1, Adam = 2 };

// Floats of state a row keeps: 0 SGD, 1 row-wise Adagrad, 2 * dim + 1 Adam (m, then v, then the
// row's update count). Whatever stores or moves rows' state (state tables, checkpoints, a
// reshard) sizes it by this.
constexpr int64_t state_width(RowOptimizer kind, int64_t dim) noexcept {
  return kind == RowOptimizer::RowAdagrad ? 1 : kind == RowOptimizer::Adam ? 2 * dim + 1 : 0;
}
// eps when the caller leaves it at 0: 1e-10 row-wise Adagrad (PyTorch-BigGraph's), 1e-8 Adam (torch's).
constexpr float default_eps(RowOptimizer kind) noexcept { return kind == RowOptimizer::Adam ? 1e-8f : 1e-10f; }
constexpr const char* optimizer_name(RowOptimizer kind) noexcept {
  return kind == RowOptimizer::Sgd          ? "SGD"
         : kind == RowOptimizer::RowAdagrad ? "row-wise Adagrad"
         : kind == RowOptimizer::Adam       ? "Adam"
                                            : "an unknown optimizer";
}

// Whether a hyperparameter given as double survives the kernels' float: 1e300 is finite as a
// double but infinite as a float, and would turn every updated weight into inf or NaN.
inline bool finite_in_float(double x) noexcept {
  return std::isfinite(x) && std::fabs(x) <= std::numeric_limits<float>::max();
}

// w -= lr * (g + wd * w). With wd == 0 the decay term is left out, not multiplied by zero (an
// infinite weight stays infinite rather than turning NaN).
void sgd(float* __restrict w, const float* __restrict g, size_t n, float lr, float wd) noexcept;

// v = mu * v + (g + wd * w); w -= lr * v.
void momentum_sgd(float* __restrict w, const float* __restrict g, float* __restrict v, size_t n, float lr, float wd,
                  float mu) noexcept;

// Adam with bias correction folded into step_size and inv_sqrt_bc2; l2 is the coupled weight decay
// (Adam), decay the decoupled one as a factor (AdamW: 1 - lr * wd; 1 otherwise). With l2 == 0 and
// decay == 1 both terms are left out. torch.optim.SparseAdam's form (eps added to sqrt(v) before
// the bias correction, which step_size then carries whole) is inv_sqrt_bc2 = 1 and
// step_size = lr * sqrt(bc2) / bc1.
void adam(float* __restrict w, const float* __restrict g, float* __restrict m, float* __restrict v, size_t n,
          float step_size, float inv_sqrt_bc2, float eps, float b1, float b2, float l2, float decay) noexcept;

// PyTorch-BigGraph's row-wise Adagrad on one row of n: state += mean(g^2); w -= lr * g / (sqrt(state) + eps).
void row_adagrad(float* __restrict w, const float* __restrict g, float& state, size_t n, float lr, float eps) noexcept;

}  // namespace gradsync::optim
