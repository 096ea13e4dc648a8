// SPDX-License-Identifier: Apache-2.0
#pragma once
// Two ranks, threads of this process, forming a shared-memory segment and a thread group of two
// named `name`, each thread first pinned to the CPU given for it (-1: left as it is), for the
// tests of how many CPUs a group counts. The thread group's count shows only in the line its
// ranks log; the segment's is returned.
#include <pthread.h>
#include <sched.h>

#include <barrier>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "comm/transport/shm/segment.hpp"

struct PairCount {
  int segment[2] = {0, 0};  // each rank's Segment::cpus()
  std::string error;        // what went wrong on either rank; empty when nothing did
};

inline PairCount form_pair(const std::string& name, int pin0, int pin1) {
  using namespace std::chrono_literals;
  PairCount out;
  std::string error[2];
  std::barrier joined(2);
  auto rank = [&](int r) {
    if (const int cpu = r == 0 ? pin0 : pin1; cpu >= 0) {
      cpu_set_t one, now;
      CPU_ZERO(&one);
      CPU_ZERO(&now);
      CPU_SET(cpu, &one);
      if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) != 0 ||
          pthread_getaffinity_np(pthread_self(), sizeof now, &now) != 0 || !CPU_EQUAL(&now, &one)) {
        error[r] = "rank " + std::to_string(r) + " could not be pinned to CPU " + std::to_string(cpu) + "; ";
      }
    }
    std::unique_ptr<gradsync::comm::shm::Segment> seg;
    std::unique_ptr<gradsync::comm::Communicator> group;
    try {
      seg = gradsync::comm::shm::Segment::join(name, r, 2, gradsync::comm::shm::Clock::now() + 20s);
      out.segment[r] = seg->cpus();
      gradsync::comm::Options o;
      o.name = name;
      o.rank = r;
      o.size = 2;
      o.timeout = 20s;
      group = gradsync::comm::create(o);
    } catch (const std::exception& e) {
      error[r] += e.what();
    }
    joined.arrive_and_wait();  // neither leaves while the other may still be forming a group
  };
  std::thread a(rank, 0), b(rank, 1);
  a.join();
  b.join();
  out.error = error[0] + error[1];
  return out;
}
