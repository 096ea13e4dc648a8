/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file common.h
 * @brief Types shared by every component: element types, reduction ops, sentinels, and the
 *        query for what this build contains.
 */
#ifndef GRADSYNC_COMMON_H
#define GRADSYNC_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

/** Sentinels for "use the library default" in options structs. */
#define GRADSYNC_UNSET_I32 INT32_MIN
#define GRADSYNC_UNSET_I64 INT64_MIN

/** Element types of buffers (int32_t values; enum types never appear in signatures or structs). */
typedef enum gradsync_dtype {
  GRADSYNC_F32 = 0,  /**< IEEE binary32 */
  GRADSYNC_F64 = 1,  /**< IEEE binary64 */
  GRADSYNC_I32 = 2,  /**< int32_t */
  GRADSYNC_I64 = 3,  /**< int64_t */
  GRADSYNC_BF16 = 4, /**< bfloat16 (reduced in f32, rounded once; also a compression wire format) */
  GRADSYNC_F16 = 5   /**< IEEE binary16 (reduced in f32, rounded once; also a compression wire format) */
} gradsync_dtype;

/** Reduction operations. */
typedef enum gradsync_op {
  GRADSYNC_SUM = 0,
  GRADSYNC_MEAN = 1, /**< sum divided by the number of ranks (integers: truncated toward zero) */
  GRADSYNC_MIN = 2,
  GRADSYNC_MAX = 3
} gradsync_op;

/** Size in bytes of one element of a dtype, 0 for an unknown dtype. @threadsafety any */
GRADSYNC_API size_t gradsync_dtype_size(int32_t dtype);

/**
 * The optimizers, one enum for every component; each takes the ones it supports:
 * gradsync_accum_apply and the sharded embedding table SGD, ROW_ADAGRAD and ADAM (sparse Adam on the
 * touched rows, accumulator.h), a sharded parameter SGD, MOMENTUM, ADAM and ADAMW (others:
 * gradsync_accum_apply and the sharded parameter give GRADSYNC_E_UNSUPPORTED,
 * gradsync_embedding_create GRADSYNC_E_INVALID_ARG). wd is the weight decay of the sharded parameter.
 */
typedef enum gradsync_optimizer_kind {
  GRADSYNC_OPTIM_SGD = 0,         /**< w -= lr·(g + wd·w) */
  GRADSYNC_OPTIM_ROW_ADAGRAD = 1, /**< PyTorch-BigGraph's: s[r] += mean(g²); w -= lr·g / (sqrt(s[r]) + eps) */
  GRADSYNC_OPTIM_ADAM = 2,        /**< Adam with bias correction; weight decay as an L2 term in g */
  GRADSYNC_OPTIM_ADAMW = 3,       /**< Adam with decoupled weight decay: w -= lr·wd·w */
  GRADSYNC_OPTIM_MOMENTUM = 4     /**< v = μ·v + (g + wd·w); w -= lr·v */
} gradsync_optimizer_kind;

/** Features that a build may or may not contain. */
typedef enum gradsync_feature {
  GRADSYNC_FEATURE_THREAD_TRANSPORT = 1, /**< communicator among threads of one process */
  GRADSYNC_FEATURE_SHM_TRANSPORT = 2,    /**< communicator among processes of one host */
  GRADSYNC_FEATURE_MPI_TRANSPORT = 3,    /**< communicator over MPI (OpenMPI): built with it, and its plugin
                                            libgradsync-mpi.so.0 and the MPI runtime load (asking loads them) */
  GRADSYNC_FEATURE_F16C = 4              /**< the CPU running this process converts half floats in hardware */
} gradsync_feature;

/**
 * @brief Whether this build, here (the MPI plugin and runtime load; for CPU features, this machine), has a feature.
 * @return 1 if present, 0 if not or if the value is unknown.
 * @threadsafety any
 */
GRADSYNC_API int32_t gradsync_has_feature(int32_t feature);

GRADSYNC_END_DECL

#endif /* GRADSYNC_COMMON_H */
