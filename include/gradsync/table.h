/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file table.h
 * @brief Tables of rows x dim f32 in memory-mapped files (or anonymous memory): embeddings,
 *        parameters and optimizer state for the sparse gradient accumulator (accumulator.h).
 *
 * A table file has a checksummed header kept in two alternating slots (LMDB style) before the
 * page-aligned row-major data; docs/file-format.md describes it byte by byte. Guarantees:
 * - An existing file is never reinterpreted, truncated or extended: another shape gives
 *   GRADSYNC_E_MISMATCH naming both ("file has 100 x 32, asked for 100 x 64"), a damaged header or a
 *   wrong file size GRADSYNC_E_CORRUPT, another format version GRADSYNC_E_VERSION_MISMATCH.
 * - Creation is atomic: the file is built under a private name and linked into place, so a crash
 *   during creation leaves no half-made table behind the path.
 * - gradsync_table_flush() is durable when it returns: every row written before the call survives a
 *   crash of the process or of the machine. Rows written after the last flush survive a crash of the
 *   process (they are in the shared page cache) but not necessarily of the machine; a row whose write
 *   the crash interrupted may hold part of its new values and part of its old ones.
 * - A file that another process truncates while it is open never ends this process with SIGBUS:
 *   the call that meets the missing part, and every later call on the handle, fails with
 *   GRADSYNC_E_IO ("... shrank under its mapping ..."); free the handle and reopen. (This relies on
 *   a SIGBUS handler the library installs; one the application installs later must chain to it.)
 *
 * Thread safety: reads and writes of distinct rows may run in parallel from any thread; writes to
 * the same row from two threads at once are not synchronised (use the accumulator for that).
 */
#ifndef GRADSYNC_TABLE_H
#define GRADSYNC_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/common.h"
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_table gradsync_table;

/** How to open a table file (the `mode` field of the options). */
typedef enum gradsync_table_mode {
  GRADSYNC_TABLE_CREATE = 1,         /**< create a new file; fails (GRADSYNC_E_IO) if the path exists */
  GRADSYNC_TABLE_OPEN = 2,           /**< open an existing file; fails (GRADSYNC_E_IO) if there is none */
  GRADSYNC_TABLE_CREATE_OR_OPEN = 3, /**< open the file, creating it when it does not exist (default) */
  GRADSYNC_TABLE_ANONYMOUS = 4       /**< memory only, no file: the path must be NULL */
} gradsync_table_mode;

/** How a newly created table is filled (`init` field). */
typedef enum gradsync_table_init {
  GRADSYNC_TABLE_INIT_ZEROS = 0,  /**< all zeros (default) */
  GRADSYNC_TABLE_INIT_UNIFORM = 1 /**< uniform in [lo, hi], a deterministic function of seed and element index */
} gradsync_table_init;

#define GRADSYNC_TABLE_OPTIONS_VERSION 2

/** Options of gradsync_table_open. Fill with GRADSYNC_TABLE_OPTIONS_INIT or gradsync_table_options_init. */
typedef struct gradsync_table_options {
  uint32_t struct_size; /**< sizeof(gradsync_table_options) as the caller compiled it */
  uint32_t version;     /**< GRADSYNC_TABLE_OPTIONS_VERSION */
  int32_t mode;         /**< a gradsync_table_mode; default GRADSYNC_TABLE_CREATE_OR_OPEN */
  int32_t read_only;    /**< 1: map read-only (mode OPEN only); writes fail with GRADSYNC_E_MISUSE */
  int64_t rows;         /**< rows, >= 1; GRADSYNC_UNSET_I64 when opening = take the file's */
  int64_t dim;          /**< floats per row, >= 1; GRADSYNC_UNSET_I64 when opening = take the file's */
  int32_t dtype;        /**< element type; only GRADSYNC_F32 */
  int32_t init;         /**< a gradsync_table_init, applied only when the table is created */
  uint64_t seed;        /**< seed of GRADSYNC_TABLE_INIT_UNIFORM */
  double lo;            /**< lower bound of GRADSYNC_TABLE_INIT_UNIFORM (default -0.5) */
  double hi;            /**< upper bound of GRADSYNC_TABLE_INIT_UNIFORM (default 0.5) */
  /* version 2 */
  int32_t file_mode;         /**< permission bits of a created file, exactly (umask ignored); 0 (default)
                                  means 0600 */
  int32_t allow_other_owner; /**< 1: open a file owned by another user; default 0 (GRADSYNC_E_PERMISSION) */
  /* append only */
} gradsync_table_options;

#define GRADSYNC_TABLE_OPTIONS_INIT                                                                         \
  {                                                                                                         \
    sizeof(gradsync_table_options), GRADSYNC_TABLE_OPTIONS_VERSION, GRADSYNC_TABLE_CREATE_OR_OPEN, 0,       \
        GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, GRADSYNC_F32, GRADSYNC_TABLE_INIT_ZEROS, 0, -0.5, 0.5, 0, 0 \
  }

/**
 * @brief Fill opts with defaults (for FFIs that cannot expand GRADSYNC_TABLE_OPTIONS_INIT).
 * @param[out] opts the options to fill
 * @param[in] struct_size sizeof(gradsync_table_options) as the caller knows it
 * @retval GRADSYNC_E_INVALID_ARG opts is NULL or struct_size is smaller than version 1's
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_options_init(gradsync_table_options* opts, size_t struct_size);

/* ---------------------------------------------------------------- lifecycle */

/**
 * @brief Open, create, or allocate a table.
 * @param[out] out the new table; NULL on failure
 * @param[in] path the file (NULL for GRADSYNC_TABLE_ANONYMOUS). Borrowed for the call.
 * @param[in] opts options; NULL means defaults (then rows and dim must come from an existing file)
 * @retval GRADSYNC_E_MISMATCH the file has another shape than asked for, or is an accumulator's file
 * @retval GRADSYNC_E_CORRUPT bad magic, checksum or header in both slots, or a file size that
 *         disagrees with the header
 * @retval GRADSYNC_E_VERSION_MISMATCH another format version, dtype or byte order
 * @retval GRADSYNC_E_IO the file exists (CREATE), does not exist (OPEN), or a system call failed
 * @retval GRADSYNC_E_NO_SPACE the file system has no room for the new file, or for the blocks of an
 *         existing sparse file opened for writing (its holes are allocated at open)
 * @retval GRADSYNC_E_INVALID_ARG bad options (rows or dim < 1 to create, unknown mode, ...)
 * @retval GRADSYNC_E_PERMISSION the file belongs to another user and allow_other_owner is 0
 * @retval GRADSYNC_E_TIMEOUT another process has held the file exclusively (as a lone opener does
 *         while it checks and allocates the file) past the open's deadline: it is stopped or stuck
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_open(gradsync_table** out, const char* path, const gradsync_table_options* opts);

/** @brief Unmap and close (does not flush). NULL is a no-op. @threadsafety handle */
GRADSYNC_API void gradsync_table_free(gradsync_table* table);

/** @brief Rows and floats per row. Either pointer may be NULL. @threadsafety any */
GRADSYNC_API int gradsync_table_shape(const gradsync_table* table, int64_t* rows, int64_t* dim);

/**
 * @brief Whether gradsync_table_open created the table (1) or opened an existing file (0).
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_created(const gradsync_table* table, int32_t* created);

/* ---------------------------------------------------------------- rows */

/**
 * @brief Copy row `row` into out (count must equal dim).
 * @retval GRADSYNC_E_OUT_OF_RANGE row outside [0, rows)
 * @retval GRADSYNC_E_INVALID_ARG out is NULL or count != dim
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_get(const gradsync_table* table, int64_t row, float* out, size_t count);

/**
 * @brief Overwrite row `row` with values (count must equal dim). values may point into this table
 *        (read from gradsync_table_view), even into the row itself.
 * @retval GRADSYNC_E_MISUSE the table is read-only
 * @threadsafety any (not synchronised with other writers of the same row)
 */
GRADSYNC_API int gradsync_table_set(gradsync_table* table, int64_t row, const float* values, size_t count);

/**
 * @brief Copy n rows (ids in `rows`, repeats allowed) into out, row after row; count = n * dim.
 *        Every id is checked before anything is copied.
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_gather(const gradsync_table* table, const int64_t* rows, size_t n, float* out,
                                       size_t count);

/**
 * @brief Write n rows from values (n x dim, row after row). Every id is checked before any row is
 *        written; with repeated ids the last one wins. values may point into this table; rows are
 *        written in order, each from values as they are when it is written.
 * @threadsafety any (not synchronised with other writers of the same rows)
 */
GRADSYNC_API int gradsync_table_scatter(gradsync_table* table, const int64_t* rows, size_t n, const float* values,
                                        size_t count);

/** @brief Set every element to zero. @threadsafety handle */
GRADSYNC_API int gradsync_table_fill_zero(gradsync_table* table);

/**
 * @brief Fill with uniform values in [lo, hi]: element i gets a fixed function of (seed, i), so
 *        the same seed gives the same table on every run and machine.
 * @retval GRADSYNC_E_INVALID_ARG lo > hi or not finite
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_table_fill_uniform(gradsync_table* table, uint64_t seed, float lo, float hi);

/**
 * @brief Make every row written so far durable: msync + fsync of the data, then the next header
 *        slot is written and synced. A no-op for anonymous and read-only tables.
 * @retval GRADSYNC_E_IO a write or sync failed
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_flush(gradsync_table* table);

/**
 * @brief Hint that these rows are about to be used (madvise WILLNEED on their pages). Ids are
 *        checked; no data changes.
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_prefetch(const gradsync_table* table, const int64_t* rows, size_t n);

/**
 * @brief Borrow a read-only view of the whole row-major data (rows * dim floats).
 * @param table the table
 * @param[out] data the first float; it points into the mapping itself: do not write through it.
 *        Valid until gradsync_table_free.
 * @param[out] bytes rows * dim * 4
 * @threadsafety any
 */
GRADSYNC_API int gradsync_table_view(const gradsync_table* table, const void** data, size_t* bytes);

GRADSYNC_END_DECL

#endif /* GRADSYNC_TABLE_H */
