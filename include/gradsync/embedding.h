/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file embedding.h
 * @brief An embedding table of rows x dim f32 sharded row-wise over the ranks of a communicator:
 *        lookups and sparse gradient pushes routed to the rows' owners, exact and deterministic
 *        updates (SGD, row-wise Adagrad or sparse Adam), and checkpoints keyed by global row id that load into
 *        any world size and sharding rule.
 *
 * Ownership. Every global row id g in [0, rows) belongs to exactly one rank, by the rule the caller
 * picks at creation (the same on every rank):
 * - GRADSYNC_EMBEDDING_CONTIGUOUS: rank r owns the range the library's partition rule gives it:
 *   it starts at r*(rows/P) + min(r, rows%P) and holds rows/P + (r < rows%P) rows (P ranks).
 * - GRADSYNC_EMBEDDING_HASH: rank r owns the ids g with splitmix64(g) % P == r (splitmix64 as in
 *   gradsync_table_fill_uniform's generator); hot neighbouring ids spread over the ranks.
 * An owner keeps its rows, their gradient accumulator and their optimizer state as the library's
 * own tables (table.h, accumulator.h), in anonymous memory or in files under a directory.
 *
 * Calls. gradsync_embedding_lookup, _push, _save and _load are collective: every rank of the
 * communicator calls them in the same order (a rank with nothing to look up passes n = 0). Each
 * lookup or push first agrees on who sends how many ids to whom in one small allgather, which also
 * carries every rank's argument check, so a bad id or buffer on one rank fails the call on every
 * rank in the same round, before any data moves, with a message that names the rank, the position
 * and the id. Then a lookup moves the ids to their owners and the rows back in one all-to-all-v
 * each way; a push moves the ids with their gradients to the owners in one all-to-all-v.
 *
 * Determinism. A push is one step of the optimizer over the global batch: the concatenation of
 * every rank's (ids, grads) in rank order (rank 0's first, each rank's in its own order). A row's
 * gradient is the sum of its contributions in global batch order, starting from zero
 * (((0 + g_first) + g_second) + ...), in f32; then SGD (w -= lr*g), row-wise Adagrad
 * (s += mean(g^2); w -= lr*g/(sqrt(s)+eps)) or Adam updates each row that appears in the batch,
 * once. Adam is sparse ("lazy") Adam, torch.optim.SparseAdam's formula (not its bits: the order of
 * its arithmetic differs), applied to the rows
 * the batch touches only (the others' moments do not decay): each row keeps its first and second
 * moments m and v (dim floats each) and its own update count t, which counts the pushes that
 * touched that row, so a row's bias correction uses the number of times it was updated (torch's
 * SparseAdam counts the optimizer's steps instead: the same only while every row is touched at
 * every step). Per touched row, element by element in f32 (the corrections in double):
 *   t += 1; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
 *   w -= (lr * sqrt(1 - b2^t) / (1 - b1^t)) * m / (sqrt(v) + eps)
 * (gradsync_accum_apply's ADAM, accumulator.h, which says how far t is exact). The
 * table after any sequence of pushes is therefore bitwise the same for any world size, sharding
 * rule, transport, number of hosts and timing, and equal to what one process computes with
 * gradsync_accum_add_batch of the global batch followed by gradsync_accum_apply (with a table
 * created with the same init and seed). Rank 0 sends each distinct id of its push once, with its
 * gradients summed from zero in its own order: they come first in every row's sum, so that is the
 * very partial sum the owner reaches after them (no other rank's part is summed before it travels).
 *
 * Initial values. GRADSYNC_TABLE_INIT_UNIFORM gives element j of global row g the value that
 * gradsync_table_fill_uniform(seed, lo, hi) gives element g*dim + j of a rows x dim table: the same
 * table whatever the sharding.
 *
 * Checkpoints (a directory visible to every rank: a shared file system across hosts). Each rank
 * writes the rows it owns, sorted by global id, with their optimizer state, into a part file of its
 * own, in parallel; each part is written under a temporary name, fsync'ed and renamed into place;
 * when every part is durable, rank 0 commits the checkpoint by writing a manifest the same way (it
 * names the parts, their row counts and checksums, the shape, the optimizer and the step count),
 * then removes the parts of earlier checkpoints in the directory. A crash before the manifest is
 * renamed leaves the previous checkpoint whole. An incremental save writes only the rows pushed
 * since the checkpoint in its directory, as a layer on it, committed the same way: that checkpoint
 * is the table's last save or load, or its save before that in another directory (so two
 * directories saved in turn each keep a chain of their own); a load applies the layers in order.
 * Loading reads the manifest and, on each rank, the parts that hold its rows: the world size and
 * the sharding rule may differ from the saver's, and every row and its optimizer state come back
 * bitwise. Files are checked before use (magic,
 * version, sizes, checksums, ids sorted, in range, each present once): a damaged or hostile file
 * gives GRADSYNC_E_CORRUPT on every rank, never a crash, and leaves the table as it was.
 *
 * Replicas (option replicas = k). Rank r's rows and their optimizer state also live on the k ranks
 * after r on the group's replica ring (k is capped at size - 1), in this process's memory (also for
 * a table in files). The ring orders the ranks by local rank, then host (gradsync_comm_topology):
 * on one host it is rank order; on hosts that hold as many ranks each, a rank's next k ranks are on
 * other hosts (k < the number of hosts), so a replica outlives its owner's host. Each push sends every owner's batch
 * (the ids it adds, in its order, and their gradients) on to the k ranks that hold its replicas before anyone applies
 * it, and each applies it as the owner does, so that a replica equals its owner's rows bit for bit after every push,
 * and a push that fails leaves both as they were. gradsync_embedding_reshard after losing ranks then takes a lost
 * rank's rows from a surviving replica, in memory, without a checkpoint: losing up to k ranks that were neighbours on
 * the ring, or any number of which no k + 1 were, loses nothing (with one replica on two or more even hosts: a whole
 * host). Costs: k shards of memory per rank (values, optimizer state and gradient accumulator), and per push k more
 * transfers of each owner's batch (ids and gradients) and k more optimizer updates of it. A table in files refills its
 * replicas from the owners at its first push (an owner may have reopened its rows); so do load and reshard (a reshard
 * fills the new group's replicas).
 *
 * Thread safety: one thread at a time per handle; the table holds its communicator for the
 * duration of each collective call (a call on the communicator from another thread meanwhile gets
 * GRADSYNC_E_MISUSE). A table outlives its communicator safely: its collective calls then fail with
 * GRADSYNC_E_MISUSE.
 */
#ifndef GRADSYNC_EMBEDDING_H
#define GRADSYNC_EMBEDDING_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/comm.h"
#include "gradsync/common.h"
#include "gradsync/export.h"
#include "gradsync/table.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_embedding gradsync_embedding;

/** Which rank owns a row (the `sharding` field). */
typedef enum gradsync_embedding_sharding {
  GRADSYNC_EMBEDDING_CONTIGUOUS = 0, /**< rank r owns the r-th range of the partition rule (default) */
  GRADSYNC_EMBEDDING_HASH = 1        /**< rank r owns the rows g with splitmix64(g) % P == r */
} gradsync_embedding_sharding;

#define GRADSYNC_EMBEDDING_OPTIONS_VERSION 3

/** Options of gradsync_embedding_create. Fill with GRADSYNC_EMBEDDING_OPTIONS_INIT or gradsync_embedding_options_init.
 */
typedef struct gradsync_embedding_options {
  uint32_t struct_size; /**< sizeof(gradsync_embedding_options) as the caller compiled it */
  uint32_t version;     /**< GRADSYNC_EMBEDDING_OPTIONS_VERSION */
  int64_t rows;         /**< global rows, >= 1 (the same on every rank) */
  int64_t dim;          /**< floats per row, >= 1 (the same on every rank) */
  int32_t sharding;     /**< a gradsync_embedding_sharding; default CONTIGUOUS */
  int32_t optimizer;    /**< GRADSYNC_OPTIM_SGD (default), GRADSYNC_OPTIM_ROW_ADAGRAD or GRADSYNC_OPTIM_ADAM */
  double lr;            /**< learning rate, finite; default 0.01 */
  double eps;           /**< added to sqrt(state) (ROW_ADAGRAD) or sqrt(v) (ADAM), > 0, or 0 (the
                             default): the optimizer's own, 1e-10 ROW_ADAGRAD, 1e-8 ADAM (torch's) */
  int32_t init;         /**< a gradsync_table_init: ZEROS (default) or UNIFORM */
  int32_t threads;      /**< the owner threads that add an owner's received gradients (the
                             accumulator's GRADSYNC_ACCUM_OWNER mode), 1..64; UNSET = 1. The
                             result does not depend on it */
  uint64_t seed;        /**< seed of GRADSYNC_TABLE_INIT_UNIFORM */
  double lo;            /**< lower bound of UNIFORM (default -0.5) */
  double hi;            /**< upper bound of UNIFORM (default 0.5) */
  /* version 2 */
  double beta1; /**< ADAM: decay of m, in [0, 1); default 0.9 (torch's) */
  double beta2; /**< ADAM: decay of v, in [0, 1); default 0.999 (torch's) */
  /* version 3 */
  int32_t replicas;  /**< each rank's rows and their optimizer state also live on the next `replicas`
                          ranks (fewer in a smaller group), in [0, 64]; default 0. See "Replicas" */
  int32_t reserved0; /**< must be 0 */
  /* append only */
} gradsync_embedding_options;

#define GRADSYNC_EMBEDDING_OPTIONS_INIT                                                                              \
  {                                                                                                                  \
    sizeof(gradsync_embedding_options), GRADSYNC_EMBEDDING_OPTIONS_VERSION, 0, 0, GRADSYNC_EMBEDDING_CONTIGUOUS,     \
        GRADSYNC_OPTIM_SGD, 0.01, 0.0, GRADSYNC_TABLE_INIT_ZEROS, GRADSYNC_UNSET_I32, 0, -0.5, 0.5, 0.9, 0.999, 0, 0 \
  }

/**
 * @brief Fill opts with defaults (for FFIs that cannot expand GRADSYNC_EMBEDDING_OPTIONS_INIT).
 * @retval GRADSYNC_E_INVALID_ARG opts is NULL or struct_size is smaller than version 1's
 * @threadsafety any
 */
GRADSYNC_API int gradsync_embedding_options_init(gradsync_embedding_options* opts, size_t struct_size);

/* ---------------------------------------------------------------- lifecycle */

/**
 * @brief Create this rank's part of a sharded table. Local: no communication (every rank must pass
 *        the same rows, dim, sharding and optimizer; lookups and pushes check the rows and dim).
 * @param[out] out the new table; NULL on failure
 * @param comm the communicator; the table keeps a reference to it (not the handle)
 * @param[in] dir NULL: the shard lives in anonymous memory. Otherwise a directory (created if
 *        missing) where this rank keeps its shard as table files named
 *        shard-\<rank\>-of-\<size\>.{params,grad,state}; existing files of the same shape are reopened
 *        as they are (init then applies only to files created now). Borrowed for the call.
 * @param[in] opts the options (rows and dim required)
 * Lookups and pushes keep their send buffers between calls (about 1.25 x the largest batch's ids
 * x (dim + 2) x 4 bytes) in the communicator's memory when it has room, as gradsync_comm_alloc
 * would, so that peers on this host read them directly; they then count against what
 * gradsync_comm_alloc can give, and go back to the communicator at gradsync_embedding_free, or at
 * the communicator's end if the table is freed while another thread is in a call on it.
 * @retval GRADSYNC_E_INVALID_ARG bad options (rows or dim < 1, unknown sharding or init, an
 *         optimizer other than SGD, ROW_ADAGRAD or ADAM, bad lr, eps, betas, threads or bounds)
 * @retval GRADSYNC_E_MISUSE a bad communicator handle
 * @retval GRADSYNC_E_MISMATCH, GRADSYNC_E_CORRUPT, GRADSYNC_E_IO, GRADSYNC_E_NO_SPACE as for
 *         gradsync_table_open on the shard's files
 * @threadsafety any
 */
GRADSYNC_API int gradsync_embedding_create(gradsync_embedding** out, gradsync_comm* comm, const char* dir,
                                           const gradsync_embedding_options* opts);

/** @brief Free this rank's part (local; does not flush). NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_embedding_free(gradsync_embedding* table);

/**
 * @brief The global shape, and how many rows this rank owns. Any pointer may be NULL.
 * @threadsafety any
 */
GRADSYNC_API int gradsync_embedding_shape(const gradsync_embedding* table, int64_t* rows, int64_t* dim,
                                          int64_t* local_rows);

/**
 * @brief The rank that owns each of n ids (local; the sharding rule above).
 * @param table the table
 * @param[in] ids n global row ids
 * @param n the number of ids
 * @param[out] owners n ranks
 * @retval GRADSYNC_E_OUT_OF_RANGE an id outside [0, rows) (nothing written)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_embedding_owner(const gradsync_embedding* table, const int64_t* ids, size_t n,
                                          int32_t* owners);

/**
 * @brief The number of pushes applied since creation (or as loaded from a checkpoint): the
 *        table's scalar state, the same on every rank.
 * @threadsafety any
 */
GRADSYNC_API int gradsync_embedding_steps(const gradsync_embedding* table, int64_t* steps);

/**
 * @brief Change the learning rate of later pushes (local: set the same on every rank).
 * @retval GRADSYNC_E_INVALID_ARG lr not finite as a float
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_set_lr(gradsync_embedding* table, double lr);

/* ---------------------------------------------------------------- collective calls */

/**
 * @brief Look up n rows (collective). ids may repeat and come in any order; out receives row
 *        ids[i] at out[i*dim .. (i+1)*dim). Each rank passes its own ids (n may differ, and be 0).
 *        Each distinct id of a call travels to its owner once and its row comes back once, however
 *        often the call repeats it (at most 2^32 - 2 ids per call).
 * @param table the table
 * @param[in] ids n global row ids in [0, rows) (may be NULL when n is 0)
 * @param n the number of ids
 * @param[out] out n * dim floats (may be NULL when n is 0)
 * @param count n * dim
 * @retval GRADSYNC_E_OUT_OF_RANGE an id outside [0, rows) on some rank; every rank fails, with a
 *         message naming that rank, the position and the id ("rank 2: id 1000 at position 5 is
 *         outside [0, 100)"); nothing was moved
 * @retval GRADSYNC_E_INVALID_ARG a NULL buffer, count != n * dim or too many ids on some rank (every
 *         rank fails)
 * @retval GRADSYNC_E_MISMATCH the ranks' tables disagree on rows, dim or sharding
 * @retval GRADSYNC_E_MISUSE the communicator was freed, or is in a call on another thread
 * @return or an error of the communicator (GRADSYNC_E_TIMEOUT, _REMOTE, _ABORTED)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_lookup(gradsync_embedding* table, const int64_t* ids, size_t n, float* out,
                                           size_t count);

/**
 * @brief Push n row gradients and apply one optimizer step (collective): grads[i*dim ..] is the
 *        gradient of row ids[i]; repeats are summed. See "Determinism" above for the exact order.
 * @param table the table
 * @param[in] ids n global row ids in [0, rows) (may be NULL when n is 0)
 * @param n the number of ids
 * @param[in] grads n * dim floats, row i's gradient at i * dim (may be NULL when n is 0)
 * @param count n * dim
 * @retval GRADSYNC_E_OUT_OF_RANGE, GRADSYNC_E_INVALID_ARG, GRADSYNC_E_MISMATCH as for lookup: on
 *         every rank, before anything moves or changes
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_push(gradsync_embedding* table, const int64_t* ids, size_t n, const float* grads,
                                         size_t count);

/**
 * @brief Write a checkpoint into dir (collective; see "Checkpoints" above). Every rank passes the
 *        same dir, which is created if missing.
 * @retval GRADSYNC_E_IO a write, sync or rename failed on some rank (every rank fails; the
 *         previous checkpoint in dir stays whole)
 * @retval GRADSYNC_E_NO_SPACE the file system is full
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_save(gradsync_embedding* table, const char* dir);

/**
 * @brief Write only the rows pushed since the checkpoint in dir (collective), with their optimizer
 *        state and the step count, as a layer on it, which must still be there: the checkpoint of
 *        this table's last save or load, or of the save before that when it was into another
 *        directory (two directories saved in turn). Crash-safe as gradsync_embedding_save; loads
 *        the same way.
 * @param table the table
 * @param[in] dir the directory of the table's last save or load, or of its save before (the same
 *        on every rank)
 * @retval GRADSYNC_E_MISUSE the table has neither saved nor loaded that checkpoint in dir (a load
 *         forgets the saves before it, a reshard all but a restore's checkpoint), or another save
 *         replaced it since (every rank fails; save in full)
 * @return or an error as gradsync_embedding_save
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_save_incremental(gradsync_embedding* table, const char* dir);

/**
 * @brief Load a checkpoint from dir (collective): every row's values and optimizer state and the
 *        step count, whatever world size and sharding rule wrote it.
 * @retval GRADSYNC_E_MISMATCH the checkpoint holds another shape or another optimizer's state
 *         ("checkpoint has 100 x 16, the table 100 x 32")
 * @retval GRADSYNC_E_CORRUPT a damaged, truncated or hostile manifest or part (bad magic, sizes,
 *         checksum, ids out of order, out of range, missing or repeated)
 * @retval GRADSYNC_E_VERSION_MISMATCH a checkpoint of another format version
 * @retval GRADSYNC_E_IO no checkpoint in dir, or a read failed
 * On any error every rank fails and no row has changed.
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_load(gradsync_embedding* table, const char* dir);

/* ---------------------------------------------------------------- elastic */

/** gradsync_embedding_reshard's `sharding` that keeps the table's rule. */
#define GRADSYNC_EMBEDDING_KEEP_SHARDING (-1)

/**
 * @brief Collective over new_comm: move the table onto new_comm, a group of its members that
 *        survived (gradsync_comm_shrink), a group grown from it (gradsync_comm_grow, with joiners),
 *        or the same communicator under another sharding rule, without a restart. Every member of
 *        new_comm calls it, joiners included.
 *
 * A joiner takes part with a table it created on new_comm with the members' rows, dim, optimizer,
 * learning rate, eps and betas (its own rows are discarded): it sends nothing, and receives its rows and
 * the step count. A member brings its table from the old communicator (every table on new_comm, and
 * none from another, is a change of rule in place: tables that every rank made afresh on new_comm
 * are taken as such, so they keep their own rows).
 *
 * In memory (every old rank's rows live on a member): each row's new owner is computed for
 * new_comm's size and `sharding`; the rows that change owner travel with their optimizer state (an
 * all-to-all-v of the values, then one of the states when the optimizer keeps any), and every row
 * and its state continue bit for bit (the table stays equal to what one process computes, see
 * "Determinism"). checkpoint_dir is then not read.
 *
 * After a lost rank (a member of the old group that is not in new_comm) with replicas (option
 * replicas): when one of the `replicas` old ranks after it on the ring is a member, holds a valid
 * replica (no push failed on it after the owners applied) and every member is at the same step,
 * that member sends the lost rank's rows and state from its replica, and the reshard is in memory
 * as above (nothing to replay; restored = 0; checkpoint_dir is not read). This holds with joiners
 * too: a group that shrank and grew back to its size reshards onto the grown group in one call.
 * After a lost rank otherwise: its rows' live state is
 * gone, and the survivors' rows have moved on from any copy of them, so no consistent table exists
 * except as of the last checkpoint. Without checkpoint_dir the call fails on every rank with
 * GRADSYNC_E_LOST naming the lost rows ("old rank 2's rows [500, 750)") and changes nothing.
 * With it, EVERY row (the survivors' too) and the step count come from that checkpoint, as
 * gradsync_embedding_load reads it: the table is as it was at that checkpoint, never a mix of
 * states, and the caller replays its pushes since then (as Horovod elastic restores its last
 * commit); gradsync_embedding_steps tells from where.
 * A planned shrink takes the same path with nothing to replay: save on the old group, then reshard
 * the stayers (gradsync_comm_split) with that checkpoint.
 *
 * On any error every rank fails, and the table stays on its old communicator unchanged. On success
 * it runs on new_comm (which must outlive it), and the next gradsync_embedding_save_incremental
 * needs a full save first (unless the rows came from checkpoint_dir, which is then its base).
 * A shard in files (created with dir) gets the new layout's files in the same directory: they are
 * built under staging names (shard-\<rank\>-of-\<size\>.resharding.*), written back on every rank,
 * then renamed into place; a failure removes them and leaves the old files as they were. The old
 * layout's files are then removed when the group's size changed (a lost rank's by the new rank 0);
 * at the same size they are the new files' names.
 * @param table the table, on its old communicator (a joiner's: on new_comm)
 * @param new_comm the survivors', grown or same communicator
 * @param sharding a gradsync_embedding_sharding for the new group, or GRADSYNC_EMBEDDING_KEEP_SHARDING
 * @param checkpoint_dir NULL, or the directory of the last checkpoint, on every rank alike (read
 *        only when rows were lost)
 * @param[out] moved_rows rows this rank received from others (may be NULL; 0 after a restore)
 * @param[out] restored 1 when the rows came from checkpoint_dir, else 0 (may be NULL)
 * @retval GRADSYNC_E_LOST rows lived only on lost ranks and no checkpoint_dir was given (every rank;
 *         the message names the rows)
 * @retval GRADSYNC_E_MISMATCH the ranks hold different tables (shape, optimizer, learning rate, eps,
 *         betas), ask for different rules, are at different steps (judged only when no rows were
 *         lost: the checkpoint then gives the step) or come from different groups; or the checkpoint
 *         holds another shape or optimizer
 * @retval GRADSYNC_E_INVALID_ARG an unknown sharding, or checkpoint_dir given on some ranks only
 * @retval GRADSYNC_E_NO_SPACE a rank could not write its new shard's files (every rank fails with it)
 * @retval GRADSYNC_E_NOMEM a rank could not allocate its new shard, the rows it reads or the
 *         exchange's buffers (every rank fails with it)
 * @retval GRADSYNC_E_MISUSE a bad handle
 * @retval GRADSYNC_E_CORRUPT, GRADSYNC_E_VERSION_MISMATCH, GRADSYNC_E_IO as for
 *         gradsync_embedding_load; E_IO also when a rank could not write its new shard's files
 * @retval GRADSYNC_E_REMOTE, GRADSYNC_E_TIMEOUT, GRADSYNC_E_ABORTED from new_comm (a rank died during the
 *         call): shrink new_comm and reshard onto its survivors with checkpoint_dir (a joiner, which
 *         never held the table, creates it anew on them), then replay
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_reshard(gradsync_embedding* table, gradsync_comm* new_comm, int32_t sharding,
                                            const char* checkpoint_dir, uint64_t* moved_rows, int32_t* restored);

/* ---------------------------------------------------------------- local access */

/**
 * @brief Copy this rank's rows and optimizer state out, with their global ids, in ascending
 *        global id order (local; for tests and inspection).
 * @param table the table
 * @param[out] ids local_rows ids (may be NULL)
 * @param[out] values local_rows * dim floats (may be NULL)
 * @param[out] state local_rows x w floats of optimizer state, row after row (may be NULL): w = 1
 *        for SGD (zeros) and ROW_ADAGRAD (its s), 2*dim + 1 for ADAM (m, then v, then the row's
 *        update count t as a float)
 * @param capacity the rows each non-NULL buffer can hold
 * @retval GRADSYNC_E_BUFS capacity < local_rows: nothing was copied
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_embedding_local_rows(const gradsync_embedding* table, int64_t* ids, float* values,
                                               float* state, size_t capacity);

GRADSYNC_END_DECL

#endif /* GRADSYNC_EMBEDDING_H */
