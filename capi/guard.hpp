// SPDX-License-Identifier: Apache-2.0
#pragma once
// The exception firewall: every extern "C" body is `return gradsync::capi::guard(__func__, [&] { ... });`.
// No exception crosses the C ABI; each becomes a status plus the thread-local message.
#include <exception>
#include <new>
#include <system_error>
#include <type_traits>

#include "capi/handle.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace gradsync::capi {

// Records status and message for gradsync_last_error_message(); returns status.
int set_last_error(int status, const char* function, const char* message) noexcept;

template <class F>
int guard(const char* function, F&& body) noexcept {
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
      body();
      return GRADSYNC_OK;
    } else {
      return body();
    }
  } catch (const Error& e) {
    return set_last_error(e.status(), function, e.what());
  } catch (const std::bad_alloc&) {
    return set_last_error(GRADSYNC_E_NOMEM, function, "out of memory");
  } catch (const std::system_error& e) {
    return set_last_error(GRADSYNC_E_IO, function, e.what());
  } catch (const std::exception& e) {
    return set_last_error(GRADSYNC_E_INTERNAL, function, e.what());
  } catch (...) {
    return set_last_error(GRADSYNC_E_INTERNAL, function, "unknown exception");
  }
}

template <class H>
void destroy(H* h) noexcept {
  if (h == nullptr) return;
  try {
    check(h);
  } catch (const Error& e) {
    GS_LOG_ERROR("free: {}", e.what());
    return;
  }
  delete h;
}

// Writes a new handle through an out-parameter: *out is NULL unless construction succeeds.
template <class H, class Make>
int create(const char* function, H** out, Make&& make) noexcept {
  if (out != nullptr) *out = nullptr;
  return guard(function, [&] {
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "out-parameter for the new handle is NULL");
    *out = make();
  });
}

}  // namespace gradsync::capi
