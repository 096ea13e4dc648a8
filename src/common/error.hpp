// SPDX-License-Identifier: Apache-2.0
#pragma once
// Internal error type. C++ code below the C ABI throws gradsync::Error with a status and an exact
// message; the capi guard turns it into the status code and the thread-local message.
#include <stdexcept>
#include <string>
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

}  // namespace gradsync

// Argument checks that read as the rule they enforce: GS_REQUIRE(n > 0, GRADSYNC_E_INVALID_ARG, "n is {}", n).
#define GS_REQUIRE(cond, status, ...)                     \
  do {                                                    \
    if (!(cond)) ::gradsync::fail((status), __VA_ARGS__); \
  } while (0)
