// SPDX-License-Identifier: Apache-2.0
#pragma once
// The exception firewall: every extern "C" body is `return gradsync::capi::guard(__func__, [&] { ... });`.
// No exception crosses the C ABI; each becomes a status plus the thread-local message.
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <type_traits>

#include "capi/handle.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace gradsync::capi {

// Records status and message for gradsync_last_error_message(); returns status.
int set_last_error(int status, const char* function, const char* message) noexcept;

using gradsync::capture;
using gradsync::Outcome;

template <class F>
int guard(const char* function, F&& body) noexcept {
  if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
    const Outcome o = capture(body);
    return o.status == GRADSYNC_OK ? GRADSYNC_OK : set_last_error(o.status, function, o.message.c_str());
  } else {
    int status = GRADSYNC_OK;
    const Outcome o = capture([&] { status = body(); });
    return o.status == GRADSYNC_OK ? status : set_last_error(o.status, function, o.message.c_str());
  }
}

template <class H>
void destroy(H* h) noexcept {
  if (h == nullptr) return;
  try {
    check_kind(h);
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
