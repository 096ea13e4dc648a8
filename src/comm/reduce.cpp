// SPDX-License-Identifier: Apache-2.0
#include "comm/reduce.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>

#include "codec/codec.hpp"
#include "common/error.hpp"

namespace gradsync::comm {
namespace {

// How one (dtype, op) pair loads, combines and finishes. Acc is the running type: unsigned for
// integer sums (wrapping is defined), int64 for the i32 mean (never wraps), T otherwise.
template <class T, ReduceOp Op>
struct Traits {
  using Elem = T;
  static constexpr auto acc_type() noexcept {
    if constexpr (std::is_floating_point_v<T> || Op == ReduceOp::Min || Op == ReduceOp::Max)
      return std::type_identity<T>{};
    else if constexpr (Op == ReduceOp::Mean && sizeof(T) == 4)
      return std::type_identity<int64_t>{};
    else
      return std::type_identity<std::make_unsigned_t<T>>{};
  }
  using Acc = typename decltype(acc_type())::type;

  static Acc load(T v) noexcept { return static_cast<Acc>(v); }
  static Acc combine(Acc a, Acc b) noexcept {
    if constexpr (Op == ReduceOp::Min)
      return b < a ? b : a;
    else if constexpr (Op == ReduceOp::Max)
      return a < b ? b : a;
    else
      return a + b;
  }
  static T finish(Acc v, size_t n) noexcept {
    if constexpr (Op != ReduceOp::Mean) {
      return static_cast<T>(v);
    } else if constexpr (std::is_floating_point_v<T>) {
      return v / static_cast<T>(n);
    } else {
      // Signed division truncates toward zero; the i64 sum wrapped in unsigned is reinterpreted first.
      using S = std::make_signed_t<Acc>;
      return static_cast<T>(static_cast<S>(v) / static_cast<S>(n));
    }
  }
};

// The kernel bodies are always inlined into one entry point per instruction set (fold_for_cpu
// below), which is where the loop over elements is vectorised: 256-bit vectors roughly double the
// rate from cache over the SSE2 baseline, and keep a large allreduce at the memory-bandwidth bound.
// Vector and scalar code give the same bits: each element is still folded in rank order with the
// same IEEE operations (no FMA is involved, and min/max vectorise only with the scalar semantics).
#define GS_KERNEL [[gnu::always_inline]] inline

// Fixed number of sources: one pass, the fold over ranks unrolled at compile time, so the loop over
// elements vectorises. ivdep: dst either is one of the sources (dependence distance 0) or overlaps
// none, which is the documented precondition, so no runtime alias check is needed.
template <class Tr, size_t... K>
GS_KERNEL void fold_fixed(const typename Tr::Elem* const* srcs, typename Tr::Elem* dst, size_t begin, size_t end,
                          std::index_sequence<K...>) noexcept {
  using T = typename Tr::Elem;
  constexpr size_t n = sizeof...(K);
  const T* const p[n] = {srcs[K]...};
#pragma GCC ivdep
  for (size_t i = begin; i < end; ++i) {
    typename Tr::Acc v = Tr::load(p[0][i]);
    ((K == 0 ? void() : void(v = Tr::combine(v, Tr::load(p[K][i])))), ...);
    dst[i] = Tr::finish(v, n);
  }
}

// As many destinations as sources (the direct allreduce writes its slice into every rank's
// buffer): each result goes from the register into every destination, in the same pass, so no
// destination is read back. Same precondition as above for each destination.
template <class Tr, size_t... K>
GS_KERNEL void fold_fixed_all(const typename Tr::Elem* const* srcs, typename Tr::Elem* const* dsts, size_t begin,
                              size_t end, std::index_sequence<K...>) noexcept {
  using T = typename Tr::Elem;
  constexpr size_t n = sizeof...(K);
  const T* const p[n] = {srcs[K]...};
  T* const q[n] = {dsts[K]...};
#pragma GCC ivdep
  for (size_t i = begin; i < end; ++i) {
    typename Tr::Acc v = Tr::load(p[0][i]);
    ((K == 0 ? void() : void(v = Tr::combine(v, Tr::load(p[K][i])))), ...);
    const T r = Tr::finish(v, n);
    ((q[K][i] = r), ...);
  }
}

// Any number of sources: fold block by block through an accumulator that stays in L1.
template <class Tr>
GS_KERNEL void fold_generic(const typename Tr::Elem* const* srcs, size_t nsrcs, typename Tr::Elem* dst, size_t begin,
                            size_t end) noexcept {
  using Acc = typename Tr::Acc;
  constexpr size_t kChunk = 512;
  Acc acc[kChunk];
  for (size_t lo = begin; lo < end; lo += kChunk) {
    const size_t len = std::min(kChunk, end - lo);
    const auto* s0 = srcs[0] + lo;
    for (size_t j = 0; j < len; ++j) acc[j] = Tr::load(s0[j]);
    for (size_t k = 1; k < nsrcs; ++k) {
      const auto* s = srcs[k] + lo;
      for (size_t j = 0; j < len; ++j) acc[j] = Tr::combine(acc[j], Tr::load(s[j]));
    }
    auto* d = dst + lo;
    for (size_t j = 0; j < len; ++j) d[j] = Tr::finish(acc[j], nsrcs);
  }
}

template <class Tr>
GS_KERNEL void fold(const void* const* raw, size_t nsrcs, void* raw_dst, size_t begin, size_t end) noexcept {
  using T = typename Tr::Elem;
  const T* const* srcs = reinterpret_cast<const T* const*>(raw);
  T* dst = static_cast<T*>(raw_dst);
  switch (nsrcs) {
    case 1: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<1>{});
    case 2: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<2>{});
    case 3: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<3>{});
    case 4: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<4>{});
    case 5: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<5>{});
    case 6: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<6>{});
    case 7: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<7>{});
    case 8: return fold_fixed<Tr>(srcs, dst, begin, end, std::make_index_sequence<8>{});
    default: return fold_generic<Tr>(srcs, nsrcs, dst, begin, end);
  }
}

// The fused form for n sources and n destinations, n in [2, 8]; false when there is none.
template <class Tr>
GS_KERNEL bool fold_all(const void* const* raw, size_t n, void* const* raw_dsts, size_t begin, size_t end) noexcept {
  using T = typename Tr::Elem;
  const T* const* srcs = reinterpret_cast<const T* const*>(raw);
  T* const* dsts = reinterpret_cast<T* const*>(raw_dsts);
  switch (n) {
    case 2: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<2>{}); return true;
    case 3: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<3>{}); return true;
    case 4: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<4>{}); return true;
    case 5: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<5>{}); return true;
    case 6: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<6>{}); return true;
    case 7: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<7>{}); return true;
    case 8: fold_fixed_all<Tr>(srcs, dsts, begin, end, std::make_index_sequence<8>{}); return true;
    default: return false;
  }
}

using FoldAllFn = bool (*)(const void* const*, size_t, void* const*, size_t, size_t) noexcept;

template <class Tr>
bool fold_all_baseline(const void* const* srcs, size_t n, void* const* dsts, size_t begin, size_t end) noexcept {
  return fold_all<Tr>(srcs, n, dsts, begin, end);
}

#if defined(__x86_64__)
#define GS_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))
template <class Tr>
GS_AVX512 bool fold_all_avx512(const void* const* srcs, size_t n, void* const* dsts, size_t begin,
                               size_t end) noexcept {
  return fold_all<Tr>(srcs, n, dsts, begin, end);
}

template <class Tr>
__attribute__((target("avx2"))) bool fold_all_avx2(const void* const* srcs, size_t n, void* const* dsts, size_t begin,
                                                   size_t end) noexcept {
  return fold_all<Tr>(srcs, n, dsts, begin, end);
}
#endif

using FoldFn = void (*)(const void* const*, size_t, void*, size_t, size_t) noexcept;

template <class Tr>
void fold_baseline(const void* const* srcs, size_t nsrcs, void* dst, size_t begin, size_t end) noexcept {
  fold<Tr>(srcs, nsrcs, dst, begin, end);
}

#if defined(__x86_64__)
template <class Tr>
GS_AVX512 void fold_avx512(const void* const* srcs, size_t nsrcs, void* dst, size_t begin, size_t end) noexcept {
  fold<Tr>(srcs, nsrcs, dst, begin, end);
}

template <class Tr>
__attribute__((target("avx2"))) void fold_avx2(const void* const* srcs, size_t nsrcs, void* dst, size_t begin,
                                               size_t end) noexcept {
  fold<Tr>(srcs, nsrcs, dst, begin, end);
}
#endif

std::atomic<KernelIsa>& isa_in_use() noexcept {
  static std::atomic<KernelIsa> isa{best_kernel_isa()};
  return isa;
}

template <class Tr>
FoldFn fold_for_cpu() noexcept {
#if defined(__x86_64__)
  switch (isa_in_use().load(std::memory_order_relaxed)) {
    case KernelIsa::Avx512: return &fold_avx512<Tr>;
    case KernelIsa::Avx2: return &fold_avx2<Tr>;
    case KernelIsa::Baseline: break;
  }
#endif
  return &fold_baseline<Tr>;
}

template <class T>
FoldFn pick_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum: return fold_for_cpu<Traits<T, ReduceOp::Sum>>();
    case ReduceOp::Mean: return fold_for_cpu<Traits<T, ReduceOp::Mean>>();
    case ReduceOp::Min: return fold_for_cpu<Traits<T, ReduceOp::Min>>();
    case ReduceOp::Max: return fold_for_cpu<Traits<T, ReduceOp::Max>>();
  }
  return nullptr;
}

// Half precision: each block of every source is widened to f32 by the codec (at memory speed),
// folded in rank order with the f32 arithmetic, and narrowed once, to nearest even. So a bf16 or
// f16 reduction gives the bits of the f32 reduction of the same values, rounded once.
template <codec::Codec C, ReduceOp Op>
void fold_half(const void* const* srcs, size_t nsrcs, void* dst, size_t begin, size_t end) noexcept {
  using Tr = Traits<float, Op>;
  constexpr size_t kChunk = 512;
  float acc[kChunk], in[kChunk];
  for (size_t lo = begin; lo < end; lo += kChunk) {
    const size_t len = std::min(kChunk, end - lo);
    codec::decode(C, static_cast<const uint16_t*>(srcs[0]) + lo, len, acc);
    for (size_t k = 1; k < nsrcs; ++k) {
      codec::decode(C, static_cast<const uint16_t*>(srcs[k]) + lo, len, in);
      for (size_t j = 0; j < len; ++j) acc[j] = Tr::combine(acc[j], in[j]);
    }
    for (size_t j = 0; j < len; ++j) acc[j] = Tr::finish(acc[j], nsrcs);
    codec::encode(C, acc, len, static_cast<uint16_t*>(dst) + lo);
  }
}

template <codec::Codec C>
FoldFn pick_half(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum: return &fold_half<C, ReduceOp::Sum>;
    case ReduceOp::Mean: return &fold_half<C, ReduceOp::Mean>;
    case ReduceOp::Min: return &fold_half<C, ReduceOp::Min>;
    case ReduceOp::Max: return &fold_half<C, ReduceOp::Max>;
  }
  return nullptr;
}

FoldFn pick(DType dtype, ReduceOp op) {
  FoldFn fn = nullptr;
  switch (dtype) {
    case DType::F32: fn = pick_op<float>(op); break;
    case DType::F64: fn = pick_op<double>(op); break;
    case DType::I32: fn = pick_op<int32_t>(op); break;
    case DType::I64: fn = pick_op<int64_t>(op); break;
    case DType::BF16: fn = pick_half<codec::Codec::Bf16>(op); break;
    case DType::F16: fn = pick_half<codec::Codec::Fp16>(op); break;
  }
  GS_REQUIRE(fn != nullptr, GRADSYNC_E_UNSUPPORTED, "{} reduction of {} is not supported", op_name(op),
             dtype_name(dtype));
  return fn;
}

template <class Tr>
FoldAllFn fold_all_for_cpu() noexcept {
#if defined(__x86_64__)
  switch (isa_in_use().load(std::memory_order_relaxed)) {
    case KernelIsa::Avx512: return &fold_all_avx512<Tr>;
    case KernelIsa::Avx2: return &fold_all_avx2<Tr>;
    case KernelIsa::Baseline: break;
  }
#endif
  return &fold_all_baseline<Tr>;
}

template <class T>
FoldAllFn pick_all_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum: return fold_all_for_cpu<Traits<T, ReduceOp::Sum>>();
    case ReduceOp::Mean: return fold_all_for_cpu<Traits<T, ReduceOp::Mean>>();
    case ReduceOp::Min: return fold_all_for_cpu<Traits<T, ReduceOp::Min>>();
    case ReduceOp::Max: return fold_all_for_cpu<Traits<T, ReduceOp::Max>>();
  }
  return nullptr;
}

// Half precision has no fused form: it goes through f32 blocks anyway.
FoldAllFn pick_all(DType dtype, ReduceOp op) noexcept {
  switch (dtype) {
    case DType::F32: return pick_all_op<float>(op);
    case DType::F64: return pick_all_op<double>(op);
    case DType::I32: return pick_all_op<int32_t>(op);
    case DType::I64: return pick_all_op<int64_t>(op);
    case DType::BF16:
    case DType::F16: return nullptr;
  }
  return nullptr;
}

}  // namespace

bool cpu_has(KernelIsa isa) noexcept {
  switch (isa) {
    case KernelIsa::Baseline: return true;
#if defined(__x86_64__)
    case KernelIsa::Avx2: return __builtin_cpu_supports("avx2") != 0;
    case KernelIsa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#else
    case KernelIsa::Avx2:
    case KernelIsa::Avx512: return false;
#endif
  }
  return false;
}

KernelIsa best_kernel_isa() noexcept {
  if (cpu_has(KernelIsa::Avx512)) return KernelIsa::Avx512;
  if (cpu_has(KernelIsa::Avx2)) return KernelIsa::Avx2;
  return KernelIsa::Baseline;
}

void use_kernel_isa(KernelIsa isa) noexcept {
  isa_in_use().store(cpu_has(isa) ? isa : best_kernel_isa(), std::memory_order_relaxed);
}

void reduce(DType dtype, ReduceOp op, const void* const* srcs, size_t nsrcs, void* dst, size_t begin, size_t end) {
  GS_REQUIRE(nsrcs >= 1, GRADSYNC_E_INVALID_ARG, "reduction over {} sources", nsrcs);
  const FoldFn fn = pick(dtype, op);
  if (begin < end) fn(srcs, nsrcs, dst, begin, end);
}

void reduce_to_all(DType dtype, ReduceOp op, const void* const* srcs, size_t nsrcs, void* const* dsts, size_t ndsts,
                   size_t begin, size_t end) {
  GS_REQUIRE(nsrcs >= 1, GRADSYNC_E_INVALID_ARG, "reduction over {} sources", nsrcs);
  const FoldFn fn = pick(dtype, op);
  if (ndsts == 0 || begin >= end) return;
  if (ndsts == nsrcs) {
    const FoldAllFn all = pick_all(dtype, op);
    if (all != nullptr && all(srcs, nsrcs, dsts, begin, end)) return;
  }
  const size_t elem = dtype_size(dtype);
  const size_t block = kBlockBytes / elem;
  for (size_t lo = begin; lo < end; lo += block) {
    const size_t hi = std::min(end, lo + block);
    fn(srcs, nsrcs, dsts[0], lo, hi);
    const auto* from = static_cast<const std::byte*>(dsts[0]) + lo * elem;
    for (size_t k = 1; k < ndsts; ++k) {
      auto* to = static_cast<std::byte*>(dsts[k]) + lo * elem;
      if (to != from) std::memcpy(to, from, (hi - lo) * elem);
    }
  }
}

namespace {
template <class T>
void weighted_mean_of(const void* const* srcs, const double* weights, size_t nsrcs, double total, T* out, size_t begin,
                      size_t end) noexcept {
  constexpr size_t kBlock = 512;
  double acc[kBlock];
  for (size_t lo = begin; lo < end; lo += kBlock) {
    const size_t len = std::min(kBlock, end - lo);
    for (size_t r = 0; r < nsrcs; ++r) {
      const T* s = static_cast<const T*>(srcs[r]) + lo;
      const double w = weights[r];
      if (r == 0) {
        if (w == 0)
          std::fill(acc, acc + len, 0.0);
        else
          for (size_t j = 0; j < len; ++j) acc[j] = w * static_cast<double>(s[j]);
      } else if (w != 0) {
        for (size_t j = 0; j < len; ++j) acc[j] += w * static_cast<double>(s[j]);
      } else {
        for (size_t j = 0; j < len; ++j) acc[j] += 0.0;
      }
    }
    T* o = out + (lo - begin);
    for (size_t j = 0; j < len; ++j) o[j] = static_cast<T>(acc[j] / total);
  }
}
}  // namespace

void weighted_mean(DType dtype, const void* const* srcs, const double* weights, size_t nsrcs, double total, void* dst,
                   size_t begin, size_t end) {
  if (dtype == DType::F32) return weighted_mean_of(srcs, weights, nsrcs, total, static_cast<float*>(dst), begin, end);
  if (dtype == DType::F64) return weighted_mean_of(srcs, weights, nsrcs, total, static_cast<double*>(dst), begin, end);
  fail(GRADSYNC_E_INVALID_ARG, "weighted mean needs f32 or f64, got {}", dtype_name(dtype));
}

bool levels_preserve(DType dtype, ReduceOp op) noexcept {
  switch (dtype) {
    case DType::F32:
    case DType::F64: return true;
    case DType::I32:
    case DType::I64: return op != ReduceOp::Mean;
    case DType::BF16:
    case DType::F16: return false;
  }
  return false;
}

namespace {
template <class T>
void divide(void* data, size_t count, size_t n) noexcept {
  T* p = static_cast<T*>(data);
  for (size_t i = 0; i < count; ++i) p[i] = p[i] / static_cast<T>(n);
}
}  // namespace

void divide_by(DType dtype, void* data, size_t count, size_t n) noexcept {
  if (dtype == DType::F32) divide<float>(data, count, n);
  if (dtype == DType::F64) divide<double>(data, count, n);
}

void copy(DType dtype, const void* src, void* dst, size_t begin, size_t end) noexcept {
  if (src == dst || begin >= end) return;
  const size_t elem = dtype_size(dtype);
  std::memcpy(static_cast<std::byte*>(dst) + begin * elem, static_cast<const std::byte*>(src) + begin * elem,
              (end - begin) * elem);
}

void copy_to_all(DType dtype, const void* src, void* const* dsts, size_t ndsts, size_t begin, size_t end) noexcept {
  if (begin >= end) return;
  const size_t elem = dtype_size(dtype);
  const size_t block = kBlockBytes / elem;
  for (size_t lo = begin; lo < end; lo += block) {
    const size_t hi = std::min(end, lo + block);
    const auto* from = static_cast<const std::byte*>(src) + lo * elem;
    for (size_t k = 0; k < ndsts; ++k) {
      auto* to = static_cast<std::byte*>(dsts[k]) + lo * elem;
      if (to != from) std::memcpy(to, from, (hi - lo) * elem);
    }
  }
}

}  // namespace gradsync::comm
