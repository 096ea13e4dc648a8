// SPDX-License-Identifier: Apache-2.0
// Version, status strings, the thread-local last error, logging, and feature queries.
#include <cpuid.h>

#include <string>

#include "capi/guard.hpp"
#include "comm/create.hpp"
#include "common/dtype.hpp"
#include "gradsync/common.h"
#include "gradsync/errors.h"
#include "gradsync/log.h"
#include "gradsync/version.h"

namespace gradsync::capi {
namespace {
struct LastError {
  int status = GRADSYNC_OK;
  std::string message;
};
thread_local LastError t_last_error;
}  // namespace

int set_last_error(int status, const char* function, const char* message) noexcept {
  try {
    t_last_error.status = status;
    t_last_error.message.assign(function);
    t_last_error.message.append(": ");
    t_last_error.message.append(message);
    GS_LOG_DEBUG("{} ({})", t_last_error.message, status);
  } catch (...) {
    // Out of memory while recording the error: the status still reaches the caller.
  }
  return status;
}

}  // namespace gradsync::capi

extern "C" {

GRADSYNC_API uint32_t gradsync_version_number(void) { return GRADSYNC_VERSION_NUMBER; }
GRADSYNC_API const char* gradsync_version_string(void) { return GRADSYNC_VERSION_STRING; }
GRADSYNC_API int32_t gradsync_abi_version(void) { return GRADSYNC_ABI_VERSION; }

GRADSYNC_API const char* gradsync_status_string(int status) {
  switch (status) {
    case GRADSYNC_OK: return "GRADSYNC_OK: success";
    case GRADSYNC_E_INVALID_ARG: return "GRADSYNC_E_INVALID_ARG: invalid argument";
    case GRADSYNC_E_MISUSE: return "GRADSYNC_E_MISUSE: bad handle or call in the wrong state";
    case GRADSYNC_E_NOMEM: return "GRADSYNC_E_NOMEM: out of memory";
    case GRADSYNC_E_IO: return "GRADSYNC_E_IO: input/output error";
    case GRADSYNC_E_CORRUPT: return "GRADSYNC_E_CORRUPT: corrupt file or segment";
    case GRADSYNC_E_VERSION_MISMATCH: return "GRADSYNC_E_VERSION_MISMATCH: incompatible format version";
    case GRADSYNC_E_MISMATCH: return "GRADSYNC_E_MISMATCH: participants disagree";
    case GRADSYNC_E_TIMEOUT: return "GRADSYNC_E_TIMEOUT: a peer did not arrive in time";
    case GRADSYNC_E_REMOTE: return "GRADSYNC_E_REMOTE: a peer died or failed";
    case GRADSYNC_E_IN_PROGRESS: return "GRADSYNC_E_IN_PROGRESS: operation in progress";
    case GRADSYNC_E_ABORTED: return "GRADSYNC_E_ABORTED: the group was aborted";
    case GRADSYNC_E_UNSUPPORTED: return "GRADSYNC_E_UNSUPPORTED: not supported by this build";
    case GRADSYNC_E_BUFS: return "GRADSYNC_E_BUFS: output buffer too small";
    case GRADSYNC_E_OUT_OF_RANGE: return "GRADSYNC_E_OUT_OF_RANGE: index out of range";
    case GRADSYNC_E_ZERO_WEIGHT: return "GRADSYNC_E_ZERO_WEIGHT: total weight is zero";
    case GRADSYNC_E_NO_SPACE: return "GRADSYNC_E_NO_SPACE: not enough space";
    case GRADSYNC_E_NOT_OWNER: return "GRADSYNC_E_NOT_OWNER: the calling thread does not own the lock";
    case GRADSYNC_E_PERMISSION: return "GRADSYNC_E_PERMISSION: owned by another user, or open to others";
    case GRADSYNC_E_LOST: return "GRADSYNC_E_LOST: state that lived only on lost members is gone";
    case GRADSYNC_E_INTERNAL: return "GRADSYNC_E_INTERNAL: internal error";
    default: return "unknown status";
  }
}

GRADSYNC_API const char* gradsync_last_error_message(void) { return gradsync::capi::t_last_error.message.c_str(); }
GRADSYNC_API int gradsync_last_error_status(void) { return gradsync::capi::t_last_error.status; }
GRADSYNC_API void gradsync_last_error_clear(void) {
  gradsync::capi::t_last_error.status = GRADSYNC_OK;
  gradsync::capi::t_last_error.message.clear();
}

GRADSYNC_API size_t gradsync_dtype_size(int32_t dtype) {
  if (dtype < GRADSYNC_F32 || dtype > GRADSYNC_F16) return 0;
  return gradsync::dtype_size(static_cast<gradsync::DType>(dtype));
}

GRADSYNC_API int32_t gradsync_has_feature(int32_t feature) {
  switch (feature) {
    case GRADSYNC_FEATURE_THREAD_TRANSPORT: return 1;
    case GRADSYNC_FEATURE_SHM_TRANSPORT: return 1;
    case GRADSYNC_FEATURE_MPI_TRANSPORT: return gradsync::comm::transport_available(gradsync::comm::Transport::Mpi);
    case GRADSYNC_FEATURE_F16C: {
      unsigned eax, ebx, ecx, edx;
      if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
      return (ecx & bit_F16C) != 0 ? 1 : 0;
    }
    default: return 0;
  }
}

GRADSYNC_API int gradsync_set_log_callback(gradsync_log_fn fn, void* user_data, int32_t min_level) {
  return gradsync::capi::guard(__func__, [&] {
    GS_REQUIRE(min_level >= GRADSYNC_LOG_TRACE && min_level <= GRADSYNC_LOG_OFF, GRADSYNC_E_INVALID_ARG,
               "log level {} outside [0, 6]", min_level);
    gradsync::log::set_callback(fn, user_data, min_level);
  });
}

GRADSYNC_API int gradsync_set_log_level(int32_t level) {
  return gradsync::capi::guard(__func__, [&] {
    GS_REQUIRE(level >= GRADSYNC_LOG_TRACE && level <= GRADSYNC_LOG_OFF, GRADSYNC_E_INVALID_ARG,
               "log level {} outside [0, 6]", level);
    gradsync::log::set_level(level);
  });
}

GRADSYNC_API int32_t gradsync_get_log_level(void) { return gradsync::log::level(); }

}  // extern "C"
