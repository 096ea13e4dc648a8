// SPDX-License-Identifier: Apache-2.0
#pragma once
// Threads as ranks of an MPI or hierarchical group: each process of the MPI job holds several
// ranks, one per thread that creates the communicator (Options::threads, Options::thread).
//
// Two levels, each a transport of its own, model-checked there: the threads of a process form a
// thread-transport group (the team), and the processes meet in a process-level group of the
// requested transport (MPI or hierarchical), the lane, which the team's rank 0 alone calls (no MPI
// communicator is used by two threads at once). The group's calls run through the team's rank 0
// and the lane: the team brings the process's part together, the lane carries it between
// processes, the team hands out the result. A subgroup's lane is formed by each process's thread
// 0 over the lane and handed to the subgroup's rank 0 on the process. A reduction combines within
// a process in thread order, then over the processes as the lane's transport does: the same bits
// on every rank and run of one layout (the flat rank-order bits with topology_independent, and
// always for the types whose levels would round). Each call's check rides in thread 0's lane call
// where it can (checked_levels, tests/model/threaded_check.pml). A shrink or a grow remakes the lane
// with the lane transport's own, then the teams. How a failure in one level reaches the threads in
// the others: run_levels, checked by tests/model/threaded.pml.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.hpp"

namespace gradsync::comm {

// Every thread of every process calls it, with options.threads (>= 1) and options.thread set, and
// options.transport Mpi or Hier. make_group makes a group of one rank per thread of the options
// (the team) or per process (a lane): comm::create. Collective over the whole job.
using MakeGroup = std::unique_ptr<Communicator> (*)(const Options& options);
std::unique_ptr<Communicator> create_threaded_communicator(const Options& options, MakeGroup make_group);
// A joiner's side of a grow (comm::join with options.threads set): every thread of a process the
// members' grow started calls it. join makes the lane's joiner (comm::join with one rank per
// process), make_group the team.
using JoinLane = GrowResult (*)(const Options& options);
GrowResult join_threaded_communicator(const Options& options, JoinLane join, MakeGroup make_group);

// Every rank's process (its lane rank), by rank, from the thread counts the processes reported
// (by lane rank). They come from peers, so each is checked before it lays anything out: a count
// outside [1, 256], or one for this process (process) other than its own (threads), is
// GRADSYNC_E_CORRUPT, the same on every process (they all judge the same counts).
std::vector<int> lay_out_ranks(std::span<const int64_t> reported, int process, int threads);
// A grown group's: the members' ranks as they were (old_proc_of: each member rank's process, by
// the members' first process, checked against the counts the member processes reported), then the
// joining processes' threads in process order (member_procs: the processes before the grow).
// GRADSYNC_E_CORRUPT as lay_out_ranks.
std::vector<int> lay_out_grown(std::span<const int64_t> reported, std::span<const int64_t> old_proc_of, int process,
                               int threads, int member_procs);

}  // namespace gradsync::comm
