/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file dataparallel.h
 * @brief Data-parallel helpers that need no communication: the library's partition rule, a
 *        round-robin split of sample indices, and the weighted merge of per-worker updates.
 * @defgroup dataparallel Data-parallel helpers
 *
 * Every function here is pure (no handle, no global state) and safe from any thread.
 */
#ifndef GRADSYNC_DATAPARALLEL_H
#define GRADSYNC_DATAPARALLEL_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

/**
 * @brief Contiguous part `index` of `n` elements split into `parts` parts (BigDL's rule, the
 *        same one the communicator and sharded parameters use):
 *        start = index*(n/parts) + min(index, n%parts), len = n/parts + (index < n%parts).
 *        n < parts is allowed: the trailing parts are empty. n=10, parts=3 gives (0,4) (4,3) (7,3).
 * @param n elements
 * @param parts parts, > 0
 * @param index the part, < parts
 * @param[out] start first element of the part
 * @param[out] len number of elements of the part
 * @retval GRADSYNC_E_INVALID_ARG parts is 0, or start or len is NULL
 * @retval GRADSYNC_E_OUT_OF_RANGE index >= parts
 * @threadsafety any
 */
GRADSYNC_API int gradsync_partition(uint64_t n, uint32_t parts, uint32_t index, uint64_t* start, uint64_t* len);

/**
 * @brief The sample indices dealt round-robin to one worker: worker k of `workers` gets
 *        k, k + workers, k + 2*workers, ... below `samples`. (10, 3) gives [0,3,6,9] [1,4,7] [2,5,8];
 *        0 samples gives every worker an empty list.
 *
 * Capacity in, size out: *needed is always set to the number of indices of this worker; they are
 * written to out only when capacity >= *needed. Call with out = NULL, capacity = 0 to ask the size.
 * @param samples samples in all
 * @param workers workers, > 0
 * @param worker this worker, < workers
 * @param[out] out capacity uint64_t slots (may be NULL when capacity is 0)
 * @param capacity entries out can hold
 * @param[out] needed the number of indices of this worker (required)
 * @retval GRADSYNC_E_INVALID_ARG workers is 0, needed is NULL, or out is NULL with capacity > 0
 * @retval GRADSYNC_E_OUT_OF_RANGE worker >= workers
 * @retval GRADSYNC_E_BUFS capacity < *needed (nothing written to out)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_split_round_robin(uint64_t samples, uint32_t workers, uint32_t worker, uint64_t* out,
                                            size_t capacity, size_t* needed);

/**
 * @brief Merge per-worker updates weighted by their sample counts:
 *        out[j] = sum_i counts[i]*grads[i][j] / sum_i counts[i], and the weighted mean loss.
 *
 * Accumulated in double, in worker order 0, 1, 2, ..., rounded to float once: the same bits on
 * every run. A worker with count 0 contributes nothing (its gradient and loss are not read, so an
 * empty batch's NaN cannot leak in). Nothing is written on error. `out` may be one of the grads
 * (in place). Gradients are given as an array of pointers with their lengths, so that a caller
 * holding one array per worker (a Python list of numpy arrays) passes them without copying, and a
 * worker whose gradient has the wrong length is detected, not read out of bounds.
 *
 * @param grads workers pointers, grads[i] holding lens[i] floats
 * @param lens workers lengths, each must equal out_len
 * @param counts workers sample counts (the weights)
 * @param losses workers losses, or NULL when no mean loss is wanted
 * @param workers number of workers, > 0
 * @param[out] out out_len floats
 * @param out_len floats in out
 * @param[out] mean_loss sum counts[i]*losses[i] / sum counts[i] (may be NULL; needs losses)
 * @param[out] total_count sum counts[i] (may be NULL)
 * @retval GRADSYNC_E_INVALID_ARG workers is 0, a NULL array, mean_loss without losses, or the
 *         total count overflows 64 bits
 * @retval GRADSYNC_E_MISMATCH a gradient's length differs from out_len (the message names the worker)
 * @retval GRADSYNC_E_ZERO_WEIGHT every count is 0 (never a NaN result)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_weighted_merge_f32(const float* const* grads, const size_t* lens, const uint64_t* counts,
                                             const double* losses, size_t workers, float* out, size_t out_len,
                                             double* mean_loss, uint64_t* total_count);

/**
 * @brief gradsync_weighted_merge_f32 for double gradients, exact to a relative 1e-12.
 *
 * Same contract as gradsync_weighted_merge_f32 (worker order, count 0 skipped, in place allowed,
 * nothing written on error), but summed as if in twice double precision: each count is split into
 * two 32-bit halves (exact in a double, so no count is rounded, even above 2^53), each product
 * count·g is split exactly with a fused multiply-add and each sum is compensated (Ogita, Rump and
 * Oishi's Dot2); the quotient by the exact integer total is rounded once. The result is then within
 * a relative 1e-12 of the exact weighted mean whenever sum_i |counts[i]·grads[i][j]| is less than
 * 10^18 / workers^2 times |the weighted sum| (no catastrophic cancellation), and the same bits on
 * every run and machine with IEEE doubles. Where f32 rounds 2.000000000116 to 2.0 (counts near
 * 2^33), this returns it.
 *
 * @param grads workers pointers, grads[i] holding lens[i] doubles
 * @param lens workers lengths, each must equal out_len
 * @param counts workers sample counts (the weights)
 * @param losses workers losses, or NULL when no mean loss is wanted
 * @param workers number of workers, > 0
 * @param[out] out out_len doubles
 * @param out_len elements of out and of every gradient
 * @param[out] mean_loss sum counts[i]*losses[i] / sum counts[i] (may be NULL; needs losses)
 * @param[out] total_count sum counts[i] (may be NULL)
 * @return GRADSYNC_OK, or an error as gradsync_weighted_merge_f32 gives it
 * @threadsafety any
 */
GRADSYNC_API int gradsync_weighted_merge_f64(const double* const* grads, const size_t* lens, const uint64_t* counts,
                                             const double* losses, size_t workers, double* out, size_t out_len,
                                             double* mean_loss, uint64_t* total_count);

GRADSYNC_END_DECL

#endif /* GRADSYNC_DATAPARALLEL_H */
