/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file accumulator.h
 * @brief The sparse gradient accumulator: a gradient table (rows x dim f32, in a memory-mapped
 *        file or anonymous memory) plus the set of rows touched since the last apply.
 *
 * Many threads, and several processes that open the same gradient file, add row gradients at
 * once; gradsync_accum_apply() then updates only the touched rows of a parameter table (SGD or
 * PyTorch-BigGraph's row-wise Adagrad), in O(touched x dim), and zeroes exactly those rows.
 *
 * Concurrency modes, chosen at open (every process on one file must use the same):
 * - GRADSYNC_ACCUM_STRIPED (default): rows share process-shared spin locks kept in the file: the
 *   largest power of two <= rows / rows_per_lock of them, rows hashed onto locks (so each lock
 *   covers rows_per_lock to 2 x rows_per_lock rows). Exact: no update is ever lost.
 * - GRADSYNC_ACCUM_LOCK_FREE: every float is added with an atomic compare-and-swap. Exact.
 * - GRADSYNC_ACCUM_NONE: plain adds (Hogwild). Racy by design: concurrent adds to the same row may
 *   lose updates. The touched set stays exact.
 * - GRADSYNC_ACCUM_OWNER: exact and deterministic. Rows are split into at most 64 partitions
 *   (hashed), partition p owned by owner p % threads. Owner 0 is the calling thread, the others are
 *   threads - 1 threads of the handle. A batch of 256 rows or more is handed to the owners: batches
 *   enter one sequence in the order their calls do (for one calling thread, call order), and the
 *   owners share each batch out so that every row of it is added by one owner, after the batches
 *   before it, in position order within the batch, with no lock per row; the call returns when
 *   every owner is done with its batch. Each row therefore receives its
 *   gradients in a fixed order, and the gradient table is bitwise the same for the same sequence of
 *   batches whatever the number of owner threads or calling threads and their timing. Smaller
 *   batches are added by the calling thread in the same order. Several processes on one file each
 *   run their own owners, excluded from each other by a process-shared lock per partition (exact;
 *   the order between processes is their timing's). A process forked after the open must open the
 *   file again: the handle's owner threads are not in the child (E_MISUSE).
 *
 * Thread safety: add, add_batch and get may be called from any thread at once (and from several
 * processes on one file). zero, apply and touched exclude this process's adds while they run; the
 * caller must make sure other processes on the same file do not add meanwhile (e.g. a barrier).
 *
 * Crash behaviour: a row is marked touched before its gradient is added, so a crash never hides a
 * gradient from apply. gradsync_accum_flush() is durable like gradsync_table_flush(). A process that
 * dies holding a row lock (killed, even left a zombie) is detected by its peers through a lock the
 * kernel drops at its exit (no pid is trusted), and they take the row lock over; that row may hold
 * part of the dead process's add, so from then on gradsync_accum_get and gradsync_accum_apply fail
 * with GRADSYNC_E_CORRUPT on every process until gradsync_accum_zero (or a lone reopen). A row lock
 * held by a live process for more than a few seconds (a stopped one) makes the waiting add fail
 * with GRADSYNC_E_TIMEOUT: the rows of the batch before that row were added, the others not (owner
 * mode: the partitions whose lock was taken were added, the others not). apply is not atomic:
 * after a crash in the middle of one, the rows it had not reached are still touched and are applied
 * by the next apply (flush the parameters and the gradients together after apply to commit it).
 * A gradient file truncated by another process makes calls fail with GRADSYNC_E_IO, as for tables.
 */
#ifndef GRADSYNC_ACCUMULATOR_H
#define GRADSYNC_ACCUMULATOR_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/common.h"
#include "gradsync/export.h"
#include "gradsync/table.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_accum gradsync_accum;

/** Concurrency modes (the `concurrency` field). */
typedef enum gradsync_accum_concurrency {
  GRADSYNC_ACCUM_STRIPED = 0,   /**< striped process-shared locks (default); exact */
  GRADSYNC_ACCUM_LOCK_FREE = 1, /**< atomic compare-and-swap per float; exact */
  GRADSYNC_ACCUM_NONE = 2,      /**< no synchronisation (Hogwild): racy, may lose concurrent updates */
  GRADSYNC_ACCUM_OWNER = 3      /**< rows partitioned over owner threads; exact and deterministic */
} gradsync_accum_concurrency;

#define GRADSYNC_ACCUM_OPTIONS_VERSION 3

/** Options of gradsync_accum_open. Fill with GRADSYNC_ACCUM_OPTIONS_INIT or gradsync_accum_options_init. */
typedef struct gradsync_accum_options {
  uint32_t struct_size;      /**< sizeof(gradsync_accum_options) as the caller compiled it */
  uint32_t version;          /**< GRADSYNC_ACCUM_OPTIONS_VERSION */
  int32_t mode;              /**< a gradsync_table_mode (CREATE, OPEN, CREATE_OR_OPEN default, ANONYMOUS) */
  int32_t concurrency;       /**< a gradsync_accum_concurrency; UNSET = what other processes on the file
                                  use, else STRIPED */
  int64_t rows;              /**< rows, >= 1; UNSET when opening = take the file's */
  int64_t dim;               /**< floats per row, >= 1; UNSET when opening = take the file's */
  int64_t rows_per_lock;     /**< STRIPED: rows per lock, >= 1; UNSET = what other processes use, else 16.
                                  OWNER: partitions = min(64, the STRIPED lock count) */
  int64_t threads;           /**< OWNER (version 2): owners, 1..64 (the caller and threads - 1 threads of the
                                  handle); UNSET = the CPUs this process may run on, at most its cgroups' CPU
                                  quota (a container's --cpus) and at most 64. Ignored by the other modes */
  int32_t file_mode;         /**< version 3: permission bits of a created file, exactly (umask ignored);
                                  0 (default) means 0600 (other users who share the file need more) */
  int32_t allow_other_owner; /**< version 3: 1: open a file owned by another user; default 0
                                  (GRADSYNC_E_PERMISSION) */
  /* append only */
} gradsync_accum_options;

#define GRADSYNC_ACCUM_OPTIONS_INIT                                                                                    \
  {                                                                                                                    \
    sizeof(gradsync_accum_options), GRADSYNC_ACCUM_OPTIONS_VERSION, GRADSYNC_TABLE_CREATE_OR_OPEN, GRADSYNC_UNSET_I32, \
        GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, 0, 0                           \
  }

/* The optimizers (the `kind` field) are gradsync_optimizer_kind, in gradsync/common.h: SGD,
   ROW_ADAGRAD and ADAM here. ADAM on a table is sparse ("lazy") Adam as torch.optim.SparseAdam:
   only the touched rows are updated, each with its own first and second moments m, v (dim floats
   each) and its own update count t, so a row's bias correction counts the applies that updated it
   (torch's SparseAdam counts the optimizer's steps: the same when every row is touched at every
   step). Per touched row, in f32 element by element (bias corrections in double):
     t += 1; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
     w -= (lr * sqrt(1 - b2^t) / (1 - b1^t)) * m / (sqrt(v) + eps)
   Its state table has rows x (2*dim + 1) floats: m, then v, then t (as a float: exact up to 2^24
   updates of a row, where it stays; both corrections are then 1 in double for betas up to
   1 - 2^-18, so the result is the same as an exact count's). */

#define GRADSYNC_OPTIMIZER_VERSION 2

/** An optimizer step. Fill with GRADSYNC_OPTIMIZER_INIT or gradsync_optimizer_init. */
typedef struct gradsync_optimizer {
  uint32_t struct_size; /**< sizeof(gradsync_optimizer) as the caller compiled it */
  uint32_t version;     /**< GRADSYNC_OPTIMIZER_VERSION */
  int32_t kind;         /**< a gradsync_optimizer_kind; default SGD */
  int32_t reserved0;    /**< must be 0 */
  double lr;            /**< learning rate, finite; default 0.01 */
  double eps;           /**< added to sqrt(state) (ROW_ADAGRAD) or sqrt(v) (ADAM), finite and > 0, or 0
                             (the default): the optimizer's own, 1e-10 ROW_ADAGRAD, 1e-8 ADAM */
  /* version 2 */
  double beta1; /**< ADAM: decay of m, in [0, 1); default 0.9 */
  double beta2; /**< ADAM: decay of v, in [0, 1); default 0.999 */
  /* append only */
} gradsync_optimizer;

#define GRADSYNC_OPTIMIZER_INIT \
  { sizeof(gradsync_optimizer), GRADSYNC_OPTIMIZER_VERSION, GRADSYNC_OPTIM_SGD, 0, 0.01, 0.0, 0.9, 0.999 }

/** @brief Fill opts with defaults (FFIs). @retval GRADSYNC_E_INVALID_ARG NULL or too small. @threadsafety any */
GRADSYNC_API int gradsync_accum_options_init(gradsync_accum_options* opts, size_t struct_size);

/** @brief Fill opt with defaults (FFIs). @retval GRADSYNC_E_INVALID_ARG NULL or too small. @threadsafety any */
GRADSYNC_API int gradsync_optimizer_init(gradsync_optimizer* opt, size_t struct_size);

/* ---------------------------------------------------------------- lifecycle */

/**
 * @brief Open, create or allocate an accumulator. A process that opens the file while no other
 *        has it open resets the locks and rebuilds the touched list (after a crash, say).
 * @param[out] out the new accumulator; NULL on failure
 * @param[in] path the gradient file (NULL for GRADSYNC_TABLE_ANONYMOUS). Borrowed for the call.
 * @param[in] opts options; NULL means defaults (rows and dim then come from an existing file)
 * @retval GRADSYNC_E_MISMATCH another shape, a plain table's file, or another concurrency mode than
 *         the processes that have the file open
 * @retval GRADSYNC_E_CORRUPT, GRADSYNC_E_VERSION_MISMATCH, GRADSYNC_E_IO, GRADSYNC_E_NO_SPACE, GRADSYNC_E_PERMISSION,
 * GRADSYNC_E_TIMEOUT as for tables
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_open(gradsync_accum** out, const char* path, const gradsync_accum_options* opts);

/** @brief Unmap and close (does not flush). NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_accum_free(gradsync_accum* accum);

/** @brief Rows and floats per row. Either pointer may be NULL. @threadsafety any */
GRADSYNC_API int gradsync_accum_shape(const gradsync_accum* accum, int64_t* rows, int64_t* dim);

/** @brief The concurrency mode and rows per lock in use. Either pointer may be NULL. @threadsafety any */
GRADSYNC_API int gradsync_accum_get_concurrency(const gradsync_accum* accum, int32_t* concurrency,
                                                int64_t* rows_per_lock);

/* ---------------------------------------------------------------- adding gradients */

/**
 * @brief grad[row] += grad (count must equal dim), and mark the row touched.
 * @retval GRADSYNC_E_OUT_OF_RANGE row outside [0, rows)
 * @retval GRADSYNC_E_INVALID_ARG grad is NULL or count != dim ("the gradient has 32 floats, ... dim 64")
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_add(gradsync_accum* accum, int64_t row, const float* grad, size_t count);

/**
 * @brief For each i < n: grad[rows[i]] += grads[i*dim .. (i+1)*dim). One call per minibatch.
 *        Repeated ids are summed. Every id and the length are checked before any row is written.
 *        A failure after that (GRADSYNC_E_TIMEOUT, or GRADSYNC_E_NOMEM in OWNER mode, where the
 *        owners share the batch out) leaves part of the batch added; every added row is touched.
 * @param accum the accumulator
 * @param rows n row ids, each in [0, rows)
 * @param n the number of rows
 * @param grads n * dim floats, row i's at i * dim
 * @param[in] count n * dim
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_add_batch(gradsync_accum* accum, const int64_t* rows, size_t n, const float* grads,
                                          size_t count);

/**
 * @brief Copy the gradient of one row out, under that row's lock (a consistent row in STRIPED and
 *        OWNER modes).
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_get(gradsync_accum* accum, int64_t row, float* out, size_t count);

/* ---------------------------------------------------------------- whole-set operations */

/** @brief Zero the touched rows and empty the touched set, O(touched x dim). @threadsafety any */
GRADSYNC_API int gradsync_accum_zero(gradsync_accum* accum);

/** @brief Number of touched rows. @threadsafety any */
GRADSYNC_API int gradsync_accum_touched_count(gradsync_accum* accum, int64_t* count);

/**
 * @brief The touched rows, in the order they were first touched (OWNER mode: each owner's rows in
 *        that order, the owners' interleaved as they ran).
 * @param accum the accumulator
 * @param[out] out receives *needed ids when capacity >= *needed
 * @param capacity entries out can hold
 * @param[out] needed the number of touched rows (always written)
 * @retval GRADSYNC_E_BUFS capacity < *needed: nothing was copied
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_touched(gradsync_accum* accum, int64_t* out, size_t capacity, size_t* needed);

/**
 * @brief Update params (and state) from the touched rows' gradients, then zero exactly those rows
 *        and empty the touched set. Reads and writes only touched rows: O(touched x dim).
 * @param accum the accumulator
 * @param[in,out] params a writable table of the same rows x dim
 * @param[in] opt the optimizer; NULL = SGD with lr 0.01
 * @param[in,out] state ROW_ADAGRAD: a writable table of rows x 1, ADAM: rows x (2*dim + 1) (start
 *        them at zeros); SGD: NULL
 * @retval GRADSYNC_E_MISMATCH params or state of another shape ("parameter table has 100 x 32, ...")
 * @retval GRADSYNC_E_MISUSE params or state is read-only
 * @retval GRADSYNC_E_INVALID_ARG bad optimizer (or eps, betas), missing or superfluous state. Nothing
 *         is written on error.
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_apply(gradsync_accum* accum, gradsync_table* params, const gradsync_optimizer* opt,
                                      gradsync_table* state);

/** @brief Make the gradients and touched set durable, as gradsync_table_flush. @threadsafety any */
GRADSYNC_API int gradsync_accum_flush(gradsync_accum* accum);

/**
 * @brief Borrow a read-only view of the gradient data (rows * dim floats, row-major).
 * @param accum the accumulator
 * @param[out] data points into the mapping: do not write through it. Valid until gradsync_accum_free.
 * @param[out] bytes rows * dim * 4
 * @threadsafety any
 */
GRADSYNC_API int gradsync_accum_view(const gradsync_accum* accum, const void** data, size_t* bytes);

GRADSYNC_END_DECL

#endif /* GRADSYNC_ACCUMULATOR_H */
