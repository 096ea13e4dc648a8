/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file log.h
 * @brief Logging: libgradsync logs through its own logger (never the host's), to stderr by
 *        default, or to a callback that routes lines into the host language.
 *
 * The initial level comes from the environment variable GRADSYNC_LOG_LEVEL (trace, debug, info,
 * warn, error, critical, off, or 0-6); the default is warn.
 */
#ifndef GRADSYNC_LOG_H
#define GRADSYNC_LOG_H

#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

/** Log levels, numbered as spdlog numbers them. */
typedef enum gradsync_log_level {
  GRADSYNC_LOG_TRACE = 0,
  GRADSYNC_LOG_DEBUG = 1,
  GRADSYNC_LOG_INFO = 2,
  GRADSYNC_LOG_WARN = 3,
  GRADSYNC_LOG_ERROR = 4,
  GRADSYNC_LOG_CRITICAL = 5,
  GRADSYNC_LOG_OFF = 6
} gradsync_log_level;

/**
 * A log hook. It may be called from any thread, including internal transport threads, so it must
 * be thread-safe; it must not call back into gradsync; `message` is valid only during the call.
 */
typedef void (*gradsync_log_fn)(void* user_data, int32_t level, const char* message);

/**
 * @brief Route log lines at or above min_level to fn; fn == NULL restores stderr.
 * @retval GRADSYNC_E_INVALID_ARG min_level outside [0, 6]
 * @threadsafety init-only
 */
GRADSYNC_API int gradsync_set_log_callback(gradsync_log_fn fn, void* user_data, int32_t min_level);

/** @brief Set the log level (0-6). @retval GRADSYNC_E_INVALID_ARG level outside [0, 6] @threadsafety any */
GRADSYNC_API int gradsync_set_log_level(int32_t level);

/** @brief The current log level. @threadsafety any */
GRADSYNC_API int32_t gradsync_get_log_level(void);

GRADSYNC_END_DECL

#endif /* GRADSYNC_LOG_H */
