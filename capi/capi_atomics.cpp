// SPDX-License-Identifier: Apache-2.0
// C shims of the atomics (include/gradsync/atomics.h).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>

#include "atomics/atomic_add.hpp"
#include "atomics/counter.hpp"
#include "atomics/flag.hpp"
#include "atomics/mutex.hpp"
#include "capi/guard.hpp"
#include "gradsync/atomics.h"

struct gradsync_counter32 : gradsync::capi::Handle<gradsync::capi::Kind::Counter32> {
  explicit gradsync_counter32(int32_t initial) : impl(initial) {}
  gradsync::atomics::Counter32 impl;
};
struct gradsync_counter64 : gradsync::capi::Handle<gradsync::capi::Kind::Counter64> {
  explicit gradsync_counter64(int64_t initial) : impl(initial) {}
  gradsync::atomics::Counter64 impl;
};
struct gradsync_flag : gradsync::capi::Handle<gradsync::capi::Kind::Flag> {
  gradsync::atomics::Flag impl;
};
struct gradsync_mutex : gradsync::capi::Handle<gradsync::capi::Kind::Mutex> {
  gradsync::atomics::Mutex impl;
};

namespace {
using gradsync::capi::check;
using gradsync::capi::guard;

template <class Handle, class Value>
int counter_fetch_add(const char* function, Handle* counter, Value delta, Value* old_value, Value* new_value) {
  return guard(function, [&] {
    const auto result = check(counter)->impl.fetch_add(delta);
    if (old_value != nullptr) *old_value = result.old_value;
    if (new_value != nullptr) *new_value = result.new_value;
  });
}

template <class Handle, class Value>
int counter_load(const char* function, const Handle* counter, Value* value) {
  return guard(function, [&] {
    GS_REQUIRE(value != nullptr, GRADSYNC_E_INVALID_ARG, "value out-parameter is NULL");
    *value = check(counter)->impl.load();
  });
}

template <class Handle, class Value>
int counter_store(const char* function, Handle* counter, Value value) {
  return guard(function, [&] { check(counter)->impl.store(value); });
}

template <class T>
int atomic_add(const char* function, T* dst, const T* src, size_t n) {
  return guard(function, [&] {
    if (n == 0) return;
    GS_REQUIRE(dst != nullptr, GRADSYNC_E_INVALID_ARG, "dst is NULL for n = {}", n);
    GS_REQUIRE(src != nullptr, GRADSYNC_E_INVALID_ARG, "src is NULL for n = {}", n);
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    constexpr uintptr_t kMax = std::numeric_limits<uintptr_t>::max();
    GS_REQUIRE(n <= static_cast<size_t>(std::numeric_limits<ptrdiff_t>::max()) / sizeof(T) &&
                   d <= kMax - n * sizeof(T) && s <= kMax - n * sizeof(T),
               GRADSYNC_E_INVALID_ARG, "n = {} elements does not fit in the address space", n);
    GS_REQUIRE(d % alignof(T) == 0, GRADSYNC_E_INVALID_ARG, "dst {} is not aligned to {} bytes",
               static_cast<const void*>(dst), alignof(T));
    const size_t bytes = n * sizeof(T);
    GS_REQUIRE(d + bytes <= s || s + bytes <= d, GRADSYNC_E_INVALID_ARG,
               "src [{}, +{} bytes) overlaps dst [{}, +{} bytes)", static_cast<const void*>(src), bytes,
               static_cast<const void*>(dst), bytes);
    gradsync::atomics::atomic_add(dst, src, n);
  });
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_counter32_create(gradsync_counter32** out, int32_t initial) {
  return gradsync::capi::create(__func__, out, [&] { return new gradsync_counter32(initial); });
}
GRADSYNC_API void gradsync_counter32_free(gradsync_counter32* counter) { gradsync::capi::destroy(counter); }
GRADSYNC_API int gradsync_counter32_fetch_add(gradsync_counter32* counter, int32_t delta, int32_t* old_value,
                                              int32_t* new_value) {
  return counter_fetch_add(__func__, counter, delta, old_value, new_value);
}
GRADSYNC_API int gradsync_counter32_load(const gradsync_counter32* counter, int32_t* value) {
  return counter_load(__func__, counter, value);
}
GRADSYNC_API int gradsync_counter32_store(gradsync_counter32* counter, int32_t value) {
  return counter_store(__func__, counter, value);
}

GRADSYNC_API int gradsync_counter64_create(gradsync_counter64** out, int64_t initial) {
  return gradsync::capi::create(__func__, out, [&] { return new gradsync_counter64(initial); });
}
GRADSYNC_API void gradsync_counter64_free(gradsync_counter64* counter) { gradsync::capi::destroy(counter); }
GRADSYNC_API int gradsync_counter64_fetch_add(gradsync_counter64* counter, int64_t delta, int64_t* old_value,
                                              int64_t* new_value) {
  return counter_fetch_add(__func__, counter, delta, old_value, new_value);
}
GRADSYNC_API int gradsync_counter64_load(const gradsync_counter64* counter, int64_t* value) {
  return counter_load(__func__, counter, value);
}
GRADSYNC_API int gradsync_counter64_store(gradsync_counter64* counter, int64_t value) {
  return counter_store(__func__, counter, value);
}

GRADSYNC_API int gradsync_flag_create(gradsync_flag** out) {
  return gradsync::capi::create(__func__, out, [] { return new gradsync_flag(); });
}
GRADSYNC_API void gradsync_flag_free(gradsync_flag* flag) { gradsync::capi::destroy(flag); }
GRADSYNC_API int gradsync_flag_conditional_set(gradsync_flag* flag, int32_t condition, int32_t* is_set) {
  return guard(__func__, [&] {
    const bool set = check(flag)->impl.conditional_set(condition != 0);
    if (is_set != nullptr) *is_set = set ? 1 : 0;
  });
}
GRADSYNC_API int gradsync_flag_check(const gradsync_flag* flag, int32_t* is_set) {
  return guard(__func__, [&] {
    GS_REQUIRE(is_set != nullptr, GRADSYNC_E_INVALID_ARG, "is_set out-parameter is NULL");
    *is_set = check(flag)->impl.check() ? 1 : 0;
  });
}
GRADSYNC_API int gradsync_flag_reset(gradsync_flag* flag) {
  return guard(__func__, [&] { check(flag)->impl.reset(); });
}

GRADSYNC_API int gradsync_mutex_create(gradsync_mutex** out) {
  return gradsync::capi::create(__func__, out, [] { return new gradsync_mutex(); });
}
GRADSYNC_API void gradsync_mutex_free(gradsync_mutex* mutex) {
  if (mutex == nullptr) return;
  try {
    const pid_t holder = check(mutex)->impl.owner();
    if (holder != 0) GS_LOG_WARN("gradsync_mutex_free: freeing a mutex still held by thread {}", holder);
  } catch (const std::exception& e) {
    GS_LOG_ERROR("gradsync_mutex_free: {}", e.what());
    return;
  }
  // Defined even while locked: the lock state is plain data, no std::mutex is held across calls.
  delete mutex;
}
GRADSYNC_API int gradsync_mutex_lock(gradsync_mutex* mutex) {
  return guard(__func__, [&] { check(mutex)->impl.lock(); });
}
GRADSYNC_API int gradsync_mutex_try_lock(gradsync_mutex* mutex, int32_t* acquired) {
  return guard(__func__, [&] {
    GS_REQUIRE(acquired != nullptr, GRADSYNC_E_INVALID_ARG, "acquired out-parameter is NULL");
    *acquired = check(mutex)->impl.try_lock() ? 1 : 0;
  });
}
GRADSYNC_API int gradsync_mutex_lock_timeout(gradsync_mutex* mutex, int64_t timeout_ms) {
  return guard(__func__, [&] {
    auto* m = check(mutex);
    GS_REQUIRE(timeout_ms >= 0, GRADSYNC_E_INVALID_ARG, "timeout_ms must be >= 0, got {}", timeout_ms);
    // Beyond ~35 years the deadline arithmetic inside the wait would overflow; no caller can tell.
    const int64_t bounded = std::min<int64_t>(timeout_ms, int64_t{1} << 40);
    if (!m->impl.try_lock_for(std::chrono::milliseconds(bounded)))
      gradsync::fail(GRADSYNC_E_TIMEOUT, "mutex not acquired within {} ms", timeout_ms);
  });
}
GRADSYNC_API int gradsync_mutex_unlock(gradsync_mutex* mutex) {
  return guard(__func__, [&] { check(mutex)->impl.unlock(); });
}

GRADSYNC_API int gradsync_atomic_add_f32(float* dst, const float* src, size_t n) {
  return atomic_add(__func__, dst, src, n);
}
GRADSYNC_API int gradsync_atomic_add_f64(double* dst, const double* src, size_t n) {
  return atomic_add(__func__, dst, src, n);
}

}  // extern "C"
