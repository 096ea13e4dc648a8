/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file atomics.h
 * @brief Atomics for asynchronous (Hogwild) training: counters, sticky flags, an owned mutex,
 *        and an atomic element-wise float add of one caller array into another.
 * @defgroup atomics Atomics
 *
 * The counter, flag and mutex handles are internally synchronised: unlike most gradsync handles,
 * any number of threads may use one at the same time (each function says so with
 * `@threadsafety any`). Only *_free must not race with other calls on the same handle.
 *
 * Counters do their arithmetic on the unsigned type of the same width, so overflow wraps
 * modulo 2^32 or 2^64 (INT32_MAX + 1 == INT32_MIN): defined, never undefined behaviour.
 */
#ifndef GRADSYNC_ATOMICS_H
#define GRADSYNC_ATOMICS_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_counter32 gradsync_counter32;
typedef struct gradsync_counter64 gradsync_counter64;
typedef struct gradsync_flag gradsync_flag;
typedef struct gradsync_mutex gradsync_mutex;

/* ---------------------------------------------------------------- counters */

/**
 * @brief Create a 32-bit counter holding `initial`.
 * @param[out] out the new counter; NULL on failure
 * @param initial the starting value
 * @retval GRADSYNC_E_INVALID_ARG out is NULL
 * @retval GRADSYNC_E_NOMEM out of memory
 * @threadsafety any
 */
GRADSYNC_API int gradsync_counter32_create(gradsync_counter32** out, int32_t initial);

/** @brief Free a counter; NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_counter32_free(gradsync_counter32* counter);

/**
 * @brief Atomically add `delta` (wrapping) and report the value before and after.
 * @param counter the counter
 * @param delta the amount to add
 * @param[out] old_value the value before the add (may be NULL)
 * @param[out] new_value the value after the add, old_value + delta wrapped (may be NULL)
 * @retval GRADSYNC_E_MISUSE NULL, freed or wrong kind of handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_counter32_fetch_add(gradsync_counter32* counter, int32_t delta, int32_t* old_value,
                                              int32_t* new_value);

/**
 * @brief Read the current value.
 * @param counter the counter
 * @param[out] value the value
 * @retval GRADSYNC_E_INVALID_ARG value is NULL
 * @retval GRADSYNC_E_MISUSE NULL, freed or wrong kind of handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_counter32_load(const gradsync_counter32* counter, int32_t* value);

/**
 * @brief Set the value (reset).
 * @retval GRADSYNC_E_MISUSE NULL, freed or wrong kind of handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_counter32_store(gradsync_counter32* counter, int32_t value);

/** @brief 64-bit counterpart of gradsync_counter32_create. @threadsafety any */
GRADSYNC_API int gradsync_counter64_create(gradsync_counter64** out, int64_t initial);
/** @brief Free a counter; NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_counter64_free(gradsync_counter64* counter);
/** @brief 64-bit counterpart of gradsync_counter32_fetch_add (wraps modulo 2^64). @threadsafety any */
GRADSYNC_API int gradsync_counter64_fetch_add(gradsync_counter64* counter, int64_t delta, int64_t* old_value,
                                              int64_t* new_value);
/** @brief 64-bit counterpart of gradsync_counter32_load. @threadsafety any */
GRADSYNC_API int gradsync_counter64_load(const gradsync_counter64* counter, int64_t* value);
/** @brief 64-bit counterpart of gradsync_counter32_store. @threadsafety any */
GRADSYNC_API int gradsync_counter64_store(gradsync_counter64* counter, int64_t value);

/* ---------------------------------------------------------------- flags */

/**
 * @brief Create a flag, initially not set.
 * @param[out] out the new flag; NULL on failure
 * @retval GRADSYNC_E_INVALID_ARG out is NULL
 * @threadsafety any
 */
GRADSYNC_API int gradsync_flag_create(gradsync_flag** out);

/** @brief Free a flag; NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_flag_free(gradsync_flag* flag);

/**
 * @brief Set the flag if `condition` is non-zero; a zero condition leaves it as it is (sticky:
 *        only gradsync_flag_reset clears it).
 * @param flag the flag
 * @param condition set the flag when non-zero
 * @param[out] is_set 1 if the flag is set after the call, else 0 (may be NULL)
 * @retval GRADSYNC_E_MISUSE NULL, freed or wrong kind of handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_flag_conditional_set(gradsync_flag* flag, int32_t condition, int32_t* is_set);

/**
 * @brief Read the flag.
 * @param flag the flag
 * @param[out] is_set 1 if set, else 0
 * @retval GRADSYNC_E_INVALID_ARG is_set is NULL
 * @retval GRADSYNC_E_MISUSE NULL, freed or wrong kind of handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_flag_check(const gradsync_flag* flag, int32_t* is_set);

/** @brief Clear the flag. @retval GRADSYNC_E_MISUSE bad handle @threadsafety any */
GRADSYNC_API int gradsync_flag_reset(gradsync_flag* flag);

/* ---------------------------------------------------------------- mutex */

/**
 * @brief Create a mutex, initially unlocked. It is owned by the thread that locks it, and it is
 *        not recursive.
 * @param[out] out the new mutex; NULL on failure
 * @retval GRADSYNC_E_INVALID_ARG out is NULL
 * @threadsafety any
 */
GRADSYNC_API int gradsync_mutex_create(gradsync_mutex** out);

/**
 * @brief Free a mutex; NULL is a no-op. Freeing a locked mutex is allowed and releases the lock
 *        (a warning naming the holder thread is logged); no other thread may be waiting on it or
 *        use it afterwards.
 * @threadsafety handle
 */
GRADSYNC_API void gradsync_mutex_free(gradsync_mutex* mutex);

/**
 * @brief Block until the calling thread holds the mutex.
 * @retval GRADSYNC_E_MISUSE bad handle, or this thread already holds it (waiting would deadlock)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_mutex_lock(gradsync_mutex* mutex);

/**
 * @brief Take the mutex if it is free, without waiting. A busy mutex is not an error.
 * @param mutex the mutex
 * @param[out] acquired 1 if the calling thread now holds it, 0 if another thread does
 * @retval GRADSYNC_E_INVALID_ARG acquired is NULL
 * @retval GRADSYNC_E_MISUSE bad handle, or this thread already holds it
 * @threadsafety any
 */
GRADSYNC_API int gradsync_mutex_try_lock(gradsync_mutex* mutex, int32_t* acquired);

/**
 * @brief Wait at most `timeout_ms` milliseconds for the mutex (0: do not wait).
 * @retval GRADSYNC_E_TIMEOUT not acquired within the timeout
 * @retval GRADSYNC_E_INVALID_ARG timeout_ms is negative
 * @retval GRADSYNC_E_MISUSE bad handle, or this thread already holds it
 * @threadsafety any
 */
GRADSYNC_API int gradsync_mutex_lock_timeout(gradsync_mutex* mutex, int64_t timeout_ms);

/**
 * @brief Release the mutex held by the calling thread.
 * @retval GRADSYNC_E_NOT_OWNER the mutex is not locked, or another thread holds it (the message
 *         names both thread ids, as the kernel numbers them: Python's threading.get_native_id())
 * @retval GRADSYNC_E_MISUSE bad handle
 * @threadsafety any
 */
GRADSYNC_API int gradsync_mutex_unlock(gradsync_mutex* mutex);

/* ---------------------------------------------------------------- atomic array add */

/**
 * @brief dst[i] += src[i] for i in [0, n), each element's read-modify-write atomic with respect to
 *        every other gradsync_atomic_add_* call: when several threads add into the same dst at
 *        once (Hogwild SGD), no update is lost. Adds from different calls to one element happen
 *        in some order, so float results may differ in the last bits between runs (addition is
 *        not associative); plain reads of dst during the adds see each element either before or
 *        after an add, never torn.
 *
 * Implementation: dst is split at aligned addresses into blocks, each guarded by a spin
 * lock from a fixed table hashed by the block's address, and summed with a vectorised loop; one
 * atomic exchange per block rather than one locked instruction per element. Writes to dst by any
 * other means (plain stores, other atomics) are not synchronised with these adds.
 *
 * @param dst n floats, aligned to 4 bytes; borrowed for the call
 * @param src n floats; must not overlap dst; borrowed for the call
 * @param n elements
 * @retval GRADSYNC_E_INVALID_ARG dst or src is NULL while n > 0, dst is misaligned, the ranges
 *         overlap, or n is too large for the address space
 * @threadsafety any
 */
GRADSYNC_API int gradsync_atomic_add_f32(float* dst, const float* src, size_t n);

/** @brief Double-precision counterpart of gradsync_atomic_add_f32 (dst aligned to 8 bytes). @threadsafety any */
GRADSYNC_API int gradsync_atomic_add_f64(double* dst, const double* src, size_t n);

GRADSYNC_END_DECL

#endif /* GRADSYNC_ATOMICS_H */
