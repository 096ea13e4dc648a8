// SPDX-License-Identifier: Apache-2.0
#pragma once
// Rank-order reduction kernels shared by every transport whose ranks see each other's memory
// (threads of one process; processes over shared memory).
//
// Every element is combined strictly in rank order, ((s0 op s1) op s2) op ..., whatever the
// order in which ranks arrived, so every rank and every run produces the same bits. Mean is the
// sum divided by the number of sources; integer mean truncates toward zero (C++ division).
// Integer sums wrap (two's complement, never undefined behaviour); i32 mean sums in 64 bits so
// it never wraps. bf16 and f16 are accumulated in f32 (in rank order) and rounded once, to
// nearest even, at the end.
//
// Aliasing: dst may be one of the sources (same address, element for element), which is what
// in-place collectives need; partially overlapping ranges are not allowed.
#include <cstddef>
#include <cstdint>

#include "common/dtype.hpp"

namespace gradsync::comm {

// Whether the kernels can reduce this dtype (all of them today). Copies work for any dtype.
constexpr bool reducible(DType dtype) noexcept {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::I32 || dtype == DType::I64 ||
         dtype == DType::BF16 || dtype == DType::F16;
}

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrcs-1][i] for i in [begin, end), in rank order.
// Throws Error(GRADSYNC_E_UNSUPPORTED) for a dtype that is not reducible; nsrcs must be >= 1.
void reduce(DType dtype, ReduceOp op, const void* const* srcs, size_t nsrcs, void* dst, size_t begin, size_t end);

// Like reduce(), then the same result into every one of dsts[0..ndsts) over [begin, end): the range
// is processed in cache-sized blocks, each reduced once into dsts[0] and copied from cache to the
// others, so every source byte is read once and every destination byte written once. Any dst may
// alias any source (same address), since a block is fully read before any of it is written.
void reduce_to_all(DType dtype, ReduceOp op, const void* const* srcs, size_t nsrcs, void* const* dsts, size_t ndsts,
                   size_t begin, size_t end);

// The weighted mean, the one definition every transport follows: rank r contributes
// c_r = (weights[r] == 0 ? +0.0 : weights[r] * src_r[i]) in double (so a rank with weight 0
// contributes nothing, even NaN or inf), the contributions are summed in rank order starting from
// c_0, and the sum is divided once by `total` and rounded once to the dtype (f32 or f64).
// dst[i - begin] for i in [begin, end), from sources indexed from element 0; dst may alias a source.
void weighted_mean(DType dtype, const void* const* srcs, const double* weights, size_t nsrcs, double total, void* dst,
                   size_t begin, size_t end);

// Whether a reduction in levels (part of the ranks, then the parts) keeps what the rank-order fold
// computes, the order aside: floats combine in their own type at every step, integer sums wrap
// alike in any order, min and max are exact. Half types and the integer mean accumulate wider than
// their type, so a level's rounding would lose what the one fold keeps.
bool levels_preserve(DType dtype, ReduceOp op) noexcept;

// The mean's last step after a sum in levels: data[i] / n in the dtype (f32 or f64; levels never
// carry another dtype's mean, see levels_preserve), as the fold's mean divides.
void divide_by(DType dtype, void* data, size_t count, size_t n) noexcept;

// dst[i] = src[i] for i in [begin, end) (elements of dtype); a no-op when dst == src.
void copy(DType dtype, const void* src, void* dst, size_t begin, size_t end) noexcept;

// src[begin, end) into every dsts[k][begin, end), blockwise so src is read from memory once.
void copy_to_all(DType dtype, const void* src, void* const* dsts, size_t ndsts, size_t begin, size_t end) noexcept;

// The instruction set of the kernels: the best the CPU has unless told otherwise. Every ISA gives
// the same bits (tests compare them); use_kernel_isa exists so that tests can run each one, and it
// never selects an ISA the CPU lacks (asked for one, it takes the best instead). AVX-512 pays where
// the data sits in the caches (a gradient bucket of 64K floats): half the instructions per byte.
enum class KernelIsa { Baseline, Avx2, Avx512 };
bool cpu_has(KernelIsa isa) noexcept;
KernelIsa best_kernel_isa() noexcept;
void use_kernel_isa(KernelIsa isa) noexcept;

// Elements per block of reduce_to_all/copy_to_all: small enough that a block of every source
// plus the destination stays in L1/L2, large enough to amortise the loop set-up.
constexpr size_t kBlockBytes = 16 * 1024;

}  // namespace gradsync::comm
