// SPDX-License-Identifier: Apache-2.0
#pragma once
// Internal error type. C++ code below the C ABI throws gradsync::Error with a status and an exact
// message; the capi guard turns it into the status code and the thread-local message.
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include <spdlog/fmt/fmt.h>

#include "gradsync/errors.h"

namespace gradsync {

class Error : public std::runtime_error {
 public:
  Error(int status, std::string message) : std::runtime_error(std::move(message)), status_(status) {}
  int status() const noexcept { return status_; }

 private:
  int status_;
};

template <class... Args>
[[noreturn]] void fail(int status, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(status, fmt::format(format, std::forward<Args>(args)...));
}

// What an exception maps to: a status and its message (GRADSYNC_OK and "" when none was thrown).
struct Outcome {
  int status = GRADSYNC_OK;
  std::string message;
};

// Runs body() and catches whatever it throws, as the capi guard reports it.
template <class F>
Outcome capture(F&& body) noexcept {
  try {
    try {
      body();
      return {};
    } catch (const Error& e) {
      return {e.status(), e.what()};
    } catch (const std::bad_alloc&) {
      return {GRADSYNC_E_NOMEM, "out of memory"};
    } catch (const std::system_error& e) {
      return {GRADSYNC_E_IO, e.what()};
    } catch (const std::exception& e) {
      return {GRADSYNC_E_INTERNAL, e.what()};
    } catch (...) {
      return {GRADSYNC_E_INTERNAL, "unknown exception"};
    }
  } catch (...) {
    return {GRADSYNC_E_NOMEM, {}};  // copying the message ran out of memory
  }
}

// The statuses a lost peer gives a group's call (seen dead, stopped by a peer that saw it, or
// silent past the timeout): what a shrink recovers from.
inline bool lost_peer(int status) noexcept {
  return status == GRADSYNC_E_REMOTE || status == GRADSYNC_E_ABORTED || status == GRADSYNC_E_TIMEOUT;
}

}  // namespace gradsync

// Argument checks that read as the rule they enforce: GS_REQUIRE(n > 0, GRADSYNC_E_INVALID_ARG, "n is {}", n).
#define GS_REQUIRE(cond, status, ...)                     \
  do {                                                    \
    if (!(cond)) ::gradsync::fail((status), __VA_ARGS__); \
  } while (0)
