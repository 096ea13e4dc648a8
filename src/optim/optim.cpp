// SPDX-License-Identifier: Apache-2.0
#include "optim/optim.hpp"

#include <cmath>

namespace gradsync::optim {

void sgd(float* __restrict w, const float* __restrict g, size_t n, float lr, float wd) noexcept {
  if (wd == 0.0f) {
    for (size_t i = 0; i < n; ++i) w[i] -= lr * g[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float grad = g[i] + wd * w[i];
    w[i] -= lr * grad;
  }
}

void momentum_sgd(float* __restrict w, const float* __restrict g, float* __restrict v, size_t n, float lr, float wd,
                  float mu) noexcept {
  for (size_t i = 0; i < n; ++i) {
    const float grad = g[i] + wd * w[i];
    v[i] = mu * v[i] + grad;
    w[i] -= lr * v[i];
  }
}

// no-math-errno lets sqrt vectorise (the same correctly rounded result).
__attribute__((optimize("no-math-errno"))) void adam(float* __restrict w, const float* __restrict g,
                                                     float* __restrict m, float* __restrict v, size_t n,
                                                     float step_size, float inv_sqrt_bc2, float eps, float b1, float b2,
                                                     float l2, float decay) noexcept {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  if (l2 == 0.0f && decay == 1.0f) {  // as sgd: an infinite weight stays infinite, not NaN from 0 * inf
    for (size_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + c1 * g[i];
      v[i] = b2 * v[i] + c2 * g[i] * g[i];
      const float denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
      w[i] = w[i] - step_size * m[i] / denom;
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float weight = w[i] * decay;  // decoupled decay (AdamW); decay == 1 otherwise
    const float grad = g[i] + l2 * w[i];
    m[i] = b1 * m[i] + c1 * grad;
    v[i] = b2 * v[i] + c2 * grad * grad;
    const float denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
    w[i] = weight - step_size * m[i] / denom;
  }
}

void row_adagrad(float* __restrict w, const float* __restrict g, float& state, size_t n, float lr, float eps) noexcept {
  float sum = 0.0f;
  for (size_t j = 0; j < n; ++j) sum += g[j] * g[j];
  state += sum / static_cast<float>(n);
  const float scale = lr / (std::sqrt(state) + eps);
  for (size_t j = 0; j < n; ++j) w[j] -= scale * g[j];
}

}  // namespace gradsync::optim
