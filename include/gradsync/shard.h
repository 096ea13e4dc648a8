/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file shard.h
 * @brief The sharded parameter (Intel BigDL's AllReduceParameter, ZeRO stage 1) over any
 *        communicator: each rank owns one slice of the weights and the optimizer state for that
 *        slice only, so optimizer memory per rank is 1/P of an unsharded optimizer's.
 *
 * A flat parameter of N floats is split over the P ranks of a communicator by the partition rule
 * (part i starts at i*(N/P) + min(i, N%P) and holds N/P + (i < N%P) elements; N < P leaves empty
 * parts). One training step:
 *   1. put       (local)      stage this rank's gradient and sample count (encoded if compressed)
 *   2. aggregate (collective) rank r receives part r of Σ wⱼ·gⱼ / Σ wⱼ (wⱼ: rank j's sample count;
 *                             equal counts give the plain mean), then the gradient processors
 *   3. update    (local)      the optimizer updates rank r's weight slice
 *   4. gather    (collective) every rank receives all new weights, always in full precision
 * gradsync_shard_step() does all four in one call. With compression, gradients travel encoded
 * (bf16 or IEEE half) and are decoded and summed in f32 in rank order, rounded once.
 *
 * Guarantees: every rank gets bitwise the same weights on every run. A stale gradient is never
 * reused: a gradient is consumed by the aggregate that reads it, and an aggregate (or step) on a
 * rank without a fresh put fails on every rank. A local failure on one rank (bad argument, failed
 * put or update, wrong stage) is reported by every rank's next collective stage instead of leaving
 * the others blocked: that rank gets its own status, the others GRADSYNC_E_REMOTE naming it.
 * A total sample count of 0 is GRADSYNC_E_ZERO_WEIGHT on every rank.
 */
#ifndef GRADSYNC_SHARD_H
#define GRADSYNC_SHARD_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/codec.h"
#include "gradsync/comm.h"
#include "gradsync/common.h"
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_shard gradsync_shard;

/** Optimizers run by the owner of each slice. */
typedef enum gradsync_shard_optimizer {
  GRADSYNC_SHARD_SGD = GRADSYNC_OPTIM_SGD,           /**< former name of GRADSYNC_OPTIM_SGD */
  GRADSYNC_SHARD_MOMENTUM = GRADSYNC_OPTIM_MOMENTUM, /**< former name of GRADSYNC_OPTIM_MOMENTUM */
  GRADSYNC_SHARD_ADAM = GRADSYNC_OPTIM_ADAM,         /**< former name of GRADSYNC_OPTIM_ADAM */
  GRADSYNC_SHARD_ADAMW = GRADSYNC_OPTIM_ADAMW        /**< former name of GRADSYNC_OPTIM_ADAMW */
} gradsync_shard_optimizer;

/** Which slice gradsync_shard_read_slice copies. */
typedef enum gradsync_shard_slice {
  GRADSYNC_SHARD_WEIGHTS = 0,  /**< this rank's slice of the weights */
  GRADSYNC_SHARD_GRADIENT = 1, /**< this rank's slice of the last aggregated (processed) gradient */
  GRADSYNC_SHARD_STATE1 = 2,   /**< the optimizer's first state: MOMENTUM's velocity, ADAM/ADAMW's first moment */
  GRADSYNC_SHARD_STATE2 = 3    /**< the optimizer's second state: ADAM/ADAMW's second moment */
} gradsync_shard_slice;

#define GRADSYNC_SHARD_OPTIONS_VERSION 3

/** Options of gradsync_shard_create. Fill with gradsync_shard_options_init or GRADSYNC_SHARD_OPTIONS_INIT. */
typedef struct gradsync_shard_options {
  uint32_t struct_size;   /**< sizeof(gradsync_shard_options) as the caller compiled it */
  uint32_t version;       /**< GRADSYNC_SHARD_OPTIONS_VERSION */
  int32_t optimizer;      /**< a gradsync_optimizer_kind (SGD, MOMENTUM, ADAM, ADAMW); default SGD. In a
                               version 1 struct (built with an older header) 1 means MOMENTUM */
  int32_t compress;       /**< a gradsync_codec for gradients on the wire; default NONE */
  int32_t error_feedback; /**< 1: keep each rank's compression residual and add it to its next gradient */
  int32_t clamp;          /**< 1: clamp the aggregated gradient to [clamp_min, clamp_max] */
  double lr;              /**< learning rate, >= 0; default 0.01 */
  double momentum;        /**< MOMENTUM's μ in [0, 1); default 0.9 */
  double beta1;           /**< ADAM/ADAMW, in [0, 1); default 0.9 */
  double beta2;           /**< ADAM/ADAMW, in [0, 1); default 0.999 */
  double eps;             /**< ADAM/ADAMW, > 0; default 1e-8 */
  double weight_decay;    /**< >= 0; default 0 */
  double clamp_min;       /**< lower bound when clamp is 1 */
  double clamp_max;       /**< upper bound when clamp is 1 (>= clamp_min) */
  double clip_norm;  /**< > 0: scale the gradient by clip_norm/‖g‖ when its global L2 norm exceeds it; 0: off */
  int32_t replicas;  /**< version 3: each rank's slice (weights and optimizer state) also lives on the next
                          `replicas` ranks of the replica ring (ranks by local rank, then host: on one host
                          rank order; across even hosts each next rank on another host), in [0, 64];
                          default 0. gradsync_shard_reshard after losing up to that many neighbours on the
                          ring (with 1 across even hosts: a whole host) then loses nothing. Costs `replicas` slices of
                        memory per rank  and, each step, an exchange of `replicas` gradient slices */
  int32_t reserved0; /**< 0 */
  /* append only */
} gradsync_shard_options;

#define GRADSYNC_SHARD_OPTIONS_INIT                                                                                \
  {                                                                                                                \
    sizeof(gradsync_shard_options), GRADSYNC_SHARD_OPTIONS_VERSION, GRADSYNC_SHARD_SGD, GRADSYNC_CODEC_NONE, 0, 0, \
        0.01, 0.9, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0, 0.0, 0, 0                                                      \
  }

/**
 * @brief Fill opts with defaults (for FFIs that cannot expand GRADSYNC_SHARD_OPTIONS_INIT).
 * @retval GRADSYNC_E_INVALID_ARG opts is NULL or struct_size is smaller than the first version's
 * @threadsafety any
 */
GRADSYNC_API int gradsync_shard_options_init(gradsync_shard_options* opts, size_t struct_size);

/* ---------------------------------------------------------------- lifecycle */

/**
 * @brief Create this rank's view of a sharded parameter of `total` floats. Local (no communication);
 *        every rank of the communicator creates one with the same total and options.
 * @param[out] out the new handle; NULL on failure
 * @param[in] comm the communicator, shared with the shard: once it is freed, the shard's collective
 *            stages fail with GRADSYNC_E_MISUSE (its local calls keep working); a collective stage
 *            and a call on the communicator from another thread at once is GRADSYNC_E_MISUSE too
 * @param[in] total number of parameters, >= 1 (fewer than ranks is allowed: some parts are empty)
 * @param[in] opts options, or NULL for the defaults
 * @retval GRADSYNC_E_INVALID_ARG total is 0 or too large, or an option is out of range (the message names it)
 * @retval GRADSYNC_E_MISUSE comm is NULL or not a communicator
 * @threadsafety any
 */
GRADSYNC_API int gradsync_shard_create(gradsync_shard** out, gradsync_comm* comm, uint64_t total,
                                       const gradsync_shard_options* opts);

/** @brief Release the shard (not its communicator); NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_shard_free(gradsync_shard* shard);

/* ---------------------------------------------------------------- queries */

/**
 * @brief The part of a rank: offset `base + start` and length, e.g. base 0 for 0-based offsets,
 *        base 1 for BigDL's 1-based storage offsets. N=10, P=3: (0,4), (4,3), (7,3); with base 1
 *        (1,4), (5,3), (8,3).
 * @param shard the sharded parameter
 * @param[in] rank a rank in [0, P), or -1 for this rank
 * @param base added to the offset: 0 for 0-based offsets, 1 for BigDL's 1-based ones
 * @param[out] offset,length may be NULL
 * @retval GRADSYNC_E_OUT_OF_RANGE rank outside [0, P) and not -1
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_part(const gradsync_shard* shard, int32_t rank, uint64_t base, uint64_t* offset,
                                     uint64_t* length);

/**
 * @brief The parts of every rank as pairs (offset, length): out[2r] = base + start(r), out[2r+1] = len(r).
 * @param shard the sharded parameter
 * @param base added to every offset, as in gradsync_shard_part
 * @param[out] out room for capacity values (2·P needed)
 * @param capacity values out can hold
 * @param[out] needed 2·P (may be NULL)
 * @retval GRADSYNC_E_BUFS capacity < 2·P (*needed is set, out untouched)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_ranges(const gradsync_shard* shard, uint64_t base, uint64_t* out, size_t capacity,
                                       size_t* needed);

/**
 * @brief Memory this rank holds, in bytes (each may be NULL): its weight slice, its optimizer
 *        state (1/P of the unsharded optimizer's), and staging and wire buffers.
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_memory(const gradsync_shard* shard, uint64_t* weight_bytes, uint64_t* optimizer_bytes,
                                       uint64_t* buffer_bytes);

/** @brief Number of optimizer updates applied so far on this rank. @threadsafety handle */
GRADSYNC_API int gradsync_shard_updates(const gradsync_shard* shard, int64_t* updates);

/**
 * @brief Change the learning rate (finite, >= 0) for later updates. Local: set the same on every
 *        rank; ranks whose options differ get GRADSYNC_E_MISMATCH at the next collective stage.
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_set_lr(gradsync_shard* shard, double lr);

/* ---------------------------------------------------------------- training */

/**
 * @brief Local: keep this rank's slice of the full weights and zero the optimizer state. Pass the
 *        same weights on every rank (e.g. broadcast them first): each rank takes only its slice.
 * @param shard the sharded parameter
 * @param[in] weights count floats; count must equal total
 * @param count elements of weights (the parameter's length)
 * @retval GRADSYNC_E_INVALID_ARG NULL weights or count != total
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_init(gradsync_shard* shard, const float* weights, size_t count);

/**
 * @brief Local: gradsync_shard_init with the optimizer state too, to continue from a checkpoint
 *        taken on any number of ranks: keep this rank's slice of the full weights and of each full
 *        state, and set the update count (Adam's bias correction goes on from it). Pass the same
 *        arrays on every rank; each takes only its slice (and its replicas'). The error-feedback
 *        residual, each rank's own, starts from zero.
 * @param shard the sharded parameter
 * @param[in] weights count floats
 * @param[in] state1 count floats of the first state (MOMENTUM, ADAM, ADAMW), NULL for SGD
 * @param[in] state2 count floats of the second state (ADAM, ADAMW), NULL otherwise
 * @param count elements of each array (the parameter's length)
 * @param updates the updates applied so far, >= 0
 * @retval GRADSYNC_E_INVALID_ARG NULL weights, count != total, updates < 0, or a state missing
 *         where the optimizer keeps it or given where it keeps none (nothing changes)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_restore(gradsync_shard* shard, const float* weights, const float* state1,
                                        const float* state2, size_t count, int64_t updates);

/**
 * @brief Collective: one whole training step (put, aggregate, update, gather). Arguments are
 *        checked before any communication, and a bad argument on one rank is an error on every rank.
 * @param shard the sharded parameter
 * @param[in] gradient this rank's gradient, count floats (count == total)
 * @param[out] weights receives the new full weights, count floats; may equal gradient
 * @param count elements of the gradient (the parameter's length)
 * @param[in] samples this rank's sample count, its weight in the mean (pass 1 on every rank for the plain mean)
 * @retval GRADSYNC_E_INVALID_ARG NULL buffer or count != total (on this rank; GRADSYNC_E_REMOTE on the others)
 * @retval GRADSYNC_E_MISUSE step before init (on this rank; GRADSYNC_E_REMOTE on the others)
 * @retval GRADSYNC_E_ZERO_WEIGHT the sample counts of all ranks sum to 0 (every rank; weights untouched)
 * @retval GRADSYNC_E_MISMATCH ranks called different stages or have different totals or options (learning rate
 * included)
 * @retval GRADSYNC_E_TIMEOUT, GRADSYNC_E_ABORTED from the communicator
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_step(gradsync_shard* shard, const float* gradient, float* weights, size_t count,
                                     uint64_t samples);

/**
 * @brief Local: stage this rank's gradient (copied or encoded; the buffer is not kept).
 * @retval GRADSYNC_E_INVALID_ARG NULL gradient or count != total; the failure is also reported by
 *         every rank's next aggregate
 * @retval GRADSYNC_E_MISUSE put before init
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_put(gradsync_shard* shard, const float* gradient, size_t count, uint64_t samples);

/**
 * @brief Collective: this rank's part of the weighted mean of the gradients put on every rank,
 *        then clamping and norm clipping. Consumes the put gradients.
 * @retval GRADSYNC_E_MISUSE no fresh put on this rank since its last aggregate (GRADSYNC_E_REMOTE on the others)
 * @retval GRADSYNC_E_ZERO_WEIGHT the sample counts sum to 0 (every rank)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_aggregate(gradsync_shard* shard);

/**
 * @brief Local: run the optimizer on this rank's weight slice with the aggregated gradient.
 * @retval GRADSYNC_E_MISUSE no aggregated gradient to apply (also reported by every rank's next gather)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_update(gradsync_shard* shard);

/**
 * @brief Local: copy this rank's slice of the weights, the aggregated gradient or an optimizer
 *        state into out (count = its length). With gradsync_shard_updates and the other ranks'
 *        slices (gathered by the caller) this is the whole state, for a checkpoint.
 * @param shard the sharded parameter
 * @param[in] which a gradsync_shard_slice
 * @param out count floats
 * @param count elements to read
 * @retval GRADSYNC_E_INVALID_ARG unknown slice, a state the optimizer does not keep (SGD keeps none,
 *         MOMENTUM one), NULL out or count not the slice's length
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_read_slice(const gradsync_shard* shard, int32_t which, float* out, size_t count);

/**
 * @brief Local: set this rank's weight slice (count = its length), e.g. from the caller's own
 *        optimizer in place of gradsync_shard_update.
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_write_weights(gradsync_shard* shard, const float* slice, size_t count);

/**
 * @brief Collective: gather every rank's weight slice into weights (count == total), in full precision.
 * @retval GRADSYNC_E_MISUSE an aggregated gradient was not applied on this rank (GRADSYNC_E_REMOTE on the others)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_gather(gradsync_shard* shard, float* weights, size_t count);

/* ---------------------------------------------------------------- elastic */

/**
 * @brief Collective over new_comm: move the parameter onto new_comm, the group of its members that
 *        survived (gradsync_comm_shrink of its communicator) or a group grown from it
 *        (gradsync_comm_grow), without a restart or a file.
 *
 * A joiner of a grown group takes part with a shard it created on new_comm (gradsync_shard_create
 * with the members' total and options, the learning rate included) and did not initialise: it
 * sends nothing, and receives its slice (weights and optimizer state, and its replicas) and the
 * step count (gradsync_shard_updates) from the members. Its full weights then come from
 * gradsync_shard_gather, or by the caller's broadcast. At least one member must hold the parameter.
 *
 * Every member's slice is recomputed for new_comm's size (the partition rule), and what moves goes
 * among the survivors in all-to-all-v exchanges, one per array kept (weights, each optimizer
 * state, of the slice and of each replica), straight into it. The slices of lost ranks come from their replicas
 * (option replicas): losing up to `replicas` ranks that were neighbours on the replica ring, or
 * any number that were not (one replica across even hosts: a whole host), loses nothing, and the weights and optimizer
 * state continue bit for bit from the last completed step. A slice that lived only on lost ranks fails every member
 * with GRADSYNC_E_LOST naming its range, and nothing changes (restore from a checkpoint: gradsync_shard_restore). On
 * success the shard runs on new_comm (which must outlive it) and its parts are new_comm's.
 * The step that failed may have been applied everywhere before the loss showed (its gather failed)
 * and may have left the caller's weights half gathered: continue from gradsync_shard_updates, and
 * call gradsync_shard_gather first for the weights.
 * @param shard the parameter, on the old communicator
 * @param new_comm the survivors' communicator, or the grown one
 * @param[out] moved_floats floats this member received from others (may be NULL)
 * @retval GRADSYNC_E_LOST state lived only on lost ranks (every member; nothing changed)
 * @retval GRADSYNC_E_MISMATCH the members hold different parameters, options or steps
 * @retval GRADSYNC_E_MISUSE a member of the old group has no weights yet (gradsync_shard_init), or no
 *         member holds the parameter (only joiners)
 * @retval GRADSYNC_E_REMOTE, GRADSYNC_E_TIMEOUT, GRADSYNC_E_ABORTED from new_comm (shrink again)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_shard_reshard(gradsync_shard* shard, gradsync_comm* new_comm, uint64_t* moved_floats);

GRADSYNC_END_DECL

#endif /* GRADSYNC_SHARD_H */
