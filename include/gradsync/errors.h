/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file errors.h
 * @brief Status codes and the per-thread error message.
 *
 * Every fallible function returns an int: GRADSYNC_OK (0) on success or a negative status below.
 * The numeric values are pinned and never renumbered. After a failure,
 * gradsync_last_error_message() says exactly what was wrong, on the thread that made the call.
 * The status is authoritative; the message is stale after a success.
 */
#ifndef GRADSYNC_ERRORS_H
#define GRADSYNC_ERRORS_H

#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

/** Status codes. Values are part of the ABI. Codes -1000 and below are reserved for experimental API. */
typedef enum gradsync_status {
  GRADSYNC_OK = 0,                  /**< success */
  GRADSYNC_E_INVALID_ARG = -1,      /**< an argument is invalid: NULL buffer, bad enum value, wrong length */
  GRADSYNC_E_MISUSE = -2,           /**< NULL or wrong kind of handle, or a call in the wrong state */
  GRADSYNC_E_NOMEM = -3,            /**< memory allocation failed */
  GRADSYNC_E_IO = -4,               /**< a file or system call failed */
  GRADSYNC_E_CORRUPT = -5,          /**< a file or segment has a bad magic, header or checksum */
  GRADSYNC_E_VERSION_MISMATCH = -6, /**< a file or segment of an incompatible format version */
  GRADSYNC_E_MISMATCH = -7,         /**< ranks, or a file and its caller, disagree (count, dtype, op, shape) */
  GRADSYNC_E_TIMEOUT = -8,          /**< a peer did not arrive within the deadline */
  GRADSYNC_E_REMOTE = -9,           /**< a peer process died or reported an error */
  GRADSYNC_E_IN_PROGRESS = -10,     /**< the operation has not completed yet */
  GRADSYNC_E_ABORTED = -11,         /**< the group was aborted (or timed out earlier); reset or free it */
  GRADSYNC_E_UNSUPPORTED = -12,     /**< the feature or transport is not in this build */
  GRADSYNC_E_BUFS = -13,            /**< an output buffer is too small; the size needed was reported */
  GRADSYNC_E_OUT_OF_RANGE = -14,    /**< an index (row, rank, worker) is outside its valid range */
  GRADSYNC_E_ZERO_WEIGHT = -15,     /**< a weighted mean over a total weight (sample count) of zero */
  GRADSYNC_E_NO_SPACE = -16,        /**< not enough space in the file system or /dev/shm */
  GRADSYNC_E_NOT_OWNER = -17,       /**< unlocking a mutex that the calling thread does not hold */
  GRADSYNC_E_PERMISSION = -18,      /**< a file or segment belongs to another user, or others may access it */
  GRADSYNC_E_LOST = -19,            /**< state that lived only on lost members is gone (the message names it) */
  GRADSYNC_E_INTERNAL = -100        /**< a bug in libgradsync: please report it */
} gradsync_status;

/**
 * @brief Static description of a status, starting with its name: "GRADSYNC_E_TIMEOUT: ...".
 * @return Never NULL; "unknown status" for an unknown value. Static storage, never freed.
 * @threadsafety any
 */
GRADSYNC_API const char* gradsync_status_string(int status);

/**
 * @brief What went wrong in the last failed gradsync call on this thread.
 * @return Never NULL ("" when nothing failed yet). Library-owned, thread-local storage, valid
 *         until the next gradsync call on the same thread.
 * @threadsafety any
 */
GRADSYNC_API const char* gradsync_last_error_message(void);

/** @brief The status of the last failed call on this thread (GRADSYNC_OK when none). @threadsafety any */
GRADSYNC_API int gradsync_last_error_status(void);

/** @brief Forget this thread's last error. @threadsafety any */
GRADSYNC_API void gradsync_last_error_clear(void);

GRADSYNC_END_DECL

#endif /* GRADSYNC_ERRORS_H */
