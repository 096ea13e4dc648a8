/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file gradsync.h
 * @brief libgradsync: gradient synchronisation for data-parallel training, behind a C ABI.
 *
 * Thread-safety rule: unless a function's comment says otherwise, a handle must not be used by
 * two threads at once; different handles may be used in parallel. Use a handle only in the
 * process that created it, never across fork(); a communicator, its requests and its shards that
 * a fork() copied into a child are refused there (GRADSYNC_E_MISUSE) and may only be freed (comm.h).
 *
 * Error model: every fallible function returns an int status (errors.h); on failure the
 * reason is in gradsync_last_error_message() on the calling thread. Constructors write the new
 * handle through an out-parameter (NULL on failure). Every *_free(NULL) is a no-op.
 *
 * A freed handle is invalid: as with a pointer after free(), using it is undefined behaviour. Where
 * a comment below lists a "freed" handle under GRADSYNC_E_MISUSE, that is a debugging aid which
 * works only while the handle's memory has not been reused, never a guarantee.
 */
#ifndef GRADSYNC_GRADSYNC_H
#define GRADSYNC_GRADSYNC_H

#include "gradsync/common.h"
#include "gradsync/errors.h"
#include "gradsync/export.h"
#include "gradsync/log.h"
#include "gradsync/version.h"
/* component headers */
#include "gradsync/accumulator.h"
#include "gradsync/atomics.h"
#include "gradsync/codec.h"
#include "gradsync/comm.h"
#include "gradsync/dataparallel.h"
#include "gradsync/embedding.h"
#include "gradsync/shard.h"
#include "gradsync/table.h"

#endif /* GRADSYNC_GRADSYNC_H */
