// SPDX-License-Identifier: Apache-2.0
// Fault scenarios of the MPI transport, run under mpirun by run_fault.py, which checks what the
// job printed and how mpirun ended. Modes:
//   kill         rank 1 is SIGKILLed at a random point of a loop of allreduces; the others keep calling.
//   kill-before  rank 1 is SIGKILLed while the others wait for it to arrive at a barrier.
//   kill-small   rank 1 is SIGKILLed at a random point of a loop of 1-float allreduces (the small
//                path, whose data travels with the exchange); the others keep calling.
//   abandon      rank 1 skips an allreduce; the others time out and exit without a reset.
//   loop         every rank calls allreduces until one fails, saying "looping" once under way;
//                ranks are killed from outside (tests/multihost/kill_host.py kills a host's).
// Every rank prints "rank R: <status> <message>" for each failed call and "rank R: done" at the end.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "common/error.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using namespace std::chrono_literals;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  Options o;
  o.transport = Transport::Mpi;
  o.timeout = 20000ms;
  auto c = create(o);
  if (mode == "abandon") {
    // Processes start at different times: meet first, then join the group with the short deadline.
    c->barrier();
    o.timeout = 1000ms;
    c = create(o);
  }
  const int rank = c->rank();
  std::vector<float> v(1 << 20, 1.0f);
  const BufferRef b{v.data(), v.data(), mode == "kill-small" ? 1 : v.size()};
  auto report = [&](const Error& e) {
    std::printf("rank %d: %s %s\n", rank, gradsync_status_string(e.status()), e.what());
    std::fflush(stdout);
  };

  if (mode == "kill" || mode == "loop" || mode == "kill-small") {
    if ((mode == "kill" || mode == "kill-small") && rank == 1) {
      std::thread([] {
        std::this_thread::sleep_for(200ms);
        ::kill(::getpid(), SIGKILL);
      }).detach();
    }
    for (int round = 0; round < 100000; ++round) {
      try {
        c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
        std::fill(v.begin(), v.end(), 1.0f);
        if (round == 10 && mode == "loop") {
          std::printf("rank %d: looping\n", rank);
          std::fflush(stdout);
        }
      } catch (const Error& e) {
        report(e);
        break;
      }
    }
  } else if (mode == "kill-before") {
    c->barrier();
    if (rank == 1) ::kill(::getpid(), SIGKILL);
    try {
      c->barrier();
    } catch (const Error& e) {
      report(e);
    }
  } else if (mode == "abandon") {
    // The first rank to exit ends the job with MPI_Abort, which kills the others. Exactly one rank
    // should get there: rank 0, seconds after its timeout, so that rank 2, however late the load
    // makes it, has reported its own. Rank 1 never arrives and is killed while it sleeps: a rank
    // inside MPI_Finalize, or two ranks aborting at once, can leave Open MPI 4.1's mpirun hanging.
    if (rank == 1) {
      std::this_thread::sleep_for(15000ms);
    } else {
      try {
        c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
      } catch (const Error& e) {
        report(e);
      }
      std::this_thread::sleep_for(rank == 0 ? 3000ms : 10000ms);
    }
  } else {
    std::fprintf(stderr, "usage: %s kill|kill-before|kill-small|abandon|loop\n", argv[0]);
    return 2;
  }
  c.reset();
  std::printf("rank %d: done\n", rank);
  std::fflush(stdout);
  return 0;
}
