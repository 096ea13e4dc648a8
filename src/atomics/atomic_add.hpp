// SPDX-License-Identifier: Apache-2.0
#pragma once
// dst[i] += src[i] with every element's read-modify-write indivisible: no update is lost when
// several threads add into the same array at once (Hogwild SGD). Three implementations are kept
// so the benchmark can compare them in one run; atomic_add() is the one the C API uses.
#include <cstddef>

namespace gradsync::atomics {

// One relaxed compare-and-swap loop per element on the value's bits (a bitwise compare, so
// NaN and -0.0 in dst never make it spin).
template <class T>
void add_cas(T* dst, const T* src, size_t n) noexcept;

// One std::atomic_ref<T>::fetch_add per element (libstdc++ lowers it to a seq_cst CAS loop).
template <class T>
void add_atomic_ref(T* dst, const T* src, size_t n) noexcept;

// One lock per kStripeBytes-aligned block of dst, taken from a fixed table of spin locks
// hashed by the block's address, then a plain vectorisable loop over the block. Every call
// that touches a block takes that block's lock, so the block's adds are indivisible with respect
// to every other add; one atomic exchange is paid per block instead of one lock cmpxchg per
// element. Requires dst aligned to sizeof(T), so that no element straddles two blocks.
// Defined for float and double only (each compiled with AVX2 and baseline clones).
template <class T>
void add_striped(T* dst, const T* src, size_t n) noexcept;
template <>
void add_striped<float>(float* dst, const float* src, size_t n) noexcept;
template <>
void add_striped<double>(double* dst, const double* src, size_t n) noexcept;

inline constexpr size_t kStripeBytes = 1024;

// The implementation behind gradsync_atomic_add_f32/f64 (chosen by bench/atomic_add_bench).
inline void atomic_add(float* dst, const float* src, size_t n) noexcept { add_striped(dst, src, n); }
inline void atomic_add(double* dst, const double* src, size_t n) noexcept { add_striped(dst, src, n); }

}  // namespace gradsync::atomics
