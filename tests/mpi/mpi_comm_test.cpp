// SPDX-License-Identifier: Apache-2.0
// The communicator's test cases on the MPI transport, run by ctest under a real mpirun with 2, 3,
// 4 and 5 ranks. Every rank runs the same test cases in the same order; every wait is bounded by the
// communicator's timeout, so a failing rank cannot hang the others. What is MPI's own is here:
// the non-deterministic mode (MPI's reduction order), check_mismatch off, the staging windows,
// several MPI communicators, the abort's notices. Deterministic mode, which must give what every
// transport gives, is tested by the conformance suite (conformance:mpi_*) with the others.
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "../unit/test_support.hpp"
#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "common/error.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<Communicator> make(bool deterministic = true, bool check_mismatch = true,
                                   std::chrono::milliseconds timeout = 20000ms, std::string host_label = "") {
  Options o;
  o.host_label = std::move(host_label);
  o.transport = Transport::Mpi;
  o.deterministic = deterministic;
  o.check_mismatch = check_mismatch;
  o.timeout = timeout;
  return create(o);
}

// Runs f and returns the status it threw (GRADSYNC_OK if none), keeping the message.
template <class F>
int status_of(F&& f, std::string* message = nullptr) {
  try {
    f();
    return GRADSYNC_OK;
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.status();
  }
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Rank r's element i: floats of many magnitudes (so the order of summation shows in the bits),
// integers that make i32 sums wrap.
template <class T>
T input(int rank, size_t i) {
  const uint64_t h = mix(static_cast<uint64_t>(rank) * 1000003u + i + 17);
  if constexpr (std::is_floating_point_v<T>) {
    const double unit = static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
    return static_cast<T>(std::ldexp(unit, static_cast<int>(h % 24) - 12));
  } else if constexpr (sizeof(T) == 4) {
    return static_cast<T>(static_cast<int64_t>(h % (uint64_t{1} << 31)) - (int64_t{1} << 30));
  } else {
    return static_cast<T>(static_cast<int64_t>(h % (uint64_t{1} << 40)) - (int64_t{1} << 39));
  }
}

// The rank-order reference, written independently of the kernels.
template <class T>
T reference(ReduceOp op, int n, size_t i) {
  if constexpr (std::is_floating_point_v<T>) {
    T acc = input<T>(0, i);
    for (int r = 1; r < n; ++r) {
      const T v = input<T>(r, i);
      if (op == ReduceOp::Min)
        acc = v < acc ? v : acc;
      else if (op == ReduceOp::Max)
        acc = acc < v ? v : acc;
      else
        acc = acc + v;
    }
    return op == ReduceOp::Mean ? acc / static_cast<T>(n) : acc;
  } else {
    using U = std::make_unsigned_t<T>;
    if (op == ReduceOp::Min || op == ReduceOp::Max) {
      T acc = input<T>(0, i);
      for (int r = 1; r < n; ++r)
        acc = op == ReduceOp::Min ? std::min(acc, input<T>(r, i)) : std::max(acc, input<T>(r, i));
      return acc;
    }
    if (op == ReduceOp::Mean && sizeof(T) == 4) {
      int64_t sum = 0;
      for (int r = 0; r < n; ++r) sum += input<T>(r, i);
      return static_cast<T>(sum / n);
    }
    U sum = 0;
    for (int r = 0; r < n; ++r) sum = static_cast<U>(sum + static_cast<U>(input<T>(r, i)));
    if (op == ReduceOp::Mean) return static_cast<T>(static_cast<T>(sum) / n);
    return static_cast<T>(sum);
  }
}

template <class T>
double magnitude(int n, size_t i) {
  double m = 0;
  for (int r = 0; r < n; ++r) m += std::fabs(static_cast<double>(input<T>(r, i)));
  return m;
}

// Checks recv against the reference: bit for bit when deterministic (or an order-free op), else
// within the rounding error of any summation order.
template <class T>
void check_result(const std::vector<T>& got, ReduceOp op, int n, size_t offset, bool exact) {
  size_t bad = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const size_t i = offset + k;
    const T want = reference<T>(op, n, i);
    bool ok;
    if (exact || !std::is_floating_point_v<T> || op == ReduceOp::Min || op == ReduceOp::Max) {
      ok = std::memcmp(&want, &got[k], sizeof(T)) == 0;
    } else {
      const double eps = std::is_same_v<T, float> ? 1e-6 : 1e-14;
      ok = std::fabs(static_cast<double>(got[k]) - static_cast<double>(want)) <= eps * n * magnitude<T>(n, i);
    }
    if (!ok && bad++ < 3) {
      INFO("element " << i << " got " << got[k] << " want " << want);
      CHECK(ok);
    }
  }
  CHECK(bad == 0);
}

uint64_t hash_bytes(const void* p, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// Whether every rank computed the same hash (compared through MPI itself, not the library).
bool same_on_every_rank(uint64_t h) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<uint64_t> all(static_cast<size_t>(size));
  MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  return std::all_of(all.begin(), all.end(), [&](uint64_t x) { return x == all[0]; });
}

// Every rank's status, for checks that all ranks saw the same outcome.
std::vector<int> statuses(int status) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> all(static_cast<size_t>(size));
  MPI_Allgather(&status, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
  return all;
}

template <class T>
void run_allreduce_case(Communicator& c, ReduceOp op, size_t count, bool exact) {
  const int n = c.size();
  std::vector<T> send(count), recv(count);
  for (size_t i = 0; i < count; ++i) send[i] = input<T>(c.rank(), i);
  const BufferRef b{send.data(), recv.data(), count};
  c.allreduce(std::span<const BufferRef>(&b, 1), dtype_of<T>(), op);
  check_result<T>(recv, op, n, 0, exact);
  // In place gives the same bits.
  const BufferRef in_place{send.data(), send.data(), count};
  c.allreduce(std::span<const BufferRef>(&in_place, 1), dtype_of<T>(), op);
  CHECK((count == 0 || std::memcmp(send.data(), recv.data(), count * sizeof(T)) == 0));
  CHECK(same_on_every_rank(hash_bytes(recv.data(), count * sizeof(T))));
}

template <class T>
void run_all_ops(Communicator& c, bool deterministic) {
  const size_t n = static_cast<size_t>(c.size());
  for (size_t count : {size_t{0}, size_t{1}, n - 1, n + 1, size_t{7}, size_t{1003}, size_t{20011}}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max}) {
      INFO(dtype_name(dtype_of<T>()) << " " << op_name(op) << " count " << count << " deterministic " << deterministic);
      run_allreduce_case<T>(c, op, count, deterministic);
    }
  }
}

}  // namespace

TEST_CASE("allreduce, non-deterministic: ops x dtypes x sizes within rounding of the reference", "[mpi]") {
  auto c = make(false);
  run_all_ops<float>(*c, false);
  run_all_ops<double>(*c, false);
  run_all_ops<int32_t>(*c, false);
  run_all_ops<int64_t>(*c, false);
}

TEST_CASE("allreduce: deterministic mode crosses its staging windows and is bitwise identical run to run", "[mpi]") {
  auto c = make(true);
  // More than one 16 MiB window of f32, not divisible by the number of ranks.
  const size_t count = (size_t{16} << 20) / 4 + 12345;
  std::vector<float> send(count), recv(count);
  for (size_t i = 0; i < count; ++i) send[i] = input<float>(c->rank(), i);
  const BufferRef b{send.data(), recv.data(), count};
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
  const uint64_t first = hash_bytes(recv.data(), count * 4);
  CHECK(same_on_every_rank(first));
  std::vector<float> head(recv.begin(), recv.begin() + 1000), tail(recv.end() - 1000, recv.end());
  check_result<float>(head, ReduceOp::Sum, c->size(), 0, true);
  check_result<float>(tail, ReduceOp::Sum, c->size(), count - 1000, true);
  std::fill(recv.begin(), recv.end(), 0.0f);
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
  CHECK(hash_bytes(recv.data(), count * 4) == first);
}

TEST_CASE("fused allreduce, non-deterministic, equals one allreduce per buffer", "[mpi]") {
  {
    const bool deterministic = false;
    auto c = make(deterministic);
    // Small buffers (packed), an empty one, a large one (sent directly), and many staging fills
    // (256 KiB each), so that buffers straddle fills.
    std::vector<size_t> counts;
    for (size_t i = 0; i < 150; ++i) counts.push_back(i % 37 == 5 ? 0 : 1000 + (i * 7919) % 15000);
    counts.insert(counts.begin() + 50, size_t{1} << 17);
    counts.push_back(3);
    size_t offset = 0;
    std::vector<std::vector<float>> fused(counts.size()), single(counts.size());
    std::vector<BufferRef> refs;
    for (size_t b = 0; b < counts.size(); ++b) {
      fused[b].resize(counts[b]);
      for (size_t i = 0; i < counts[b]; ++i) fused[b][i] = input<float>(c->rank(), offset + i);
      single[b] = fused[b];
      offset += counts[b];
      refs.push_back(BufferRef{fused[b].data(), fused[b].data(), counts[b]});
    }
    c->allreduce(refs, DType::F32, ReduceOp::Sum);
    offset = 0;
    for (size_t b = 0; b < counts.size(); ++b) {
      const BufferRef one{single[b].data(), single[b].data(), counts[b]};
      c->allreduce(std::span<const BufferRef>(&one, 1), DType::F32, ReduceOp::Sum);
      if (deterministic) {
        CHECK(fused[b] == single[b]);
        check_result<float>(fused[b], ReduceOp::Sum, c->size(), offset, true);
      } else {
        check_result<float>(fused[b], ReduceOp::Sum, c->size(), offset, false);
      }
      offset += counts[b];
    }
  }
}

TEST_CASE("broadcast, allgather, reduce_scatter and barrier, non-deterministic", "[mpi]") {
  {
    const bool deterministic = false;
    auto c = make(deterministic);
    const int n = c->size();
    const size_t un = static_cast<size_t>(n);
    for (int root = 0; root < n; ++root) {
      std::vector<double> v(1001, c->rank() == root ? 1.5 * root : -1.0);
      c->broadcast(v.data(), v.size(), DType::F64, root);
      CHECK(v == std::vector<double>(1001, 1.5 * root));
    }
    // Halves are moved bit for bit.
    std::vector<uint16_t> h(33, c->rank() == 0 ? 0xBEEF : 0);
    c->broadcast(h.data(), h.size(), DType::BF16, 0);
    CHECK(h == std::vector<uint16_t>(33, 0xBEEF));

    for (size_t total : {size_t{0}, un - 1, size_t{10}, size_t{1003}}) {
      INFO("total " << total);
      const Part mine = c->my_part(total);
      std::vector<int64_t> all(total, -1), part(mine.len);
      for (size_t i = 0; i < mine.len; ++i) part[i] = static_cast<int64_t>(mine.start + i) * 3;
      c->allgather(part.data(), all.data(), total, DType::I64);
      for (size_t i = 0; i < total; ++i) CHECK(all[i] == static_cast<int64_t>(i) * 3);
      // In place: this rank's part already sits in recv.
      std::vector<int64_t> in_place(total, -1);
      for (size_t i = 0; i < mine.len; ++i) in_place[mine.start + i] = static_cast<int64_t>(mine.start + i) * 3;
      c->allgather(nullptr, in_place.data(), total, DType::I64);
      CHECK(in_place == all);

      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max}) {
        std::vector<float> send(total);
        for (size_t i = 0; i < total; ++i) send[i] = input<float>(c->rank(), i);
        std::vector<float> recv(mine.len);
        c->reduce_scatter(send.data(), recv.data(), total, DType::F32, op);
        check_result<float>(recv, op, n, mine.start, deterministic);
        // recv inside send, at this rank's offset.
        c->reduce_scatter(send.data(), send.data() + mine.start, total, DType::F32, op);
        CHECK(std::equal(recv.begin(), recv.end(), send.begin() + static_cast<std::ptrdiff_t>(mine.start)));
      }
    }
    c->barrier();
  }
}

TEST_CASE("mismatch of op, dtype, root or collective, non-deterministic: every rank errs, nobody moves data", "[mpi]") {
  {
    const bool deterministic = false;
    auto c = make(deterministic);
    const bool odd = c->rank() % 2 == 1;
    std::vector<float> v(16, static_cast<float>(c->rank()));
    const BufferRef b{v.data(), v.data(), v.size()};
    std::string message;

    int st = status_of(
        [&] { c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, odd ? ReduceOp::Max : ReduceOp::Sum); },
        &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 16 f32 (max) but rank 0 called allreduce of 16 f32 (sum)") !=
          std::string::npos);

    const BufferRef bi{v.data(), v.data(), 8};
    st = status_of([&] {
      c->allreduce(std::span<const BufferRef>(odd ? &bi : &b, 1), odd ? DType::F64 : DType::F32, ReduceOp::Sum);
    });
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);

    st = status_of([&] { c->broadcast(v.data(), v.size(), DType::F32, odd ? 1 : 0); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("broadcast of 16 f32 from root 1 but rank 0 called broadcast of 16 f32 from root 0") !=
          std::string::npos);

    st = status_of(
        [&] {
          if (odd)
            c->barrier();
          else
            c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
        },
        &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("called barrier") != std::string::npos);
    CHECK(v == std::vector<float>(16, static_cast<float>(c->rank())));

    // The group is still in step.
    c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Max);
    CHECK(v[0] == static_cast<float>(c->size() - 1));
  }
}

TEST_CASE("small path: calls that differ in count, dtype, op, size class or a skipped call fail on every rank",
          "[mpi]") {
  // An allreduce that fits travels with its exchange; ranks whose calls differ must all get
  // E_MISMATCH naming the ranks, before any rank writes its output, and stay in step.
  for (const bool deterministic : {false, true}) {
    auto c = make(deterministic);
    const bool odd = c->rank() % 2 == 1;
    std::vector<float> v(16, static_cast<float>(c->rank())), out(16, -1.0f);
    std::vector<float> big(64 << 10, 1.0f);  // past the small path: its exchange commits
    const BufferRef b{v.data(), out.data(), 16}, b8{v.data(), out.data(), 8}, bbig{big.data(), big.data(), big.size()};
    std::string message;
    auto allreduce = [&](const BufferRef& x, DType t, ReduceOp op) {
      c->allreduce(std::span<const BufferRef>(&x, 1), t, op);
    };

    int st = status_of([&] { allreduce(odd ? b8 : b, DType::F32, ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 8 f32 (sum) but rank 0 called allreduce of 16 f32 (sum)") !=
          std::string::npos);

    // Same bytes, another dtype.
    st = status_of([&] { allreduce(b, odd ? DType::I32 : DType::F32, ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 16 i32 (sum)") != std::string::npos);

    st = status_of([&] { allreduce(b, DType::F32, odd ? ReduceOp::Min : ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("(min) but rank 0 called allreduce of 16 f32 (sum)") != std::string::npos);

    // One rank's call fits the small path, the other's does not.
    st = status_of([&] { allreduce(odd ? bbig : b, DType::F32, ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 65536 f32 (sum)") != std::string::npos);

    // Messages a little past 4 KiB go in two pieces: one rank's in two, the other's whole, and
    // both in two pieces of different lengths. The pieces pair up: the group stays in step.
    std::vector<float> mid(1536, 1.0f);
    const BufferRef b1k{mid.data(), mid.data(), 1024}, b1536{mid.data(), mid.data(), 1536};
    st = status_of([&] { allreduce(odd ? b1k : b, DType::F32, ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 1024 f32 (sum)") != std::string::npos);
    st = status_of([&] { allreduce(odd ? b1k : b1536, DType::F32, ReduceOp::Sum); }, &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 1024 f32 (sum) but rank 0 called allreduce of 1536 f32 (sum)") !=
          std::string::npos);
    CHECK(mid == std::vector<float>(1536, 1.0f));
    for (const BufferRef& x : {b1k, b1536}) {
      std::fill(mid.begin(), mid.end(), static_cast<float>(c->rank() + 1));
      allreduce(x, DType::F32, ReduceOp::Sum);
      const auto n = static_cast<float>(c->size());
      CHECK(std::count(mid.begin(), mid.begin() + static_cast<std::ptrdiff_t>(x.count), n * (n + 1) / 2) ==
            static_cast<std::ptrdiff_t>(x.count));
    }

    // The odd ranks skip the barrier the even ones call.
    st = status_of(
        [&] {
          if (!odd) c->barrier();
          allreduce(b, DType::F32, ReduceOp::Sum);
        },
        &message);
    for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
    CHECK(message.find("rank 1 called allreduce of 16 f32 (sum) but rank 0 called barrier") != std::string::npos);
    CHECK(out == std::vector<float>(16, -1.0f));  // nobody wrote its output
    CHECK(big == std::vector<float>(64 << 10, 1.0f));

    // Still in step: the even ranks' allreduce was never posted; everyone calls it now.
    allreduce(b, DType::F32, ReduceOp::Sum);
    CHECK(out[0] == static_cast<float>(c->size() * (c->size() - 1) / 2));
  }
}

TEST_CASE("the exchange, direct and by recursive doubling: sizes around each switch point, a lone rank's call anywhere",
          "[mpi]") {
  // On one host every rank sends its entry to every peer; a group over several hosts (here: host
  // labels that put each pair of ranks on a host of its own) exchanges by recursive doubling, with
  // the lowest even ranks outside it when the group is not a power of two (they send to the rank
  // above and get the whole table back). Sizes
  // around where a message goes in two pieces (4032 bytes, entries of 32 bytes + data, one entry
  // per message in the first step and two in the second) and where the small path ends
  // (min(16 KiB, 64 KiB / size) per rank): the small path's result is the rank-order fold, bit
  // for bit, deterministic or not.
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  for (const std::string& label : {std::string(), "pair" + std::to_string(world / 2)}) {
    INFO("host label '" << label << "'");
    for (const bool deterministic : {false, true}) {
      auto c = make(deterministic, true, 20000ms, label);
      const int n = c->size();
      const size_t small_floats = std::min<size_t>(16384, 65536 / static_cast<size_t>(n)) / 64 * 64 / sizeof(float);
      for (size_t count :
           {size_t{1}, size_t{495}, size_t{496}, size_t{497}, size_t{999}, size_t{1000}, size_t{1001}, size_t{2007},
            size_t{2008}, size_t{2009}, small_floats - 1, small_floats, small_floats + 1, size_t{4096}, size_t{4097}}) {
        INFO("count " << count << " deterministic " << deterministic);
        run_allreduce_case<float>(*c, ReduceOp::Sum, count, deterministic || count <= small_floats);
        run_allreduce_case<double>(*c, ReduceOp::Mean, count, deterministic || count * 8 <= small_floats * 4);
      }
    }
    // One rank's call differs, whichever rank it is (outside the doubling, its partner, the last):
    // every rank gets E_MISMATCH naming the first rank whose call differs from rank 0's, nobody
    // writes its output, and the group stays in step. The lone call has fewer elements, two pieces
    // against whole messages, or no data at all (past the small path) against entries with data.
    auto c = make(false, true, 20000ms, label);
    const int n = c->size();
    std::vector<float> v(4096, 1.0f), out(4096, -1.0f);
    std::vector<float> big(64 << 10, 1.0f);
    struct Kind {
      BufferRef lone, others;
    };
    const Kind kinds[] = {{{v.data(), out.data(), 8}, {v.data(), out.data(), 16}},
                          {{v.data(), out.data(), 1001}, {v.data(), out.data(), 1000}},
                          {{big.data(), big.data(), big.size()}, {v.data(), out.data(), 1000}}};
    for (const Kind& kind : kinds) {
      for (int lone = 0; lone < n; ++lone) {
        INFO("lone rank " << lone << " calls " << kind.lone.count << ", the others " << kind.others.count);
        const BufferRef& mine = c->rank() == lone ? kind.lone : kind.others;
        std::string message;
        const int st =
            status_of([&] { c->allreduce(std::span<const BufferRef>(&mine, 1), DType::F32, ReduceOp::Sum); }, &message);
        for (int s : statuses(st)) CHECK(s == GRADSYNC_E_MISMATCH);
        const int named = lone == 0 ? 1 : lone;
        const size_t named_count = lone == 0 ? kind.others.count : kind.lone.count;
        CHECK(message.find(fmt::format("rank {} called allreduce of {} f32 (sum)", named, named_count)) !=
              std::string::npos);
        CHECK(std::count(out.begin(), out.end(), -1.0f) == static_cast<std::ptrdiff_t>(out.size()));
        CHECK(std::count(big.begin(), big.end(), 1.0f) == static_cast<std::ptrdiff_t>(big.size()));
      }
    }
    const BufferRef b{v.data(), out.data(), 1001};
    c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
    CHECK(std::count(out.begin(), out.begin() + 1001, static_cast<float>(n)) == 1001);
  }
}

TEST_CASE("an abort racing small calls fails the same call on every rank, and reset recovers", "[mpi]") {
  // A watchdog aborts rank 0 at some point of a loop of small allreduces. A rank that has posted a
  // call is committed to it, so every rank fails the same call (whichever it is), and the group
  // recovers with a reset. Repeated, so that the abort lands at different points of the calls.
  auto c = make(false, true, 20000ms);
  for (int trial = 0; trial < 3; ++trial) {
    std::thread watchdog;
    if (c->rank() == 0) {
      watchdog = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + 15 * trial));
        c->abort();
      });
    }
    int64_t failed_at = -1;
    int st = GRADSYNC_OK;
    std::vector<float> x(1);
    for (int64_t i = 0; i < 100000000 && failed_at < 0; ++i) {
      x[0] = 1.0f;
      const BufferRef b{x.data(), x.data(), 1};
      st = status_of([&] { c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum); });
      if (st != GRADSYNC_OK)
        failed_at = i;
      else
        REQUIRE(x[0] == static_cast<float>(c->size()));
    }
    if (watchdog.joinable()) watchdog.join();
    CHECK(st == GRADSYNC_E_ABORTED);
    c->reset();
    int64_t lo = failed_at, hi = failed_at;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    CHECK(lo == hi);
  }
  c->barrier();
}

TEST_CASE("check_mismatch off: matching rounds work", "[mpi]") {
  auto c = make(true, false);
  std::vector<float> v{2.0f * static_cast<float>(c->rank() + 1), 4.0f * static_cast<float>(c->rank() + 1)};
  const BufferRef b{v.data(), v.data(), 2};
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Mean);
  const float m = static_cast<float>(c->size() + 1) / 2.0f;
  CHECK(v == std::vector<float>{2 * m, 4 * m});
  c->barrier();
}

TEST_CASE("weighted mean sums the products in rank order on every rank", "[mpi]") {
  auto c = make(false);  // forced to rank order even when the communicator is not deterministic
  std::vector<float> g(5, static_cast<float>(c->rank() + 1)), out(5);
  uint64_t total = 0;
  c->weighted_mean(g.data(), out.data(), 5, DType::F32, static_cast<uint64_t>(c->rank() + 1), &total);
  // Σ (r+1)² / Σ (r+1)
  double num = 0, den = 0;
  for (int r = 1; r <= c->size(); ++r) num += double(r) * r, den += r;
  CHECK(total == static_cast<uint64_t>(den));
  CHECK(out[0] == static_cast<float>(num / den));
  std::vector<float> zero(5);
  CHECK(status_of([&] { c->weighted_mean(g.data(), zero.data(), 5, DType::F32, 0, nullptr); }) ==
        GRADSYNC_E_ZERO_WEIGHT);
}

TEST_CASE("abort from another thread unblocks the waiting rank, reaches every rank, and reset recovers", "[mpi]") {
  auto c = make(true, true, 20000ms);
  int level = 0;
  MPI_Query_thread(&level);
  REQUIRE(level == MPI_THREAD_MULTIPLE);  // the watchdog below calls MPI beside a waiting thread
  std::string message;
  int st;
  if (c->rank() == 0) {
    // Rank 0 waits in a barrier the others have not reached yet; a watchdog thread aborts, then
    // lets the others in (however late the load makes it, the barrier cannot complete first).
    std::thread watchdog([&] {
      std::this_thread::sleep_for(100ms);
      c->abort();
      for (int r = 1; r < c->size(); ++r) MPI_Send(nullptr, 0, MPI_BYTE, r, 0, MPI_COMM_WORLD);
    });
    st = status_of([&] { c->barrier(); }, &message);
    watchdog.join();
    CHECK(message.find("gradsync_comm_abort") != std::string::npos);
  } else {
    MPI_Recv(nullptr, 0, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    st = status_of([&] { c->barrier(); }, &message);
    CHECK(message.find("rank 0 aborted the group") != std::string::npos);
  }
  CHECK(st == GRADSYNC_E_ABORTED);
  // Still aborted until reset.
  CHECK(status_of([&] { c->barrier(); }) == GRADSYNC_E_ABORTED);
  c->reset();
  std::vector<int32_t> v{c->rank()};
  const BufferRef b{v.data(), v.data(), 1};
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::I32, ReduceOp::Sum);
  CHECK(v[0] == c->size() * (c->size() - 1) / 2);
}

// comm.h: a reset that times out (a rank did not call it in time) is called again on every rank.
// The first one's duplications stay posted on the ranks that gave up, and the late rank's match
// them: the second reset must pair every rank's duplications alike, not one step apart.
TEST_CASE("a reset that timed out on the ranks before a late one completes when every rank calls it again", "[mpi]") {
  auto c = make(true, true, 400ms);
  const int last = c->size() - 1;
  c->abort();
  CHECK(status_of([&] { c->barrier(); }) == GRADSYNC_E_ABORTED);
  MPI_Barrier(MPI_COMM_WORLD);
  if (c->rank() == last) std::this_thread::sleep_for(1200ms);
  std::string message;
  const int first = status_of([&] { c->reset(); }, &message);
  if (c->rank() != last) CHECK(first == GRADSYNC_E_TIMEOUT);
  INFO("the first reset: " << message);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int again = 1; again <= 3; ++again) {
    const int st = status_of([&] { c->reset(); }, &message);
    int worst = st;
    MPI_Allreduce(&st, &worst, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);  // statuses are negative
    INFO("reset " << again << " after the timed-out one: " << message);
    CHECK(worst == GRADSYNC_OK);
    CHECK(again == 1);
    if (worst == GRADSYNC_OK) break;
  }
  std::vector<int32_t> v{c->rank()};
  const BufferRef b{v.data(), v.data(), 1};
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::I32, ReduceOp::Sum);
  CHECK(v[0] == c->size() * (c->size() - 1) / 2);
}

// The same for forming a group: a create that timed out (a rank came late) is called again on
// every rank, and forms the group, whatever duplications the failed one left posted on MPI.
TEST_CASE("a create that timed out on the ranks before a late one forms the group when every rank calls it again",
          "[mpi]") {
  make();  // MPI initialised (by the library), the ranks met
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == size - 1) std::this_thread::sleep_for(1200ms);
  std::string message;
  std::unique_ptr<Communicator> c;
  const int first = status_of([&] { c = make(true, true, 400ms); }, &message);
  if (me != size - 1) CHECK(first == GRADSYNC_E_TIMEOUT);
  INFO("the first create: " << message);
  for (int again = 1; again <= 3; ++again) {
    c.reset();
    MPI_Barrier(MPI_COMM_WORLD);
    const int st = status_of([&] { c = make(true, true, 2000ms); }, &message);
    int worst = st;
    MPI_Allreduce(&st, &worst, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    INFO("create " << again << " after the timed-out one: " << message);
    CHECK(worst == GRADSYNC_OK);
    CHECK(again == 1);
    if (worst == GRADSYNC_OK) break;
  }
  REQUIRE(c != nullptr);
  std::vector<int32_t> v{c->rank()};
  const BufferRef b{v.data(), v.data(), 1};
  c->allreduce(std::span<const BufferRef>(&b, 1), DType::I32, ReduceOp::Sum);
  CHECK(v[0] == c->size() * (c->size() - 1) / 2);
}

TEST_CASE("many communicators, created and freed in turn, do not disturb each other", "[mpi]") {
  auto a = make();
  auto b = make(false, false);
  std::vector<int64_t> x{1}, y{10};
  const BufferRef bx{x.data(), x.data(), 1}, by{y.data(), y.data(), 1};
  a->allreduce(std::span<const BufferRef>(&bx, 1), DType::I64, ReduceOp::Sum);
  b->allreduce(std::span<const BufferRef>(&by, 1), DType::I64, ReduceOp::Sum);
  a.reset();
  auto c = make();
  c->allreduce(std::span<const BufferRef>(&by, 1), DType::I64, ReduceOp::Sum);
  CHECK(x[0] == b->size());
  CHECK(y[0] == 10 * static_cast<int64_t>(b->size()) * b->size());
}

TEST_CASE("a wait that lasts is logged at warning level on the ranks that wait", "[mpi]") {
  auto c = make();
  MPI_Barrier(MPI_COMM_WORLD);  // the ranks that wait start their clocks together with the sleeper
  LogLines lines(GRADSYNC_LOG_WARN);
  const int last = c->size() - 1;
  if (c->rank() == last) std::this_thread::sleep_for(std::chrono::milliseconds(6500));  // past the first report
  c->barrier();
  if (c->rank() != last) CHECK(lines.contains("waiting 5 s for the other ranks"));
}
