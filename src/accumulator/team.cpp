// SPDX-License-Identifier: Apache-2.0
#include "accumulator/team.hpp"

#include <algorithm>
#include <new>
#include <stdexcept>

#include "common/error.hpp"

namespace gradsync::accumulator {

Team::Team(unsigned owners) : taken_(owners) {
  for (auto& slot : ring_) slot.store(nullptr, std::memory_order_relaxed);
  threads_.reserve(owners - 1);
  try {
    for (unsigned w = 1; w < owners; ++w) threads_.emplace_back([this, w] { work(w); });
  } catch (...) {
    stop();
    throw;
  }
}

void Team::run(Fn fn, void* ctx) {
  owner_.require_here("an owner-mode accumulator",
                      "its owner threads are not in this process; open the file again in the child");
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.remaining.store(size(), std::memory_order_relaxed);
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> order(submit_);
    seq = published_.load(std::memory_order_relaxed);
    // The ring slot is free once every owner has taken the job kRing places back.
    wait_until(
        done_word_, [&] { return seq - slowest() < kRing; }, WaitClock::time_point::max());
    ring_[seq % kRing].store(&job, std::memory_order_relaxed);
    published_.store(seq + 1, std::memory_order_seq_cst);
    notify(published_word_);
  }
  // Owner 0's turn comes when it has finished the jobs before this one.
  wait_until(
      done_word_, [&] { return taken_[0].n.load(std::memory_order_seq_cst) == seq; }, WaitClock::time_point::max());
  run_share(job, 0);
  taken_[0].n.store(seq + 1, std::memory_order_seq_cst);
  finish(job);
  wait_until(
      done_word_, [&] { return job.remaining.load(std::memory_order_seq_cst) == 0; }, WaitClock::time_point::max());
  if (job.failed.load(std::memory_order_acquire)) throw Error(job.status, job.message);
}

uint64_t Team::slowest() const noexcept {
  uint64_t m = UINT64_MAX;
  for (const auto& t : taken_) m = std::min(m, t.n.load(std::memory_order_seq_cst));
  return m;
}

void Team::run_share(Job& job, unsigned w) noexcept {
  try {
    job.fn(job.ctx, w, size());
  } catch (const Error& e) {
    fail_job(job, e.status(), e.what());
  } catch (const std::bad_alloc&) {
    fail_job(job, GRADSYNC_E_NOMEM, "out of memory in an accumulator owner");
  } catch (const std::exception& e) {
    fail_job(job, GRADSYNC_E_INTERNAL, e.what());
  } catch (...) {
    fail_job(job, GRADSYNC_E_INTERNAL, "unknown exception in an accumulator owner");
  }
}

void Team::finish(Job& job) noexcept {
  job.remaining.fetch_sub(1, std::memory_order_seq_cst);
  notify(done_word_);
}

void Team::fail_job(Job& job, int status, std::string message) noexcept {
  if (job.claimed.exchange(true, std::memory_order_acq_rel)) return;
  job.status = status;
  try {
    job.message = std::move(message);
  } catch (...) {
  }
  job.failed.store(true, std::memory_order_release);
}

void Team::work(unsigned w) {
  // Spins as long as spinning has caught the next job lately: a caller's next batch usually
  // follows within microseconds, and a futex wake-up costs tens of them.
  AdaptiveWait wait(static_cast<int>(size()));
  for (uint64_t seq = 0;; ++seq) {
    wait(
        published_word_,
        [&] { return published_.load(std::memory_order_seq_cst) > seq || stop_.load(std::memory_order_seq_cst) != 0; },
        WaitClock::time_point::max());
    if (published_.load(std::memory_order_seq_cst) <= seq) return;  // stopped, and nothing left
    Job& job = *ring_[seq % kRing].load(std::memory_order_relaxed);
    taken_[w].n.store(seq + 1, std::memory_order_seq_cst);
    notify(done_word_);
    run_share(job, w);
    finish(job);
  }
}

void Team::stop() noexcept {
  stop_.store(1, std::memory_order_seq_cst);
  notify(published_word_);
  if (!owner_.here()) {
    // A forked child has none of these threads: joining (or destroying joinable handles) would
    // hang or abort, so the handles are left behind.
    new std::vector<std::thread>(std::move(threads_));
    return;
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

}  // namespace gradsync::accumulator
