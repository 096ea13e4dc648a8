/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file comm.h
 * @brief The communicator: a group of ranks and their collectives, over one interface for every
 *        transport (threads of one process, processes of one host, MPI across machines).
 *
 * Switching transport is one field of the options. Semantics common to every transport:
 * - Buffers are caller-owned and borrowed for the duration of a call only; send == recv means
 *   in place (reduce-scatter and allgather: the part at this rank's offset); send and recv that
 *   overlap otherwise are GRADSYNC_E_INVALID_ARG. The collectives that reduce (allreduce,
 *   allreduce_many, weighted_mean, reduce_scatter) take buffers aligned to the element size, as
 *   a C array of that type is; a misaligned one is GRADSYNC_E_INVALID_ARG. (broadcast, allgather
 *   and alltoall move bytes and take any alignment.)
 * - Deterministic: each element is reduced in rank order, never in arrival order, so every rank
 *   gets bitwise the same result on every run (on MPI when `deterministic` is set).
 * - One outcome per call: either every rank returns GRADSYNC_OK with the same result, or every
 *   rank gets an error for that call, whatever races it (completion, abort, timeout, a dying
 *   peer; on MPI, see its limit below). After an error and gradsync_comm_reset on every rank,
 *   the next call is the same call on every rank. On an error, recv buffers hold unspecified data
 *   (a zero-copy shm buffer may still be written by a stopped peer until the reset returns).
 * - Never hangs: ranks that disagree in a round (count, dtype, op, root, collective) all get
 *   GRADSYNC_E_MISMATCH naming both sides, and the next round works. An argument that only the
 *   group can judge (a broadcast root, a dtype the reduction lacks, a weight) fails every rank in
 *   that same call, naming the rank that passed it. A rank that does not arrive within the
 *   timeout gives GRADSYNC_E_TIMEOUT on every waiting rank; gradsync_comm_abort from any thread
 *   unblocks every waiter with GRADSYNC_E_ABORTED. After a timeout or abort every call fails fast
 *   with GRADSYNC_E_ABORTED until the group is reset (gradsync_comm_reset) or freed.
 * - Weighted mean: sum over ranks of weight * x in double, in rank order, divided once by the
 *   total weight and rounded once; a rank of weight 0 contributes nothing, even NaN or inf.
 * - A group of size 1 returns at once, leaving the buffers bit for bit as they are (recv = send).
 * - One thread at a time per handle, checked: a collective, gradsync_comm_reset,
 *   gradsync_comm_alloc or gradsync_comm_free_buffer (or a collective stage of a shard made on
 *   the communicator) called while another thread is inside one of them on the same handle fails
 *   at once with GRADSYNC_E_MISUSE and touches nothing; the running call is unaffected. Exempt:
 *   gradsync_comm_abort (any thread, any time) and the rank, size and transport getters (values
 *   fixed at creation). gradsync_comm_free during a call on another thread: see there.
 * - fork(): a communicator belongs to the process that created it, on every transport. In a child
 *   forked from that process (with or without calls in flight there), every function given the
 *   communicator, a request of it or a shard made on it fails with GRADSYNC_E_MISUSE, saying that
 *   it belongs to the parent process and naming that process's pid; none of them waits (so
 *   gradsync_request_wait on a request started before the fork returns at once). The exceptions
 *   are the frees: gradsync_comm_free there releases only what is the child's own (the shm
 *   transport, and the hierarchical one's shared-memory level, unmap the segment and close its
 *   descriptor; the thread and MPI transports release nothing, since their state is the parent's or
 *   MPI's), never tells the group, never touches the segment's shared state and never joins a
 *   thread (the progress thread is the parent's); gradsync_request_free and gradsync_shard_free
 *   release the handle without waiting. The parent's group, and the parent's calls in flight,
 *   carry on unaffected. A child wanting to communicate creates communicators of its own.
 * - Timeouts: any timeout_ms up to INT64_MAX (GRADSYNC_NO_TIMEOUT) works; a deadline too far to
 *   represent saturates to one that never passes, never overflowing into the past.
 * - Partition rule (reduce-scatter, allgather, alltoall): part i of n elements over p ranks
 *   starts at i*(n/p) + min(i, n%p) and holds n/p + (i < n%p) elements.
 *
 * Shared-memory transport (GRADSYNC_TRANSPORT_SHM; processes of one host):
 * - Group: the processes that create a communicator with the same name (rank, size, name as for
 *   threads) meet in the segment /dev/shm/gradsync.\<name\> (bytes outside [A-Za-z0-9._-] escaped).
 *   A late joiner within timeout_ms is fine. A segment left by a crashed run (no live member, or
 *   never finished) is rebuilt; a running group whose member died is never joined. Members that
 *   disagree on size get GRADSYNC_E_MISMATCH, as does a joiner of a segment that live processes
 *   of another libgradsync build hold (never rebuilt under them); a rank that is already in the
 *   group, alive, GRADSYNC_E_MISUSE (for a group still forming, see gradsync_comm_create). The last member to
 *   leave removes the segment. A forked child of a member is not a member: its copy of the
 *   communicator is refused, and freeing it there only unmaps the segment (fork(), above).
 * - Trust: the segment is created 0600 and used only if it belongs to the caller with no
 *   group/other access. Every buffer address a member publishes is bounds-checked against the
 *   group's heaps before a peer touches it: a member gone bad stops the group, and every rank's
 *   call fails with GRADSYNC_E_CORRUPT (reset or free it), rather than a fault.
 * - Space: the segment's control area is reserved with posix_fallocate after checking what
 *   /dev/shm has (statvfs), and so is every gradsync_comm_alloc buffer: a full /dev/shm gives
 *   GRADSYNC_E_NO_SPACE, never SIGBUS. A segment truncated by any process (a member included) makes
 *   every member's current or next call fail with GRADSYNC_E_IO within a few milliseconds, not SIGBUS.
 * - Data paths: buffers from gradsync_comm_alloc (on every rank) are reduced zero copy, each rank
 *   its slice straight from the peers' buffers. An allreduce of ordinary buffers past 16 KiB does
 *   the same through the kernel (process_vm_readv/writev) when every rank may copy to and from its
 *   peers' processes (same user, same PID namespace, not refused by a security policy; checked as
 *   the group forms; GRADSYNC_SHM_CROSS_PROCESS=0 in a rank's environment declines), ranks do
 *   not outnumber their CPUs and check_mismatch is 1 (a peer's buffer lengths are taken from this
 *   rank's call, so the calls must have been compared). Such a call's last wait, while peers may
 *   still read or write this rank's buffers, ends only when they are done or dead, whatever the
 *   deadline or an abort (returning would let a late copy land in freed memory); a warning names
 *   the wait every timeout_ms. Otherwise, and
 *   for the other collectives, ordinary buffers are staged through the segment in pipelined
 *   chunks. A buffer a peer cannot reach there (pages the caller unmapped or protected) stops the
 *   group with GRADSYNC_E_CORRUPT on every rank. Small payloads travel inline (one barrier per
 *   call; two for an allreduce whose ranks mix both kinds of buffers).
 * - A peer process that dies is detected while waiting (by a lock the kernel drops with the
 *   process, and by PID): every rank gets GRADSYNC_E_REMOTE naming its rank and pid, then
 *   later calls fail fast; free the group and form a new one (same name allowed). A member that
 *   frees its communicator makes the others' calls fail with GRADSYNC_E_ABORTED, and so does one
 *   whose call fails on its own in the middle of a collective (out of memory): its peers' calls
 *   fail at once naming it, and the group needs a reset.
 *
 * MPI transport (GRADSYNC_TRANSPORT_MPI; gradsync_has_feature(GRADSYNC_FEATURE_MPI_TRANSPORT)):
 * - A plugin: libgradsync does not link MPI. The first MPI communicator (or
 *   gradsync_has_feature(GRADSYNC_FEATURE_MPI_TRANSPORT)) loads libgradsync-mpi.so.0, which links
 *   Open MPI, once per process: from $GRADSYNC_MPI_PLUGIN when that is set, else from the directory
 *   of libgradsync, else by its soname through the dynamic loader. Without it (or without Open MPI's
 *   runtime) create gives GRADSYNC_E_UNSUPPORTED with a message saying what to install.
 * - Group: MPI_COMM_WORLD, or the host's communicator passed as its Fortran handle in mpi_fcomm
 *   (C: MPI_Comm_c2f(comm); mpi4py: comm.py2f()). Rank and size come from MPI (the options' rank,
 *   size and name are ignored). The communicator is duplicated, so our traffic never matches the
 *   host's. Every rank must create it with the same options.
 * - MPI initialisation: if the host has not initialised MPI, the first create calls
 *   MPI_Init_thread (asking for MPI_THREAD_MULTIPLE) and MPI_Finalize runs at process exit, never
 *   at gradsync_comm_free (MPI cannot be initialised twice, and a later create must still work).
 *   MPI that the host initialised is never finalised by us. A host with less than
 *   MPI_THREAD_MULTIPLE must call each communicator from the thread allowed to call MPI.
 * - Collectives map onto MPI's own (MPI_Allreduce with MPI_IN_PLACE, MPI_Bcast, MPI_Allgatherv,
 *   MPI_Reduce_scatter, MPI_Alltoallv). allreduce_many packs small buffers into one MPI call per
 *   fill of a staging buffer (larger buffers go to MPI directly). An allreduce of at most 16 KiB
 *   per rank (64 KiB over the group), and a barrier, take one exchange between the ranks: the data
 *   travels with the call's check and every rank reduces it in rank order (the same bits on every
 *   rank, deterministic or not). docs/mpi.md describes the mechanism and its cost.
 * - deterministic (default 0 on MPI): 1 reduces in rank order on every rank with the library's
 *   kernels (docs/mpi.md says how, and what it costs); 0 leaves the order to MPI (all ranks still
 *   get MPI's one result). weighted_mean and i32 mean are always in rank order.
 * - check_mismatch (default 1): the ranks compare their calls (collective, count, dtype, op, root,
 *   call number) before any data moves into a caller's buffer; on a difference every rank returns
 *   GRADSYNC_E_MISMATCH naming the ranks. 0 judges only this rank's own arguments (except an
 *   allreduce small enough to travel with the check, whose calls are always compared).
 * - One outcome per call for aborts: a rank that has started a call is committed to it. An abort
 *   on a rank whose call has started takes effect at its next call; every rank then fails the same
 *   call: that one if some rank had not started it yet, else the next. A timeout or a death is the
 *   exception: one that strikes a rank just as the call completes elsewhere ends that call
 *   differently on it; every rank then fails its next call until the reset.
 * - Deadlines and what happens after a timeout: every wait for the peers is polled against
 *   timeout_ms, so a rank that never arrives gives GRADSYNC_E_TIMEOUT; the timed-out rank tells the
 *   others (they get GRADSYNC_E_TIMEOUT too if waiting, GRADSYNC_E_ABORTED on their next call).
 *   A peer process that dies while others wait gives GRADSYNC_E_REMOTE within about 100 ms: seen
 *   by PID on its host, and from other hosts (or PID namespaces) through a TCP connection between
 *   the two processes that carries nothing and ends with either (the kernel closes it however
 *   the process ends). Each rank holds about one such connection per other host, made as the
 *   group forms; where none can be made (no IPv4 route between the hosts), a warning names the
 *   peers, whose death then shows at the deadline. A host that loses power or its network (no
 *   connection end is sent) shows at the deadline too. MPI cannot
 *   cancel a collective: the abandoned exchange stays posted (on library-owned memory that is kept
 *   until exit, never on caller buffers) and that MPI communicator is never used again. Every call
 *   then fails with GRADSYNC_E_ABORTED until every rank calls gradsync_comm_reset, which
 *   duplicates fresh MPI communicators (collective, bounded by the timeout). If the process exits
 *   without such a reset and the library initialised MPI, the exit handler calls
 *   MPI_Abort(MPI_COMM_WORLD, 1) instead of MPI_Finalize (which could wait forever for the
 *   missing rank), ending the job; if the host initialised MPI, the host should call MPI_Abort.
 *   gradsync_comm_abort sets a flag the polling loop sees and notifies the peers.
 * - Limits: once every rank has arrived the data moves through MPI's blocking collectives, which
 *   MPI cannot interrupt: a rank that dies inside one is handled by mpirun (it ends the job), and
 *   under --enable-recovery by the library (see gradsync_comm_shrink: MPI_Abort). A
 *   rank arriving at the very instant the others time out can enter that transfer alone; it is
 *   released when the timed-out ranks' exit handler calls MPI_Abort. Counts have no limit below
 *   SIZE_MAX: transfers that MPI's int counts cannot describe go in pieces (allgather, alltoall
 *   and reduce_scatter pairwise between ranks; reduce_scatter then folds in rank order, as its
 *   deterministic mode does).
 *
 * Hierarchical transport (GRADSYNC_TRANSPORT_HIER; needs the MPI transport):
 * - Group: as the MPI transport's (MPI_COMM_WORLD or mpi_fcomm; rank and size from MPI), over any
 *   number of hosts. The hosts are the group's topology (gradsync_comm_topology): ranks of one host
 *   form a shared-memory group among themselves, and an allreduce in levels (below) sends only
 *   the traffic between hosts through MPI; with one rank per host it moves everything through
 *   MPI. On one host every call runs on the shared-memory group, which is then the whole group
 *   in the same rank order: no data moves through MPI, and results are the shared-memory
 *   transport's, bit for bit (so the transport suits a job that may or may not span hosts).
 * - allreduce and allreduce_many (f32, f64; i32 and i64 except mean) whose payload (all buffers
 *   of the call together) exceeds 16 KiB run in levels, and so does each dtype's part of
 *   allreduce_mixed: with the same number of ranks on every host there is no leader (each host
 *   reduce-scatters through shared memory, each local rank all-reduces its own slice across hosts
 *   over MPI, each host all-gathers); with hosts of different sizes, local rank 0 of each host
 *   carries the host's sum. The reduction order is fixed by the topology (within a host in local
 *   rank order, then across hosts in host order, with two hosts or under deterministic 1, see
 *   below): every rank gets the same bits on every run of
 *   the same layout, but not the flat rank-order bits, unless topology_independent is 1, which
 *   reduces flat over MPI in rank order instead (flat MPI's speed). With three or more hosts the
 *   hosts' sums combine through the MPI transport's allreduce: in host order with deterministic
 *   1, in MPI's order with 0 (every rank still gets MPI's one result). A broadcast above 16 KiB
 *   runs in levels too (the root's host spreads it over shared memory, then each local rank
 *   carries its slice across hosts and each host all-gathers; with hosts of different sizes,
 *   local rank 0 carries it all), with the flat broadcast's bits on any layout.
 * - reduce_scatter and reduce_scatterv (and their non-blocking forms) run in levels under the
 *   allreduce's conditions (dtype, op, more than 16 KiB in all, topology_independent 0): each host
 *   reduces every rank's part over its ranks into that rank's local rank (or, with hosts of
 *   different sizes, local rank 0) through shared memory, those ranks reduce the parts across
 *   hosts over MPI, each part crossing each pair of hosts once (local rank 0 then hands its
 *   host's ranks their parts). Same order as the allreduce in levels, so each rank's part equals
 *   its slice of that allreduce of the same buffers, bit for bit, on every layout (with three or
 *   more hosts, under deterministic 1); with
 *   topology_independent 1 they run flat, with the flat rank-order bits. allgather and
 *   allgatherv above 16 KiB, any dtype, run in levels on every layout: with the same number of
 *   ranks on every host each rank sends its own part to the ranks of its local rank on the other
 *   hosts (each part crosses to each other host once, no leader), then each host's ranks share
 *   what they hold through shared memory; otherwise local rank 0 gathers its host's parts, all-
 *   gathers them with the other hosts' local ranks 0 and broadcasts the whole through shared
 *   memory. They move bits unchanged: the flat result on any layout. Across hosts, smaller
 *   payloads, bf16, f16, the integer mean, the rooted reduce (gradsync_comm_reduce), and every
 *   other collective run flat over MPI in rank order, with the MPI transport's semantics.
 * - Errors: as for MPI and shm, per level; a level that fails makes every rank's call fail, a
 *   timeout or abort needs gradsync_comm_reset on every rank, and gradsync_comm_abort aborts
 *   every level. The one-outcome-per-call guarantee holds per level: a rank whose last level
 *   (the host's all-gather) fails alone after its host's peers completed returns an error while
 *   they return GRADSYNC_OK; the next call then fails on every rank until the reset. Every call in
 *   levels first compares every rank's call across the whole group (one small MPI allreduce),
 *   so ranks that disagree all get GRADSYNC_E_MISMATCH naming both sides before any level runs.
 *
 * Threads as ranks (GRADSYNC_TRANSPORT_MPI and GRADSYNC_TRANSPORT_HIER, options.threads):
 * - Group: each process of the MPI group holds options.threads ranks (1 to 256; it may differ
 *   from process to process), one per thread, which all call gradsync_comm_create at once, each
 *   with its index in options.thread. Process p's ranks follow those of processes 0 .. p-1 (in
 *   MPI rank order), in thread order. Every process passes threads, or none does. The threads of
 *   a process meet by options.name (and mpi_fcomm): a group created beside another one of the
 *   same name in one process fails with GRADSYNC_E_MISUSE; give each its own name. MPI must give
 *   MPI_THREAD_MULTIPLE (the library asks for it when it initialises MPI), else create fails
 *   with GRADSYNC_E_UNSUPPORTED saying so. Each handle is its thread's, under the one-thread-per-
 *   handle rule; the topology counts every rank on its process's host.
 * - Levels: the threads of a process form a thread-transport group; the processes meet in groups
 *   of the requested transport. Every call moves through each process's thread 0: its threads'
 *   parts meet there, thread 0 carries them between the processes, the threads take the result.
 * - Order: a reduction of f32, f64, or i32 and i64 other than mean folds each process's ranks in
 *   thread order, then the processes as a group of that transport with one rank per process
 *   folds them: in MPI rank order (MPI with deterministic 1; HIER up to 16 KiB per rank, or on
 *   one host), or host by host as the hierarchical transport's levels do (within a host in
 *   process order, then the hosts in host order). The same bits on every rank and every run of
 *   one layout. bf16, f16, the integer mean, the rooted reduce, the weighted mean and
 *   topology_independent 1 give the flat rank-order fold's bits (every rank's contribution is
 *   gathered and folded by each rank, at that cost). Every call compares every rank's call
 *   before any buffer is written, so ranks that disagree all get GRADSYNC_E_MISMATCH, and a root
 *   or weight that the group judges fails every rank alike.
 * - Errors: as for the hierarchical transport, per level. A rank that does not arrive gives every
 *   waiting rank GRADSYNC_E_TIMEOUT (each level waits at most timeout_ms, so a call may wait a
 *   few times that; on GRADSYNC_TRANSPORT_HIER a deadline met inside a host's shared-memory
 *   level reaches the other hosts as GRADSYNC_E_ABORTED, as in a group of that transport); an
 *   abort stops every level of the process; the group needs gradsync_comm_reset on every rank
 *   after either.
 * - Subgroups (gradsync_comm_split): any colors and keys, as on every transport; each process's
 *   thread 0 forms the process-level groups of the subgroups with ranks on its process.
 * - Shrink (gradsync_comm_shrink, under mpirun --enable-recovery as for MPI): every thread of every
 *   surviving process calls it. A lost process takes all of its threads' ranks out; the others
 *   keep their order, member ids and threads. A whole host lost is as for the transport: with
 *   every survivor on one host, the processes go on meeting over shared memory (the transport
 *   still reads as comm's).
 * - Grow (gradsync_comm_grow, as for MPI): every thread of every member process calls it; joiners
 *   counts processes (MPI starts processes), and every thread of each started process calls
 *   gradsync_comm_join with threads and thread set, as at creation (any thread count per
 *   process). The members keep their ranks and ids; the joining processes' threads follow, process
 *   by process, in thread order, with new ids; result->new_size counts ranks.
 */
#ifndef GRADSYNC_COMM_H
#define GRADSYNC_COMM_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/common.h"
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

typedef struct gradsync_comm gradsync_comm;
/** A non-blocking call in flight (gradsync_comm_iallreduce and the others); see gradsync_request_wait. */
typedef struct gradsync_request gradsync_request;

/** Transports. */
typedef enum gradsync_transport {
  GRADSYNC_TRANSPORT_THREAD = 0, /**< threads of one process, grouped by name (no set-up) */
  GRADSYNC_TRANSPORT_SHM = 1,    /**< processes of one host, grouped by name through /dev/shm/gradsync.\<name\> */
  GRADSYNC_TRANSPORT_MPI = 2,    /**< processes over MPI (see "MPI transport" above); when built with it */
  GRADSYNC_TRANSPORT_HIER = 3    /**< processes over MPI on any number of hosts: shared memory within a host,
                                      MPI between hosts (see "Hierarchical transport" above) */
} gradsync_transport;

#define GRADSYNC_COMM_OPTIONS_VERSION 3
#define GRADSYNC_COMM_NAME_MAX 64
/**
 * timeout_ms for "wait as long as it takes": a deadline that never passes. A rank that never
 * arrives then blocks the others until gradsync_comm_abort, or until it dies or frees its
 * communicator (which its peers see); prefer a finite timeout where a peer may hang.
 */
#define GRADSYNC_NO_TIMEOUT INT64_MAX

/**
 * Options of gradsync_comm_create. Fill with gradsync_comm_options_init or GRADSYNC_COMM_OPTIONS_INIT.
 *
 * struct_size and version are checked: version 1 up to the library's version with a struct_size
 * between version 1's and the library's sizeof (an older header: later fields keep their
 * defaults), or a newer version with a larger struct_size (at most 4096) whose bytes past the
 * library's sizeof are all 0 (a newer header whose new fields are left at 0). Anything else
 * (0, garbage, a newer field set that this library cannot honour) is GRADSYNC_E_INVALID_ARG
 * naming the field and the accepted values.
 */
typedef struct gradsync_comm_options {
  uint32_t struct_size;   /**< sizeof(gradsync_comm_options) as the caller compiled it */
  uint32_t version;       /**< GRADSYNC_COMM_OPTIONS_VERSION */
  int32_t transport;      /**< a gradsync_transport value; default THREAD */
  int32_t rank;           /**< this member's rank in [0, size) (THREAD, SHM; MPI takes it from MPI) */
  int32_t size;           /**< number of ranks, 1 to 1024 (THREAD, SHM; MPI takes it from MPI) */
  int32_t deterministic;  /**< 1: rank-order reduction. THREAD and SHM always are; MPI default 0 (see above) */
  int32_t check_mismatch; /**< 1 (default): detect ranks that disagree in a round; 0: trust callers */
  int32_t reserved0;      /**< must be 0 */
  int64_t timeout_ms;     /**< deadline of joining and of each collective, > 0; default 300000; GRADSYNC_NO_TIMEOUT */
  int64_t mpi_fcomm;      /**< MPI: communicator as its Fortran handle (MPI_Comm_c2f); UNSET = MPI_COMM_WORLD */
  char name[GRADSYNC_COMM_NAME_MAX]; /**< group name, NUL-terminated: members with the same name form one group */
  /* version 2 */
  char host[GRADSYNC_COMM_NAME_MAX]; /**< host label, NUL-terminated; empty (default): detected (see
                                        gradsync_comm_topology) */
  int32_t topology_independent; /**< HIER: 1 gives the flat rank-order reduction's bits on any layout (at flat MPI's
                                   speed); default 0 */
  int32_t reserved1;            /**< must be 0 */
  /* version 3 */
  int32_t threads; /**< MPI, HIER: the group's ranks this process holds, 1 to 256, one per thread that creates the
                      communicator (see "Threads as ranks" above); UNSET (default): one per process */
  int32_t thread;  /**< MPI, HIER with threads set: this thread's index among them, in [0, threads) */
  /* append only */
} gradsync_comm_options;

#define GRADSYNC_COMM_OPTIONS_INIT                                                                                  \
  {                                                                                                                 \
    sizeof(gradsync_comm_options), GRADSYNC_COMM_OPTIONS_VERSION, GRADSYNC_TRANSPORT_THREAD, GRADSYNC_UNSET_I32,    \
        GRADSYNC_UNSET_I32, GRADSYNC_UNSET_I32, GRADSYNC_UNSET_I32, 0, GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, {0}, \
        {0}, 0, 0, GRADSYNC_UNSET_I32, GRADSYNC_UNSET_I32                                                           \
  }

/**
 * @brief Fill opts with defaults (for FFIs that cannot expand GRADSYNC_COMM_OPTIONS_INIT).
 * @param[out] opts the options to fill
 * @param[in] struct_size sizeof(gradsync_comm_options) as the caller knows it
 * @retval GRADSYNC_E_INVALID_ARG opts is NULL or struct_size is smaller than the first version's
 * @threadsafety any
 */
GRADSYNC_API int gradsync_comm_options_init(gradsync_comm_options* opts, size_t struct_size);

/* ---------------------------------------------------------------- lifecycle */

/**
 * @brief Join a group as one rank. Collective: returns once every rank of the group has joined,
 *        or fails with GRADSYNC_E_TIMEOUT when one has not within the timeout. After a timeout,
 *        calling it again on every rank forms the group (on MPI too, whose group's first step,
 *        left posted on the ranks that gave up, the next create on that MPI communicator resumes).
 * @param[out] out the new communicator; NULL on failure
 * @param opts options from gradsync_comm_options_init, or NULL for the defaults
 * @retval GRADSYNC_E_INVALID_ARG bad options (size < 1, empty name, timeout <= 0, unknown transport,
 *         struct_size or version that fit no version of the struct)
 * @retval GRADSYNC_E_OUT_OF_RANGE rank outside [0, size)
 * @retval GRADSYNC_E_MISMATCH members of one name disagree on size, or (shm) the name's segment is
 *         held by live processes of another libgradsync build
 * @retval GRADSYNC_E_MISUSE the rank has already joined this group
 *         (While a group forms, either of these breaks it: every member waiting for it fails at
 *         once with the same status, naming the cause, and so does every later joiner until the
 *         waiting members have given up. A formed group only refuses the joiner.)
 * @retval GRADSYNC_E_UNSUPPORTED the transport is not in this build
 * @retval GRADSYNC_E_NO_SPACE (SHM) /dev/shm has not the space for the group's segment
 * @retval GRADSYNC_E_REMOTE (SHM) a member died while the group was forming
 * @retval GRADSYNC_E_PERMISSION (SHM) the group's segment belongs to another user, or others may
 *         open it (it is created 0600; pick another name, or remove it)
 * @retval GRADSYNC_E_NOMEM (SHM) the segment cannot be mapped (under an address-space limit the
 *         heaps take at most a quarter of it); nothing is left behind
 * @threadsafety any
 */
GRADSYNC_API int gradsync_comm_create(gradsync_comm** out, const gradsync_comm_options* opts);

/**
 * @brief Leave the group and release local resources; NULL is a no-op.
 *
 * If another thread is inside a call on this communicator, free aborts the group (as
 * gradsync_comm_abort does: that call returns GRADSYNC_E_ABORTED, and so do the peers' calls) and
 * waits for that call to return before releasing anything, so it never destroys the communicator
 * under a running call. After an abort every wait ends, so this wait is short. (A free from inside
 * a call on the same thread, i.e. from a log callback, which must not call back, cannot wait: it
 * aborts that call, logs an error and leaves the communicator allocated.) A call that starts once
 * free has begun uses a freed handle. (SHM) The last live member to leave removes the group's
 * segment, also when members were killed; a member killed after every other member has left
 * leaves it to the next group of the same name, which reclaims it. Shards made on the
 * communicator stay valid handles, to be freed as usual; their collective stages fail with
 * GRADSYNC_E_MISUSE. In a process forked from
 * the one that created the communicator, free releases only that process's own resources and
 * leaves the group alone (see fork() above).
 * @threadsafety handle (a call running on another thread is aborted and waited for, see above)
 */
GRADSYNC_API void gradsync_comm_free(gradsync_comm* comm);

/**
 * @brief Abort the group: every rank blocked in (or later entering) a collective gets
 *        GRADSYNC_E_ABORTED until the group is reset or freed.
 * @threadsafety any-abort (from any thread, also while another thread is inside a collective)
 */
GRADSYNC_API int gradsync_comm_abort(gradsync_comm* comm);

/** Asked by a waiting call whether its caller wants out; non-zero means yes. */
typedef int (*gradsync_interrupt_fn)(void* user_data);

/**
 * @brief Let the host interrupt this rank's waits (Ctrl-C in Python): while a collective of this
 *        communicator waits for its peers, fn(user_data) is called now and then (every 10 to
 *        100 ms) on the waiting thread; a non-zero return aborts the group as gradsync_comm_abort
 *        does, and the call returns GRADSYNC_E_ABORTED (so do its peers', except on MPI, where
 *        an abort is local: see above).
 * @param comm the communicator
 * @param fn the check, or NULL to remove it
 * @param user_data passed to fn
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_set_interrupt(gradsync_comm* comm, gradsync_interrupt_fn fn, void* user_data);

/**
 * @brief Clear an abort or timeout so the group can be used again. Collective: every rank calls it.
 * @retval GRADSYNC_E_MISUSE another thread is inside a call on this handle
 * @retval GRADSYNC_E_REMOTE a rank of the group died: shrink the group (gradsync_comm_shrink) or free it
 * @retval GRADSYNC_E_TIMEOUT a rank did not call reset within the timeout: call it again on every rank
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_reset(gradsync_comm* comm);

/** @brief This member's rank. @threadsafety any */
GRADSYNC_API int gradsync_comm_rank(const gradsync_comm* comm, int32_t* rank);
/** @brief Number of ranks in the group. @threadsafety any */
GRADSYNC_API int gradsync_comm_size(const gradsync_comm* comm, int32_t* size);
/** @brief The transport (gradsync_transport) of this communicator. @threadsafety any */
GRADSYNC_API int gradsync_comm_transport(const gradsync_comm* comm, int32_t* transport);

/** gradsync_comm_split's color for a rank that joins no subgroup (MPI_UNDEFINED). */
#define GRADSYNC_SPLIT_NONE (-1)

/**
 * @brief Split the group into subgroups, as MPI_Comm_split does. Collective: every rank calls it.
 *
 * Ranks that pass the same color (>= 0) form one new communicator, their ranks ordered by key and
 * then by their rank in comm. The new communicator has comm's transport and options (timeout,
 * check_mismatch, deterministic) and is independent of comm: either may be freed first, and
 * subgroups of subgroups work alike. Its topology is comm's, restricted to its members.
 * Every collective, the non-blocking calls, abort, timeout and reset work on it as on comm; an
 * abort of comm does not abort its subgroups (abort each, or free them).
 * @param comm the group to split
 * @param color the subgroup to join, >= 0; or GRADSYNC_SPLIT_NONE to join none (*out is NULL)
 * @param key orders the subgroup's ranks (ties: by rank in comm)
 * @param[out] out the new communicator, or NULL (GRADSYNC_SPLIT_NONE, or on failure)
 * @retval GRADSYNC_E_INVALID_ARG some rank passed a color below GRADSYNC_SPLIT_NONE (every rank
 *         gets it, naming that rank), or out is NULL
 * @retval GRADSYNC_E_TIMEOUT, GRADSYNC_E_ABORTED, GRADSYNC_E_REMOTE as for a collective on comm,
 *         or from forming a subgroup (as gradsync_comm_create)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_split(gradsync_comm* comm, int32_t color, int32_t key, gradsync_comm** out);

/* ---------------------------------------------------------------- elastic membership */

#define GRADSYNC_SHRINK_RESULT_VERSION 1

/** What gradsync_comm_shrink reports besides the new group. */
typedef struct gradsync_shrink_result {
  uint32_t struct_size; /**< sizeof(gradsync_shrink_result) as the caller compiled it */
  uint32_t version;     /**< GRADSYNC_SHRINK_RESULT_VERSION */
  int32_t failed_count; /**< ranks of comm that are out of the new group */
  int32_t attempts;     /**< agreements made: 1, or more when a member was lost during the shrink */
  int64_t agree_ns;     /**< time spent agreeing on the failed set, every attempt */
  int64_t form_ns;      /**< time spent forming (and committing) the new group, every attempt */
  /* append only */
} gradsync_shrink_result;

/**
 * @brief After comm lost a member, form the group of the survivors, in place. Collective over the
 *        survivors: each calls it once the loss showed (a collective returned GRADSYNC_E_REMOTE,
 *        GRADSYNC_E_TIMEOUT or GRADSYNC_E_ABORTED), or at any time to leave out the members that
 *        do not answer.
 *
 * The survivors agree on ONE failed set: every rank that is gone (its process died, or, on the
 * thread transport, its communicator was freed) or that did not call gradsync_comm_shrink within
 * comm's timeout. Every survivor gets the same set and the same new group, whose ranks are dense
 * and keep the survivors' order in comm. A member lost while the shrink runs is left out by
 * another round of agreement (result->attempts > 1). Each step (agreeing, forming the new group)
 * is bounded by comm's timeout, and the attempts by comm's size.
 * Calls still waiting on comm in other threads return (GRADSYNC_E_ABORTED); comm is stopped for
 * good: free it. Each member keeps its member id (gradsync_comm_member_id) in the new group.
 *
 * Transports: THREAD, SHM, MPI and HIER, with threads as ranks too (see there).
 * MPI and HIER: only under mpirun --enable-recovery (otherwise Open MPI ends the whole job when a
 * process dies). A member is lost when its process is seen gone or it does not answer within comm's
 * timeout. A member lost while the survivors' group is being formed ends the job with
 * MPI_Abort(MPI_COMM_WORLD, 1) after half of comm's timeout, never a hang. A whole host lost (its
 * Open MPI daemon too) is one more failed set: when every survivor is on one host, the new group is
 * a shared-memory one (gradsync_comm_transport gives SHM, as auto gives ranks of one host), formed
 * without MPI; survivors on several hosts get a group of comm's transport. A rank lost inside MPI's
 * blocking data transfer of a collective (whose data did not travel with the call's exchange:
 * above 16 KiB per rank for an allreduce) leaves the others in a call that MPI cannot interrupt:
 * once a rank has been in that transfer for 1 s after a peer of it was seen dead, it ends the
 * job with MPI_Abort(MPI_COMM_WORLD, 1), logging why, rather than hang (no shrink is possible
 * then; a job restarted from its checkpoint goes on). HIER
 * shrinks its MPI group the same way, then builds its shared-memory and cross-host levels over the
 * survivors.
 * @param comm the group that lost a member
 * @param[out] out the survivors' communicator; NULL on failure
 * @param[out] failed receives the failed ranks of comm, ascending (may be NULL)
 * @param failed_capacity entries failed can hold: at least comm's size when failed is not NULL
 * @param[out] result counts and phase times (may be NULL); struct_size and version set by the
 *        caller (a struct_size from a newer header is taken; the fields this library does not
 *        know are zeroed, and version is set to the one it wrote)
 * @retval GRADSYNC_E_INVALID_ARG out is NULL, failed_capacity is too small, or result's header is wrong
 * @retval GRADSYNC_E_REMOTE this rank came after the others had decided without it: it is out
 * @retval GRADSYNC_E_TIMEOUT a step of the shrink did not finish within comm's timeout
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_shrink(gradsync_comm* comm, gradsync_comm** out, int32_t* failed, size_t failed_capacity,
                                      gradsync_shrink_result* result);

/**
 * @brief This member's stable id: its rank in the group it was created in, kept by every group
 *        shrunk (gradsync_comm_shrink), grown (gradsync_comm_grow) or split from it, so that a
 *        caller can map old ranks to new. A joiner's id is new (see gradsync_comm_grow).
 * @threadsafety any
 */
GRADSYNC_API int gradsync_comm_member_id(const gradsync_comm* comm, int64_t* id);

#define GRADSYNC_GROW_RESULT_VERSION 1

/** What gradsync_comm_grow and gradsync_comm_join report besides the new group. */
typedef struct gradsync_grow_result {
  uint32_t struct_size;    /**< sizeof(gradsync_grow_result) as the caller compiled it */
  uint32_t version;        /**< GRADSYNC_GROW_RESULT_VERSION */
  int32_t old_size;        /**< the members before the grow: the joiners' ranks start here */
  int32_t new_size;        /**< old_size + the joiners */
  int64_t first_member_id; /**< joiner j's member id is first_member_id + j */
  int64_t agree_ns;        /**< members: agreeing on the grow and admitting the joiners; a joiner: waiting
                                for the members to admit it */
  int64_t form_ns;         /**< forming (and committing) the new group */
  /* append only */
} gradsync_grow_result;

/**
 * @brief Grow the group by `joiners` new ranks, at a round boundary. Collective over comm: every
 *        member calls it, with the same join_name and joiners, while the joiners call
 *        gradsync_comm_join with that name (in any order, within the timeouts).
 *
 * The new group has comm's members first, in their order in comm (ranks 0 .. size-1, each keeping
 * its member id), then the joiners in the order of their index (gradsync_comm_join's rank): joiner
 * j is rank size + j. Joiners get member ids never used in the group's history (its creation,
 * shrinks and grows): joiner j's is result->first_member_id + j, above every id the group has
 * held, so a member lost and replaced is never confused with its replacement. (Subgroups split
 * from one group draw ids apart from each other only if they do not both grow.) The new group has
 * comm's options (timeout, check_mismatch, deterministic), on the joiners too, and its topology is
 * detected as at creation.
 *
 * One outcome: either every member and every joiner returns GRADSYNC_OK with the same new group,
 * or each of them returns an error (a joiner that dies returns nothing). The commit is one barrier
 * of the new group, decided once for all its members (as a shrink's). A member that meets the
 * failure returns its status (below); the members that learn of it from that member return
 * GRADSYNC_E_ABORTED naming it, as a collective's peers do. comm is not changed by a
 * grow that succeeds: the members move their state onto the new group (the parameters by
 * gradsync_comm_broadcast from a member to the joiners, a sharded parameter by
 * gradsync_shard_reshard, see shard.h) and then free comm. After a failure, comm is stopped as
 * after a failed collective: call gradsync_comm_reset on every member (or gradsync_comm_shrink when
 * a member of comm is lost) and grow again. Agreeing is bounded by comm's timeout, as a
 * collective; admitting the joiners and forming the new group share one more: every member gives
 * up on them comm's timeout after agreeing (rank 0 admits while the others already wait to form),
 * and committing is a collective of the new group. A joiner that does not come, or dies on the
 * way, costs the members at most that.
 *
 * Transports: THREAD and SHM as above. MPI and HIER: the members start the joiners themselves
 * (MPI_Comm_spawn, under mpirun): `joiners` processes of rank 0's program, with its arguments and
 * working directory, and GRADSYNC_JOIN set to join_name in their environment, where the MPI runtime
 * places them. Such a process calls gradsync_comm_join (below) instead of gradsync_comm_create.
 * The members spawn, merge and offer through MPI's blocking calls, which nothing can interrupt: a
 * joiner that does not reach gradsync_comm_join within comm's timeout (it died, never calls it, or
 * starts slower than that), or a member or joiner lost inside them, ends the job (MPI_Abort) rather
 * than hang it; a failure after them is returned as below. After a shrink that lost every rank of
 * a host (seen by any member's process), the grow is refused on every member
 * (GRADSYNC_E_UNSUPPORTED): Open MPI 4.1's spawn would then end the whole job. A HIER group
 * builds its levels over the grown MPI group, as at creation. (A shrink whose survivors are all on
 * one host gives an SHM group: it grows as SHM, its joiners started by the caller.)
 * @param comm the running group
 * @param join_name the name the joiners pass to gradsync_comm_join (NUL-terminated, 1 to
 *        GRADSYNC_COMM_NAME_MAX-1 bytes, as a group name, and not comm's own name; over MPI no
 *        newline, as the joiners' environment carries it). Rank 0 and
 *        the joiners meet in a group of that name (a lobby, kept until the grown group commits),
 *        so it serves one grow at a time. A joiner that comes while the lobby forms with an index
 *        already claimed, or with another count of joiners, fails the whole grow (rank 0:
 *        GRADSYNC_E_MISUSE or GRADSYNC_E_MISMATCH; the other members: GRADSYNC_E_ABORTED). One
 *        that comes after the lobby formed waits for it to be freed, and times out if it is not
 *        within its own timeout. Name each grow apart (a generation number) when joiners may
 *        come early.
 * @param joiners how many ranks join, >= 1 (threads as ranks: how many processes, each bringing its
 *        threads); comm's size + joiners is at most 1024
 * @param[out] out the new group's communicator; NULL on failure
 * @param[out] result sizes, the joiners' first member id, phase times (may be NULL); struct_size
 *        and version set by the caller, as gradsync_comm_shrink's result
 * @retval GRADSYNC_E_INVALID_ARG out is NULL, join_name empty, too long or comm's own name,
 *         joiners < 1 or too many, or result's header is wrong (this member only: nothing was
 *         started)
 * @retval GRADSYNC_E_MISMATCH members passed different join names or joiner counts (every member,
 *         naming them), or (rank 0) the joiners' count (gradsync_comm_join's size) differs from the members',
 *         or (MPI, HIER: every rank alike) a joiner passed another join name or transport
 * @retval GRADSYNC_E_MISUSE (rank 0) two joiners claimed one index
 * @retval GRADSYNC_E_TIMEOUT a member or a joiner did not come within comm's timeout
 * @retval GRADSYNC_E_REMOTE a member or a joiner died during the grow
 * @retval GRADSYNC_E_ABORTED comm was aborted (gradsync_comm_abort) before the new group formed (an
 *         abort after that is comm's alone: the grow completes), or another member failed the grow
 * @retval GRADSYNC_E_UNSUPPORTED (MPI, HIER) a member saw a whole host lost in a shrink of this
 *         job, as above
 * @retval GRADSYNC_E_NO_SPACE, GRADSYNC_E_PERMISSION, GRADSYNC_E_NOMEM forming the lobby (rank 0)
 *         or the new group fails as gradsync_comm_create's forming of a group does (SHM); comm then
 *         needs a reset as above
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_grow(gradsync_comm* comm, const char* join_name, int32_t joiners, gradsync_comm** out,
                                    gradsync_grow_result* result);

/**
 * @brief Join a running group as a new rank: the other side of gradsync_comm_grow. Returns once
 *        the group's members have grown it by this rank and the new group committed.
 *
 * opts says how to meet the members: transport (THREAD or SHM), name (the members' join_name),
 * rank (this joiner's index among the joiners, in [0, size)), size (how many join in this grow:
 * the members' `joiners`), timeout_ms (how long to wait for the members to grow: the joiner may
 * start long before the members call gradsync_comm_grow; forming and committing the new group
 * then take the group's timeout) and host (the topology's label, as at creation). The other fields are the group's: the
 * new communicator takes the members' timeout, check_mismatch and deterministic. Its rank is the members' count +
 * index, its member id result->first_member_id + index.
 *
 * MPI and HIER: only in a process that the members' grow started (GRADSYNC_JOIN is then set to
 * the join name, which goes in name), with the members' transport; rank and size are ignored
 * (MPI gives the index and the count); host labels this rank, as at creation. timeout_ms bounds
 * MPI's initialisation, which completes the members' spawn (past it, with the members gone, this
 * process ends: _Exit(1)), and merging into the members' group (past it the job ends, as for the
 * members); the new group takes the members' options, topology_independent too. With threads and
 * thread set, every thread of the process calls it (threads as ranks, above).
 * @param[out] out the new group's communicator; NULL on failure
 * @param opts as above (gradsync_comm_options_init, then the fields above)
 * @param[out] result as gradsync_comm_grow's (may be NULL)
 * @retval GRADSYNC_E_INVALID_ARG out or opts is NULL, or bad options (as gradsync_comm_create), or
 *         (MPI, HIER) no grow started this process
 * @retval GRADSYNC_E_OUT_OF_RANGE rank outside [0, size)
 * @retval GRADSYNC_E_MISMATCH the members grow by another count than size, or (MPI, HIER) name or
 *         transport differ from the members' (on every rank of the grown group alike)
 * @retval GRADSYNC_E_MISUSE another joiner claimed this index
 * @retval GRADSYNC_E_TIMEOUT the members did not grow the group within the timeout, or a member or
 *         joiner did not come to form the new group within the group's timeout (a joiner sees the
 *         members' failures only as that, or as GRADSYNC_E_REMOTE)
 * @retval GRADSYNC_E_REMOTE a member or another joiner died during the grow, or the members'
 *         grow failed once they had admitted this joiner (naming the failure)
 * @retval GRADSYNC_E_CORRUPT the offer read from the members' rank 0 is out of range (a group
 *         size, member ids or timeout no grow makes): the message says which
 * @retval GRADSYNC_E_UNSUPPORTED MPI or HIER in a build without MPI
 * @retval GRADSYNC_E_NO_SPACE, GRADSYNC_E_PERMISSION, GRADSYNC_E_NOMEM forming the lobby or the new
 *         group fails as gradsync_comm_create's forming of a group does (SHM)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_comm_join(gradsync_comm** out, const gradsync_comm_options* opts,
                                    gradsync_grow_result* result);

/**
 * @brief Which ranks share a host. The same on every rank.
 *
 * A host is a set of ranks that can map each other's shared memory. At creation the ranks
 * exchange a host identity (the hostname, the kernel's boot id and the identity of the /dev/shm
 * mount, which tells apart containers and namespaces with private /dev/shm under one hostname),
 * or the host label of their options where set. Ranks with one identity are one host when they
 * also share memory: threads of one process (THREAD) and the processes of one segment (SHM) do
 * by construction; on MPI every rank leaves a nonce in a file in /dev/shm and reads its
 * candidates' (a probe whose files are removed before create returns). Environment variables
 * (LOCAL_RANK, LOCAL_WORLD_SIZE) are never read. Hosts are numbered in the order of their lowest
 * rank, and local ranks in rank order.
 * @param comm the communicator
 * @param[out] host this rank's host, in [0, num_hosts) (NULL: not wanted; the same for each out)
 * @param[out] local_rank this rank's place among its host's ranks
 * @param[out] local_size the number of ranks on this rank's host
 * @param[out] num_hosts the number of hosts
 * @param[out] rank_hosts every rank's host, by rank: size entries, or NULL
 * @param rank_hosts_len the entries rank_hosts holds (at least the size), 0 when it is NULL
 * @retval GRADSYNC_E_INVALID_ARG rank_hosts is shorter than the group
 * @threadsafety any
 */
GRADSYNC_API int gradsync_comm_topology(const gradsync_comm* comm, int32_t* host, int32_t* local_rank,
                                        int32_t* local_size, int32_t* num_hosts, int32_t* rank_hosts,
                                        size_t rank_hosts_len);

/* ---------------------------------------------------------------- collectives */

/**
 * @brief recv[i] = op over ranks of send[i], reduced in rank order, identical on every rank.
 *
 * Every dtype: bf16 and f16 are accumulated in f32 (in rank order, on MPI too) and rounded once,
 * to nearest even.
 * @param comm the communicator
 * @param send count elements; may equal recv (in place)
 * @param recv count elements
 * @param count elements
 * @param dtype a gradsync_dtype
 * @param op a gradsync_op
 * @retval GRADSYNC_E_MISMATCH ranks disagree on count, dtype or op (every rank gets it)
 * @retval GRADSYNC_E_TIMEOUT a rank did not arrive in time; GRADSYNC_E_ABORTED the group is aborted
 * @retval GRADSYNC_E_REMOTE a peer process died (SHM, MPI, HIER)
 * @retval GRADSYNC_E_MISUSE another thread is inside a call on this handle (this call did nothing),
 *         or a NULL, freed or wrong kind of handle; the same for every collective below
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                         int32_t op);

/** The most buffers one gradsync_comm_allreduce_many call takes (a bound on the caller's arrays). */
#define GRADSYNC_MAX_FUSED_BUFFERS (1u << 20)

/**
 * @brief One allreduce over a list of buffers (a gradient bucket), same results as one call each.
 * @param comm the communicator
 * @param sends nbufs pointers, or NULL for all in place; an entry may equal its recv
 * @param recvs nbufs pointers
 * @param counts nbufs element counts
 * @param nbufs number of buffers, at most GRADSYNC_MAX_FUSED_BUFFERS
 * @param dtype a gradsync_dtype, of every buffer
 * @param op a gradsync_op
 * @retval GRADSYNC_E_INVALID_ARG more than GRADSYNC_MAX_FUSED_BUFFERS buffers
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_allreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                              const size_t* counts, size_t nbufs, int32_t dtype, int32_t op);

/**
 * @brief gradsync_comm_allreduce_many over buffers of different dtypes (a mixed-precision model's
 *        gradients in one call), the same bits as one gradsync_comm_allreduce per buffer.
 *
 * The buffers are reduced in one fused allreduce per dtype present (in the order of the
 * gradsync_dtype values), after one small round that compares every rank's list: ranks whose
 * counts, dtypes, order or op differ all get GRADSYNC_E_MISMATCH, and no buffer is changed. A
 * failure after that round (a timeout, an abort, a dead peer) may leave the buffers of the dtypes
 * already reduced reduced.
 * @param comm the communicator
 * @param sends nbufs pointers, or NULL for all in place; an entry may equal its recv
 * @param recvs nbufs pointers
 * @param counts nbufs element counts
 * @param dtypes nbufs gradsync_dtype values
 * @param nbufs number of buffers, at most GRADSYNC_MAX_FUSED_BUFFERS
 * @param op a gradsync_op, applied to every buffer
 * @return GRADSYNC_OK, or an error as gradsync_comm_allreduce_many gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_allreduce_mixed(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                               const size_t* counts, const int32_t* dtypes, size_t nbufs, int32_t op);

/**
 * @brief The data-parallel merge as a collective: recv = Σ wᵢ·sendᵢ / Σ wᵢ on every rank, with
 *        wᵢ this rank's sample count. F32 and F64 only; products are summed in double, in rank order.
 * @param comm the communicator
 * @param send count elements
 * @param recv count elements (may equal send)
 * @param count elements
 * @param dtype GRADSYNC_F32 or GRADSYNC_F64
 * @param weight this rank's sample count, at most 2^53
 * @param[out] total_weight Σ wᵢ (may be NULL)
 * @retval GRADSYNC_E_ZERO_WEIGHT Σ wᵢ = 0 (on every rank; recv untouched)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_weighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                             int32_t dtype, uint64_t weight, uint64_t* total_weight);

/** @brief Copy root's buf to every rank's buf. @retval GRADSYNC_E_OUT_OF_RANGE bad root @threadsafety handle */
GRADSYNC_API int gradsync_comm_broadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root);

/**
 * @brief Gather every rank's part into recv (total_count elements, parts by the partition rule).
 * @param comm the communicator
 * @param send this rank's part (its length by the partition rule), or NULL when it is already
 *        in place in recv at this rank's offset
 * @param recv total_count elements
 * @param total_count elements of all parts together
 * @param dtype a gradsync_dtype
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_allgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype);

/**
 * @brief gradsync_comm_allgather with a count of each rank's own (uneven data: the last batch, a
 *        rank with nothing to give): recv receives rank r's counts[r] elements after the parts of
 *        ranks 0 .. r-1, on every rank.
 *
 * Every rank passes the same counts; ranks that disagree all get GRADSYNC_E_MISMATCH. A count may
 * be 0. With the partition rule's counts this is gradsync_comm_allgather (the two calls match).
 * @param comm the communicator
 * @param send counts[rank] elements, or NULL when they are already in place in recv at this
 *        rank's offset
 * @param recv the sum of the counts, in elements
 * @param counts size entries (gradsync_comm_size), rank r's count at counts[r]
 * @param dtype a gradsync_dtype
 * @return GRADSYNC_OK, or GRADSYNC_E_INVALID_ARG (NULL counts or buffers, a sum that overflows),
 *         or an error as gradsync_comm_allgather gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_allgatherv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                          int32_t dtype);

/**
 * @brief Reduce send (total_count elements) over ranks; this rank receives its part by the
 *        partition rule into recv (which may point into send, at this rank's offset).
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_reduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                              int32_t dtype, int32_t op);

/**
 * @brief gradsync_comm_reduce_scatter with a count of each rank's own: send holds the sum of the
 *        counts; rank r receives the reduction (in rank order) of the counts[r] elements after the
 *        counts before it. Every rank passes the same counts (GRADSYNC_E_MISMATCH on every rank
 *        otherwise); a count may be 0. With the partition rule's counts this is
 *        gradsync_comm_reduce_scatter (the two calls match).
 * @param comm the communicator
 * @param send the sum of the counts, in elements
 * @param recv counts[rank] elements; may point into send at this rank's offset
 * @param counts size entries (gradsync_comm_size), rank r's count at counts[r]
 * @param dtype a gradsync_dtype
 * @param op a gradsync_op
 * @return GRADSYNC_OK, or GRADSYNC_E_INVALID_ARG (NULL counts or buffers, a sum that overflows),
 *         or an error as gradsync_comm_reduce_scatter gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_reduce_scatterv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                               int32_t dtype, int32_t op);

/**
 * @brief Exchange parts: send (total_count elements) is split into one part per rank by the
 *        partition rule, and part j goes to rank j. recv receives size blocks of this rank's part
 *        length, rank i's block at offset i * (this rank's part length), in rank order.
 *
 * The exchange of compressed reduce-scatters and of expert routing. Any dtype (nothing is
 * combined, bits are moved as they are). recv holds size * part length elements; send and recv
 * must not overlap.
 * @retval GRADSYNC_E_INVALID_ARG NULL or overlapping buffers
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                        int32_t dtype);

/**
 * @brief Exchange parts with counts and displacements of each rank's own (MPI_Alltoallv): the
 *        send_counts[d] elements at send + send_displs[d] go to rank d, which receives them at
 *        recv + its recv_displs[s] for this rank s. Sparse rows routed to their owners, uneven
 *        expert routing.
 *
 * One small round first gives every rank every rank's counts, so that ranks whose counts
 * disagree (rank s sends c elements to rank d, which expects c' from s) all get
 * GRADSYNC_E_MISMATCH, naming both, before anything moves; then the parts move in one round.
 * Any count may be 0. Never matches gradsync_comm_alltoall (a call of its own). Any dtype.
 * @param comm the communicator
 * @param send the parts for each rank, laid out as send_counts and send_displs say
 * @param send_counts size entries (gradsync_comm_size): elements for rank d at [d]
 * @param send_displs size entries: where the part for rank d starts in send (in elements); NULL:
 *        packed in rank order
 * @param recv the parts from each rank, laid out as recv_counts and recv_displs say
 * @param recv_counts size entries: elements expected from rank s at [s]
 * @param recv_displs size entries, as send_displs, for recv; NULL: packed in rank order
 * @param dtype a gradsync_dtype
 * @return GRADSYNC_OK, or GRADSYNC_E_INVALID_ARG (NULL counts, NULL or overlapping buffers, a
 *         displacement + count that overflows), GRADSYNC_E_MISMATCH, or an error as
 *         gradsync_comm_alltoall gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_alltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                         const size_t* send_displs, void* recv, const size_t* recv_counts,
                                         const size_t* recv_displs, int32_t dtype);

/**
 * @brief Reduce to one rank: root's recv = op over ranks of send, in rank order (the bits
 *        gradsync_comm_allreduce gives).
 *
 * The root is judged in the round: ranks that pass different roots all get GRADSYNC_E_MISMATCH,
 * a root out of range GRADSYNC_E_OUT_OF_RANGE on every rank. Statistics count it as a
 * reduce_scatter (it is one, with every count but the root's 0).
 * @param comm the communicator
 * @param send count elements
 * @param recv count elements at the root (may equal send: in place); not used elsewhere (may be NULL)
 * @param count elements
 * @param dtype a gradsync_dtype
 * @param op a gradsync_op
 * @param root the rank that receives
 * @return GRADSYNC_OK, or an error as gradsync_comm_allreduce gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_reduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t op, int32_t root);

/**
 * @brief Gather count elements from every rank into root's recv, rank r's at r * count.
 *
 * Roots and counts are judged in the round, as gradsync_comm_reduce's root. Statistics count
 * gather and scatter (and their v-forms) as alltoall. Any dtype.
 * @param comm the communicator
 * @param send count elements; must not overlap recv
 * @param recv size * count elements at the root; not used elsewhere (may be NULL)
 * @param count elements from each rank
 * @param dtype a gradsync_dtype
 * @param root the rank that receives
 * @return GRADSYNC_OK, or an error as gradsync_comm_alltoall gives it, or GRADSYNC_E_OUT_OF_RANGE
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_gather(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t root);

/**
 * @brief gradsync_comm_gather with a count of each rank's own: root receives rank r's send_count
 *        elements after those of ranks 0 .. r-1.
 *
 * A small round of counts comes first (as in gradsync_comm_alltoallv): a rank whose send_count is
 * not the root's recv_counts entry for it makes every rank fail with GRADSYNC_E_MISMATCH.
 * @param comm the communicator
 * @param send send_count elements
 * @param send_count elements from this rank (0 allowed)
 * @param recv the sum of recv_counts at the root; not used elsewhere (may be NULL)
 * @param recv_counts size entries at the root; not read elsewhere (may be NULL)
 * @param dtype a gradsync_dtype
 * @param root the rank that receives
 * @return GRADSYNC_OK, or an error as gradsync_comm_gather gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_gatherv(gradsync_comm* comm, const void* send, size_t send_count, void* recv,
                                       const size_t* recv_counts, int32_t dtype, int32_t root);

/**
 * @brief Scatter from root: rank r receives root's send elements [r * count, (r + 1) * count).
 * @param comm the communicator
 * @param send size * count elements at the root; not used elsewhere (may be NULL)
 * @param recv count elements; must not overlap send
 * @param count elements for each rank
 * @param dtype a gradsync_dtype
 * @param root the rank that sends
 * @return GRADSYNC_OK, or an error as gradsync_comm_gather gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_scatter(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t root);

/**
 * @brief gradsync_comm_scatter with a count of each rank's own: rank r receives send_counts[r]
 *        elements, packed in rank order in root's send; every rank says how many it expects
 *        (checked in a small round of counts first, as gradsync_comm_gatherv).
 * @param comm the communicator
 * @param send the sum of send_counts at the root; not used elsewhere (may be NULL)
 * @param send_counts size entries at the root; not read elsewhere (may be NULL)
 * @param recv recv_count elements
 * @param recv_count elements this rank expects (0 allowed)
 * @param dtype a gradsync_dtype
 * @param root the rank that sends
 * @return GRADSYNC_OK, or an error as gradsync_comm_gatherv gives it
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_scatterv(gradsync_comm* comm, const void* send, const size_t* send_counts, void* recv,
                                        size_t recv_count, int32_t dtype, int32_t root);

/** @brief Wait until every rank has arrived. @threadsafety handle */
GRADSYNC_API int gradsync_comm_barrier(gradsync_comm* comm);

/* ---------------------------------------------------------------- non-blocking collectives */

/*
 * Each collective above has a non-blocking form, gradsync_comm_i<name>, with the same arguments
 * plus a request out-parameter, and the same guarantees (same bits, mismatch on every rank,
 * deadlines, abort). Its arguments are checked at once (an error returns without a request);
 * the call itself runs on the communicator's progress thread, started by the first non-blocking
 * call, which makes progress whether or not the request is ever tested. The buffers (and
 * total_weight) stay borrowed until the request completes.
 *
 * Order: a communicator's calls run in the order they were made, blocking or not: requests
 * complete in issue order, and a blocking call (a collective, reset, alloc, free_buffer, a
 * shard's collective stage) made while requests are pending waits for them, then runs. Several
 * requests may be in flight; every rank must issue the same calls in the same order, as always.
 * gradsync_comm_abort fails the running request and every pending one with GRADSYNC_E_ABORTED
 * (after the reset, new requests work). gradsync_comm_free with requests pending aborts the
 * running one; those not yet started fail with GRADSYNC_E_MISUSE (the communicator was freed);
 * their request handles remain valid until freed. On MPI the progress thread needs
 * MPI_THREAD_MULTIPLE (GRADSYNC_E_UNSUPPORTED otherwise; MPI initialised by gradsync has it).
 */

/**
 * @brief Non-blocking gradsync_comm_allreduce.
 * @param comm the communicator
 * @param send as gradsync_comm_allreduce's
 * @param recv as gradsync_comm_allreduce's
 * @param count elements
 * @param dtype a gradsync_dtype
 * @param op a gradsync_op
 * @param[out] request the request, to wait for and free; NULL on failure
 * @retval GRADSYNC_E_UNSUPPORTED MPI without MPI_THREAD_MULTIPLE
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_iallreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype, int32_t op, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_allreduce_many (the pointer arrays are copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_iallreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                               const size_t* counts, size_t nbufs, int32_t dtype, int32_t op,
                                               gradsync_request** request);

/** @brief Non-blocking gradsync_comm_allreduce_mixed (the arrays are copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_iallreduce_mixed(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                                const size_t* counts, const int32_t* dtypes, size_t nbufs, int32_t op,
                                                gradsync_request** request);

/** @brief Non-blocking gradsync_comm_weighted_mean (*total_weight written at completion). @threadsafety handle */
GRADSYNC_API int gradsync_comm_iweighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                              int32_t dtype, uint64_t weight, uint64_t* total_weight,
                                              gradsync_request** request);

/** @brief Non-blocking gradsync_comm_broadcast. @threadsafety handle */
GRADSYNC_API int gradsync_comm_ibroadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root,
                                          gradsync_request** request);

/** @brief Non-blocking gradsync_comm_allgatherv (counts is copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_iallgatherv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                           int32_t dtype, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_allgather. @threadsafety handle */
GRADSYNC_API int gradsync_comm_iallgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                          int32_t dtype, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_reduce_scatterv (counts is copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_ireduce_scatterv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                                int32_t dtype, int32_t op, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_reduce_scatter. @threadsafety handle */
GRADSYNC_API int gradsync_comm_ireduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                               int32_t dtype, int32_t op, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_alltoall. @threadsafety handle */
GRADSYNC_API int gradsync_comm_ialltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_alltoallv (the counts and displacements are copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_ialltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                          const size_t* send_displs, void* recv, const size_t* recv_counts,
                                          const size_t* recv_displs, int32_t dtype, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_reduce. @threadsafety handle */
GRADSYNC_API int gradsync_comm_ireduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t op, int32_t root, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_gather. @threadsafety handle */
GRADSYNC_API int gradsync_comm_igather(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t root, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_gatherv (recv_counts is copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_igatherv(gradsync_comm* comm, const void* send, size_t send_count, void* recv,
                                        const size_t* recv_counts, int32_t dtype, int32_t root,
                                        gradsync_request** request);

/** @brief Non-blocking gradsync_comm_scatter. @threadsafety handle */
GRADSYNC_API int gradsync_comm_iscatter(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                        int32_t root, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_scatterv (send_counts is copied). @threadsafety handle */
GRADSYNC_API int gradsync_comm_iscatterv(gradsync_comm* comm, const void* send, const size_t* send_counts, void* recv,
                                         size_t recv_count, int32_t dtype, int32_t root, gradsync_request** request);

/** @brief Non-blocking gradsync_comm_barrier. @threadsafety handle */
GRADSYNC_API int gradsync_comm_ibarrier(gradsync_comm* comm, gradsync_request** request);

/**
 * @brief Wait for a request to complete.
 * @param request the request
 * @param[in] timeout_ms at most this long; negative: until it completes (a collective's own
 *        deadline bounds that), 0: do not wait
 * @return the request's status (its message as for any failed call, naming the non-blocking
 *         entry point); GRADSYNC_E_IN_PROGRESS when it has not completed in time (it stays
 *         pending, and may be waited for again)
 * @threadsafety request: any thread, one at a time
 */
GRADSYNC_API int gradsync_request_wait(gradsync_request* request, int64_t timeout_ms);

/**
 * @brief Whether a request has completed, without waiting.
 * @param request the request
 * @param[out] done 1 when completed, else 0
 * @return GRADSYNC_OK while pending; once completed, the request's status
 * @threadsafety request: any thread, one at a time
 */
GRADSYNC_API int gradsync_request_test(gradsync_request* request, int32_t* done);

/**
 * @brief Free a request; NULL is a no-op. A pending request is waited for first (its buffers are
 *        borrowed until it completes), so freeing never leaves a call running on freed memory.
 * @threadsafety request
 */
GRADSYNC_API void gradsync_request_free(gradsync_request* request);

/**
 * @brief The first failure of a non-blocking call on this communicator since its creation or the
 *        last gradsync_comm_reset (as NCCL's ncclCommGetAsyncError).
 * @param comm the communicator
 * @param[out] status GRADSYNC_OK, or that failure's status; its message is then this thread's
 *        gradsync_last_error_message
 * @threadsafety any thread
 */
GRADSYNC_API int gradsync_comm_get_async_error(const gradsync_comm* comm, int32_t* status);

/* ---------------------------------------------------------------- statistics and timeline */

/*
 * Every communicator counts its calls, blocking or not, on every transport: per collective, the
 * calls, their bytes and their time, split into waiting for peers (from this rank's arrival until
 * every rank has arrived, or the call failed waiting) and data movement (the rest of the call:
 * staging, reducing, copying and the barriers that pace them). For each round that every rank
 * reached, each rank's arrival is compared with the round's first arrival; every rank sees the
 * same arrivals, so every rank computes the same lateness figures and names the same straggler.
 * Arrivals are compared in the host's monotonic clock (THREAD, SHM) or, on MPI, in the ranks'
 * system clocks (exchanged at the start of every call; across hosts only as good as their clock
 * synchronisation). Figures accumulate from creation;
 * a call that starts another collective inside it counts once.
 */

/** Collectives, as gradsync_comm_stats indexes them (entry 0 is unused). */
typedef enum gradsync_collective {
  GRADSYNC_COLLECTIVE_ALLREDUCE = 1,      /**< allreduce and allreduce_many */
  GRADSYNC_COLLECTIVE_BROADCAST = 2,      /**< broadcast */
  GRADSYNC_COLLECTIVE_ALLGATHER = 3,      /**< allgather */
  GRADSYNC_COLLECTIVE_REDUCE_SCATTER = 4, /**< reduce_scatter */
  GRADSYNC_COLLECTIVE_BARRIER = 5,        /**< barrier */
  GRADSYNC_COLLECTIVE_WEIGHTED_MEAN = 6,  /**< weighted_mean */
  GRADSYNC_COLLECTIVE_ALLTOALL = 7        /**< alltoall */
} gradsync_collective;

/** Entries of gradsync_comm_statistics.collective: one per gradsync_collective value, and entry 0. */
#define GRADSYNC_COLLECTIVE_SLOTS 8

/** One collective's figures on this rank. */
typedef struct gradsync_comm_collective_stats {
  uint64_t calls;   /**< calls that returned GRADSYNC_OK */
  uint64_t failed;  /**< calls that returned an error (after their arguments were accepted) */
  uint64_t bytes;   /**< payload of the calls: the whole vector of each (count x element size) */
  uint64_t wait_ns; /**< time waiting for peers to arrive */
  uint64_t move_ns; /**< the rest of the calls' time: moving data */
} gradsync_comm_collective_stats;

/** One rank's arrivals, as every rank of the group saw them. */
typedef struct gradsync_comm_peer_stats {
  uint64_t late_ns;     /**< sum over rounds of its arrival after the round's first arrival */
  uint64_t max_late_ns; /**< the largest of those */
  uint64_t last;        /**< rounds in which it arrived last (strictly after the first) */
} gradsync_comm_peer_stats;

#define GRADSYNC_COMM_STATISTICS_VERSION 1

/**
 * A communicator's statistics, filled by gradsync_comm_stats. Set struct_size (and version) before
 * the call, with GRADSYNC_COMM_STATISTICS_INIT or by hand: the library writes the fields that size
 * holds, sets version to the version it wrote, and zeroes bytes of a newer struct it does not know.
 */
typedef struct gradsync_comm_statistics {
  uint32_t struct_size; /**< sizeof(gradsync_comm_statistics) as the caller compiled it */
  uint32_t version;     /**< out: the version the library filled in (GRADSYNC_COMM_STATISTICS_VERSION) */
  int32_t rank;         /**< this member's rank */
  int32_t size;         /**< ranks in the group: the entries gradsync_comm_stats writes to peers */
  int32_t straggler;    /**< the rank with the largest late_ns, or -1 while no rank was late */
  int32_t reserved0;    /**< 0 */
  uint64_t rounds;      /**< rounds whose arrivals were compared (the peers' figures cover these) */
  gradsync_comm_collective_stats collective[GRADSYNC_COLLECTIVE_SLOTS]; /**< by gradsync_collective */
  /* append only */
} gradsync_comm_statistics;

#define GRADSYNC_COMM_STATISTICS_INIT                                                     \
  {                                                                                       \
    sizeof(gradsync_comm_statistics), GRADSYNC_COMM_STATISTICS_VERSION, 0, 0, -1, 0, 0, { \
      { 0, 0, 0, 0, 0 }                                                                   \
    }                                                                                     \
  }

/**
 * @brief This rank's statistics of the communicator's calls since its creation (see above).
 *
 * Reads the figures without taking the handle: it may be called while a call of the
 * communicator runs (a request in flight), and then reports the calls completed so far.
 * @param[in] comm the communicator
 * @param[in,out] stats struct_size set by the caller (at least version 1's size); filled on success
 * @param[out] peers capacity entries, filled with rank r's arrivals at peers[r] for r < size; may
 *        be NULL when capacity is 0
 * @param[in] capacity entries in peers: 0 (peers not wanted) or at least the group's size
 * @retval GRADSYNC_E_INVALID_ARG stats is NULL, its struct_size fits no version, or peers is NULL
 *         with capacity > 0
 * @retval GRADSYNC_E_BUFS 0 < capacity < size: stats is filled (its size says how many entries
 *         peers needs), peers is untouched
 * @threadsafety any (also while another thread is inside a call on comm)
 */
GRADSYNC_API int gradsync_comm_stats(const gradsync_comm* comm, gradsync_comm_statistics* stats,
                                     gradsync_comm_peer_stats* peers, size_t capacity);

/**
 * @brief Write this rank's timeline of the communicator's calls to a file, as Chrome-trace JSON
 *        (chrome://tracing, Perfetto): per call an event named after the collective (args: the
 *        call number, bytes, status) and within it its phases, "wait for peers" and "data
 *        movement"; the process is this rank. Timestamps are in the host's monotonic clock, so
 *        the files of one host's ranks line up when loaded together.
 *
 * With the environment variable GRADSYNC_TIMELINE=prefix set, gradsync_comm_create starts one
 * for each communicator at "<prefix>.<rank>" (a prefix that cannot be written fails the create
 * with GRADSYNC_E_IO). Events are written in batches, and the document is completed when the
 * timeline is stopped (path NULL), replaced, or the communicator freed.
 * @param[in] comm the communicator
 * @param[in] path the file to write (created or truncated), or NULL to stop and complete the current one
 * @retval GRADSYNC_E_IO path cannot be written, or the timeline being completed could not be
 *         written in full (the message names the file)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_timeline(gradsync_comm* comm, const char* path);

/* ---------------------------------------------------------------- buffers for zero copy */

/**
 * @brief Allocate memory for this communicator's buffers, valid until gradsync_comm_free_buffer
 *        or gradsync_comm_free (which releases every buffer still allocated).
 *
 * On GRADSYNC_TRANSPORT_SHM the memory lies in the group's shared-memory segment: when every
 * rank's buffers of a collective come from here, the collective runs zero copy (each rank
 * reduces its slice straight from the peers' buffers). Its pages are reserved in /dev/shm now, so
 * touching them later can never SIGBUS. Other transports return ordinary memory. Either way it is
 * aligned to 4096 bytes, and ordinary buffers work in every collective too.
 * @param comm the communicator
 * @param[in] bytes size in bytes, > 0
 * @param[out] ptr the memory; NULL on failure
 * @retval GRADSYNC_E_INVALID_ARG ptr is NULL or bytes is 0
 * @retval GRADSYNC_E_NO_SPACE /dev/shm (SHM) has not that much space left
 * @retval GRADSYNC_E_NOMEM out of memory (other transports)
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_alloc(gradsync_comm* comm, size_t bytes, void** ptr);

/**
 * @brief Free memory from gradsync_comm_alloc of this communicator; NULL is a no-op.
 * @retval GRADSYNC_E_INVALID_ARG ptr was not allocated by this communicator, or was already freed
 * @threadsafety handle
 */
GRADSYNC_API int gradsync_comm_free_buffer(gradsync_comm* comm, void* ptr);

GRADSYNC_END_DECL

#endif /* GRADSYNC_COMM_H */
