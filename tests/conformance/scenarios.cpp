// SPDX-License-Identifier: Apache-2.0
// The conformance suite's scenarios, each a check of comm.h's transport-neutral semantics over
// the public C API, and their registry (harness.hpp; run by conformance.cpp).
#include "harness.hpp"

namespace conformance {
namespace {

// ---------------------------------------------------------------- allreduce

// Every op at the sizes that take every path: empty, one element, fewer than the ranks, a few KiB
// (in place where every rank's buffers are reachable, else inline), the inline limit (16 KiB) and
// just over it, and the copy pipeline (256 KiB chunks) with a ragged end; on ordinary and on the
// communicator's memory, and on both at once (some ranks on each), in place and not. Bit for bit
// the reference, the same on every rank, the send buffer untouched.
template <class E>
void s_allreduce(Ctx& x) {
  using T = typename E::T;
  const size_t inline_elems = 16384 / sizeof(T);
  uint64_t seed = 1000 * static_cast<uint64_t>(E::dtype);
  for (const size_t count :
       {size_t{0}, size_t{1}, few(x), size_t{7}, size_t{1000}, inline_elems, inline_elems + 3, size_t{300007}}) {
    ++seed;
    uint64_t hash = kFnvBasis;
    for (int32_t op : kOps) {
      // Inputs change from op to op, and the mixed paths come first: no call passes on what an
      // earlier call with the same inputs left in the group's areas.
      const uint64_t op_seed = seed * 8 + static_cast<uint64_t>(op);
      const auto mine = inputs<E>(x.rank, count, op_seed);
      const bool check = checker(x, op_seed);
      std::vector<T> want;
      if (check) {
        std::vector<T> col(static_cast<size_t>(x.size));
        want.resize(count);
        for (size_t i = 0; i < count; ++i) {
          for (int r = 0; r < x.size; ++r) col[static_cast<size_t>(r)] = input<E>(r, i, op_seed);
          if constexpr (std::is_floating_point_v<T>) {
            const Levels levels = by_levels<E>(count * sizeof(T));
            want[i] =
                levels != kFlat ? fold_levels<E>(levels, op, x.size, col.data()) : fold<E>(op, x.size, col.data());
          } else {
            want[i] = fold<E>(op, x.size, col.data());
          }
        }
      }
      for (const int path : {4, 5, 0, 1, 2, 3}) {
        const bool mixed = path >= 4;  // even ranks on one memory, odd ranks on the other
        const bool from_comm = mixed ? (x.rank + path) % 2 == 0 : path >= 2, in_place = path % 2 == 1;
        Buf<T> send(x, x.c, count, from_comm), recv(x, x.c, count, from_comm);
        send.fill(mine);
        T* out = in_place ? send.data() : recv.data();
        if (!EXPECT_OK(x, gradsync_comm_allreduce(x.c, send.data(), out, count, E::dtype, op))) continue;
        const std::string what = format("allreduce %s %s of %zu (%s%s, %s)", E::name, op_name(op), count,
                                        from_comm ? "comm memory" : "ordinary memory", mixed ? ", ranks mixed" : "",
                                        in_place ? "in place" : "send != recv");
        if (check) EXPECT_BITS(E, x, want.data(), out, count, "%s", what.c_str());
        if (!in_place) EXPECT_BITS(E, x, mine.data(), send.data(), count, "%s: the send buffer", what.c_str());
        hash = fnv(out, count * sizeof(T), hash);
      }
    }
    agree(x, x.c, hash, format("allreduce %s of %zu", E::name, count));
  }
}

// The order in which ranks arrive changes nothing: ranks come in one order, then in the opposite
// one (and in place), and both times the result is the rank-order reference (1M floats: many
// chunks), the same on every rank.
void s_arrival_order(Ctx& x) {
  const size_t count = size_t{1} << 20;
  const uint64_t seed = 77;
  const auto mine = inputs<F32>(x.rank, count, seed);
  const bool check = checker(x, seed);
  std::vector<float> sum(count), mean(count), col(static_cast<size_t>(x.size));
  for (size_t i = 0; check && i < count; ++i) {
    for (int r = 0; r < x.size; ++r) col[static_cast<size_t>(r)] = input<F32>(r, i, seed);
    const Levels levels = by_levels<F32>(count * sizeof(float));
    sum[i] = levels != kFlat ? fold_levels<F32>(levels, GRADSYNC_SUM, x.size, col.data())
                             : fold<F32>(GRADSYNC_SUM, x.size, col.data());
    mean[i] = levels != kFlat ? fold_levels<F32>(levels, GRADSYNC_MEAN, x.size, col.data())
                              : fold<F32>(GRADSYNC_MEAN, x.size, col.data());
  }
  for (int32_t op : {GRADSYNC_SUM, GRADSYNC_MEAN}) {
    const auto& want = op == GRADSYNC_SUM ? sum : mean;
    for (int run = 0; run < 2; ++run) {
      std::vector<float> out = run == 1 ? mine : std::vector<float>(count);  // the second run in place
      sleep_ms(5 * (run == 0 ? x.rank : x.size - 1 - x.rank));
      const float* send = run == 1 ? out.data() : mine.data();
      if (!EXPECT_OK(x, gradsync_comm_allreduce(x.c, send, out.data(), count, GRADSYNC_F32, op))) continue;
      if (check) {
        EXPECT_BITS(F32, x, want.data(), out.data(), count, "allreduce %s of %zu, arrival order %d", op_name(op), count,
                    run);
      }
      agree(x, x.c, fnv(out.data(), count * sizeof(float)), format("allreduce %s, arrival order %d", op_name(op), run));
    }
  }
}

// One fused call gives what one call per buffer gives (the reference), with empty buffers, buffers
// of every size, sends given or in place, one send equal to its recv, the communicator's memory;
// and (on MPI) enough buffers to straddle several 256 KiB staging fills.
template <class E>
void many_case(Ctx& x, const std::vector<size_t>& counts, int32_t op, int mode, uint64_t seed) {
  using T = typename E::T;
  const bool from_comm = mode == 2, sends_given = mode == 1;
  std::vector<std::unique_ptr<Buf<T>>> sends, recvs;
  std::vector<const void*> send_ptrs;
  std::vector<void*> recv_ptrs;
  std::vector<size_t> offsets;
  size_t offset = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const auto mine = inputs<E>(x.rank, counts[k], seed, offset);
    recvs.emplace_back(new Buf<T>(x, x.c, counts[k], from_comm));
    recv_ptrs.push_back(recvs.back()->data());
    if (sends_given && k != 1) {
      sends.emplace_back(new Buf<T>(x, x.c, counts[k], from_comm));
      sends.back()->fill(mine);
      send_ptrs.push_back(sends.back()->data());
    } else {
      sends.emplace_back(nullptr);
      recvs.back()->fill(mine);
      send_ptrs.push_back(recvs.back()->data());
    }
    offsets.push_back(offset);
    offset += counts[k];
  }
  const std::string what =
      format("allreduce_many %s %s of %zu buffers (mode %d)", E::name, op_name(op), counts.size(), mode);
  if (!expect_status(x, __LINE__, what.c_str(),
                     gradsync_comm_allreduce_many(x.c, sends_given ? send_ptrs.data() : nullptr, recv_ptrs.data(),
                                                  counts.data(), counts.size(), E::dtype, op),
                     GRADSYNC_OK, {})) {
    return;
  }
  uint64_t hash = kFnvBasis;
  for (size_t k = 0; k < counts.size(); ++k) {
    if (checker(x, seed)) {
      const auto want =
          reference<E>(op, x.size, counts[k], seed, offsets[k], by_levels<E>(offset * sizeof(typename E::T)));
      EXPECT_BITS(E, x, want.data(), recvs[k]->data(), counts[k], "%s: buffer %zu (%zu elements)", what.c_str(), k,
                  counts[k]);
    }
    if (sends[k] != nullptr) {
      const auto mine = inputs<E>(x.rank, counts[k], seed, offsets[k]);
      EXPECT_BITS(E, x, mine.data(), sends[k]->data(), counts[k], "%s: send buffer %zu", what.c_str(), k);
    }
    hash = fnv(recvs[k]->data(), counts[k] * sizeof(T), hash);
  }
  agree(x, x.c, hash, what);
}

void s_allreduce_many(Ctx& x) {
  const std::vector<size_t> a{3, 0, 5, 2}, b{1000, 3, 70000, 1}, c{1, 1}, d{3, 0, 7000, 1, 100003, 17};
  std::vector<size_t> staging;  // 100 buffers of 300-6300 elements, some empty, one of 2^17
  for (size_t i = 0; i < 100; ++i) staging.push_back(i % 37 == 5 ? 0 : 300 + (i * 7919) % 6000);
  staging.insert(staging.begin() + 50, size_t{1} << 17);
  staging.push_back(3);
  uint64_t seed = 500;
  for (int mode = 0; mode < 2; ++mode) {
    for (const auto* counts : {&a, &b, &c}) many_case<F32>(x, *counts, GRADSYNC_MEAN, mode, ++seed);
    many_case<F32>(x, staging, GRADSYNC_SUM, mode, ++seed);
  }
  for (int mode = 0; mode < 3; ++mode) {
    many_case<F32>(x, d, GRADSYNC_SUM, mode, ++seed);
    many_case<F64>(x, d, GRADSYNC_MAX, mode, ++seed);
    many_case<I32>(x, d, GRADSYNC_SUM, mode, ++seed);
    many_case<I64>(x, d, GRADSYNC_MEAN, mode, ++seed);
    many_case<BF16>(x, d, GRADSYNC_SUM, mode, ++seed);
    many_case<F16>(x, d, GRADSYNC_MIN, mode, ++seed);
  }
}

// ---------------------------------------------------------------- allreduce over mixed dtypes

// One buffer of a mixed call: its bytes, as this rank's inputs of its dtype.
struct MixedPiece {
  int32_t dtype;
  size_t count;
  std::vector<unsigned char> bytes;
};

template <class E>
MixedPiece mixed_piece(const Ctx& x, size_t count, uint64_t seed) {
  const auto mine = inputs<E>(x.rank, count, seed);
  MixedPiece p{E::dtype, count, {}};
  p.bytes.resize(count * sizeof(typename E::T));
  if (count > 0) std::memcpy(p.bytes.data(), mine.data(), p.bytes.size());
  return p;
}

std::vector<MixedPiece> mixed_pieces(const Ctx& x, uint64_t seed) {
  // Every dtype, interleaved, some twice, one empty, one large enough for the staged path.
  return {mixed_piece<F32>(x, 5, seed),          mixed_piece<I64>(x, 1000, seed + 1),
          mixed_piece<BF16>(x, 70001, seed + 2), mixed_piece<F64>(x, 0, seed + 3),
          mixed_piece<F32>(x, 3, seed + 4),      mixed_piece<I32>(x, 17, seed + 5),
          mixed_piece<F16>(x, 300, seed + 6),    mixed_piece<F64>(x, 9, seed + 7)};
}

// gradsync_comm_allreduce_mixed: the same bits as one gradsync_comm_allreduce per buffer; ranks
// whose lists differ all get E_MISMATCH and keep their buffers.
void s_allreduce_mixed(Ctx& x) {
  uint64_t seed = 900;
  for (int32_t op : {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MAX}) {
    std::vector<MixedPiece> fused = mixed_pieces(x, seed += 10), single = fused;
    std::vector<void*> recvs;
    std::vector<size_t> counts;
    std::vector<int32_t> dtypes;
    for (MixedPiece& p : fused) {
      recvs.push_back(p.bytes.data());
      counts.push_back(p.count);
      dtypes.push_back(p.dtype);
    }
    const std::string what = format("allreduce_mixed %s of %zu buffers", op_name(op), fused.size());
    if (!EXPECT_OK(x, gradsync_comm_allreduce_mixed(x.c, nullptr, recvs.data(), counts.data(), dtypes.data(),
                                                    recvs.size(), op))) {
      return;
    }
    uint64_t hash = kFnvBasis;
    for (size_t k = 0; k < single.size(); ++k) {
      MixedPiece& p = single[k];
      if (!EXPECT_OK(x, gradsync_comm_allreduce(x.c, p.bytes.data(), p.bytes.data(), p.count, p.dtype, op))) return;
      if (p.bytes != fused[k].bytes)
        x.fail_at(__LINE__, "%s: buffer %zu differs from its own allreduce", what.c_str(), k);
      hash = fnv(p.bytes.data(), p.bytes.size(), hash);
    }
    agree(x, x.c, hash, what);
  }
  if (x.size < 2) return;
  // The last rank says i32 where the others say f32 (same size): nobody's buffers change.
  std::vector<MixedPiece> pieces = mixed_pieces(x, seed += 10);
  const std::vector<MixedPiece> before = pieces;
  std::vector<void*> recvs;
  std::vector<size_t> counts;
  std::vector<int32_t> dtypes;
  for (MixedPiece& p : pieces) {
    recvs.push_back(p.bytes.data());
    counts.push_back(p.count);
    dtypes.push_back(p.dtype);
  }
  if (x.rank == x.size - 1) dtypes[4] = GRADSYNC_I32;
  EXPECT_STATUS(x,
                gradsync_comm_allreduce_mixed(x.c, nullptr, recvs.data(), counts.data(), dtypes.data(), recvs.size(),
                                              GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "different lists of buffers", "no buffer was changed");
  for (size_t k = 0; k < pieces.size(); ++k)
    if (pieces[k].bytes != before[k].bytes) x.fail_at(__LINE__, "allreduce_mixed mismatch changed buffer %zu", k);
  next_call_works(x, x.c, __LINE__);
}

// ---------------------------------------------------------------- weighted mean

// What a rank of weight 0 holds: nothing it holds may show in the result.
template <class T>
T poison(size_t i) {
  const T vals[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                    -std::numeric_limits<T>::infinity(), std::numeric_limits<T>::signaling_NaN(),
                    std::numeric_limits<T>::max()};
  return vals[i % 5];
}

// comm.h: sum over ranks of w * x in double, in rank order, divided once by the total weight and
// rounded once; a rank of weight 0 contributes nothing (+0), even NaN or inf. Weights are uneven
// (3r + 1); zero_rank (if any) has weight 0 and holds poison.
template <class E>
void weighted_case(Ctx& x, size_t count, int zero_rank, int path, uint64_t seed) {
  using T = typename E::T;
  auto weight = [&](int r) { return r == zero_rank ? uint64_t{0} : static_cast<uint64_t>(3 * r + 1); };
  auto value = [&](int r, size_t i) { return r == zero_rank ? poison<T>(i) : input<E>(r, i, seed); };
  std::vector<T> mine(count), want(count);
  for (size_t i = 0; i < count; ++i) mine[i] = value(x.rank, i);
  uint64_t total = 0;
  for (int r = 0; r < x.size; ++r) total += weight(r);
  const bool check = checker(x, seed);
  if (x.size == 1) {
    want = mine;  // a group of one leaves the bits as they are
  } else if (check) {
    for (size_t i = 0; i < count; ++i) {
      double acc = 0;
      for (int r = 0; r < x.size; ++r) {
        const double c = weight(r) == 0 ? +0.0 : static_cast<double>(weight(r)) * static_cast<double>(value(r, i));
        acc = r == 0 ? c : acc + c;
      }
      want[i] = static_cast<T>(acc / static_cast<double>(total));
    }
  }
  const bool from_comm = path >= 2, in_place = path % 2 == 1;
  Buf<T> send(x, x.c, count, from_comm), recv(x, x.c, count, from_comm);
  send.fill(mine);
  T* out = in_place ? send.data() : recv.data();
  uint64_t got_total = 7;
  const std::string what =
      format("weighted_mean %s of %zu, weight-0 rank %d, path %d", E::name, count, zero_rank, path);
  if (!expect_status(x, __LINE__, what.c_str(),
                     gradsync_comm_weighted_mean(x.c, send.data(), out, count, E::dtype, weight(x.rank), &got_total),
                     GRADSYNC_OK, {})) {
    return;
  }
  CHECK(x, got_total == total, "%s: total weight %" PRIu64 ", expected %" PRIu64, what.c_str(), got_total, total);
  if (check) EXPECT_BITS(E, x, want.data(), out, count, "%s", what.c_str());
  if (!in_place) EXPECT_BITS(E, x, mine.data(), send.data(), count, "%s: the send buffer", what.c_str());
  agree(x, x.c, fnv(out, count * sizeof(T)), what);
}

void s_weighted_mean(Ctx& x) {
  uint64_t seed = 900;
  std::vector<int> zero_ranks{-1};
  if (x.size > 1) zero_ranks = {-1, x.size - 1, 0};
  // 2100003: past a window of the weighted mean's staging on every transport (2^19 elements on
  // shared memory, 2^21 - 1 on MPI), so that windows meet mid-buffer; the weightless ranks have
  // been covered by then, and this size is most of the suite's time.
  for (const size_t count : {size_t{1}, size_t{10}, size_t{4099}, size_t{100003}, size_t{2100003}}) {
    for (int zero_rank : zero_ranks) {
      if (count > 1000000 && zero_rank != -1) continue;
      for (int path = 0; path < 4; ++path) {
        if (count > 5000 && (path == 1 || path == 2)) continue;  // the large ones: two paths suffice
        weighted_case<F32>(x, count, zero_rank, path, ++seed);
        weighted_case<F64>(x, count, zero_rank, path, ++seed);
      }
    }
  }
}

// A total weight of 0 fails every rank (E_ZERO_WEIGHT), recv untouched, the total reported as 0.
template <class E>
void zero_total_case(Ctx& x, size_t count, bool from_comm) {
  using T = typename E::T;
  Buf<T> send(x, x.c, count, from_comm), recv(x, x.c, count, from_comm);
  send.fill(inputs<E>(x.rank, count, 3));
  std::vector<T> before(count);
  std::memcpy(before.data(), recv.data(), count * sizeof(T));
  uint64_t total = 7;
  EXPECT_STATUS(x, gradsync_comm_weighted_mean(x.c, send.data(), recv.data(), count, E::dtype, 0, &total),
                GRADSYNC_E_ZERO_WEIGHT, "total weight");
  CHECK(x, total == 0, "weighted_mean %s of %zu: total weight %" PRIu64 " reported on E_ZERO_WEIGHT", E::name, count,
        total);
  EXPECT_BITS(E, x, before.data(), recv.data(), count, "weighted_mean %s of %zu with no weight: recv", E::name, count);
}

void s_weighted_zero_total(Ctx& x) {
  for (bool from_comm : {false, true}) {
    for (const size_t count : {size_t{6}, size_t{50000}}) {
      zero_total_case<F32>(x, count, from_comm);
      zero_total_case<F64>(x, count, from_comm);
      NEXT_CALL_WORKS(x, x.c);
    }
  }
}

// ---------------------------------------------------------------- data movement

// Root's buffer, bit for bit (signalling NaNs and all), on every rank, from every root.
template <class E>
void broadcast_case(Ctx& x, size_t count, bool from_comm, uint64_t seed) {
  using T = typename E::T;
  std::vector<T> root_data(count);
  for (int root = 0; root < x.size; ++root) {
    for (size_t i = 0; i < count; ++i) root_data[i] = moved<E>(root, i, seed);
    Buf<T> buf(x, x.c, count, from_comm);
    if (x.rank == root) buf.fill(root_data);
    if (!EXPECT_OK(x, gradsync_comm_broadcast(x.c, buf.data(), count, E::dtype, root))) continue;
    EXPECT_BITS(E, x, root_data.data(), buf.data(), count, "broadcast %s of %zu from root %d%s", E::name, count, root,
                from_comm ? " (comm memory)" : "");
  }
}

void s_broadcast(Ctx& x) {
  uint64_t seed = 1200;
  for (const size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}, size_t{300007}}) {
    broadcast_case<F32>(x, count, false, ++seed);
  }
  for (const size_t count : {size_t{3}, size_t{70001}}) {
    broadcast_case<F64>(x, count, true, ++seed);
    broadcast_case<F64>(x, count, false, ++seed);
  }
  broadcast_case<I32>(x, 5, false, ++seed);
  broadcast_case<I64>(x, 1001, true, ++seed);
  broadcast_case<BF16>(x, 8195, false, ++seed);
  broadcast_case<F16>(x, 9, true, ++seed);
}

// Sizes for the partition collectives: empty, one element, fewer than the ranks, not divisible,
// over the inline limit, and large.
std::vector<size_t> partition_sizes(const Ctx& x) {
  return {0, 1, few(x), static_cast<size_t>(3 * x.size + 1), 1001, 70001};
}

// Every rank's part (by the partition rule) at its offset. Modes: 0 send given, 1 in place
// (send NULL, the part already at its offset in recv), 2 and 3 the same on the comm's memory.
template <class E>
void allgather_case(Ctx& x, size_t total, int mode, uint64_t seed) {
  using T = typename E::T;
  const bool from_comm = mode >= 2, in_place = mode % 2 == 1;
  const Part mine = part_of(total, x.size, x.rank);
  std::vector<T> want(total);
  for (size_t i = 0; i < total; ++i) {
    int owner = 0;
    while (part_of(total, x.size, owner).start + part_of(total, x.size, owner).len <= i) ++owner;
    want[i] = moved<E>(owner, i, seed);
  }
  Buf<T> send(x, x.c, mine.len, from_comm), recv(x, x.c, total, from_comm);
  T* part = in_place ? recv.data() + mine.start : send.data();
  for (size_t k = 0; k < mine.len; ++k) part[k] = moved<E>(x.rank, mine.start + k, seed);
  if (!EXPECT_OK(x, gradsync_comm_allgather(x.c, in_place ? nullptr : send.data(), recv.data(), total, E::dtype)))
    return;
  EXPECT_BITS(E, x, want.data(), recv.data(), total, "allgather %s of %zu (mode %d)", E::name, total, mode);
}

void s_allgather(Ctx& x) {
  uint64_t seed = 1300;
  for (const size_t total : partition_sizes(x)) {
    for (int mode = 0; mode < 4; ++mode) {
      allgather_case<F32>(x, total, mode, ++seed);
      allgather_case<F64>(x, total, mode, ++seed);
      allgather_case<I64>(x, total, mode, ++seed);
      allgather_case<BF16>(x, total, mode, ++seed);
    }
  }
  for (int mode = 0; mode < 4; ++mode) allgather_case<F32>(x, 300007, mode, ++seed);  // pipeline chunks
}

// Uneven parts: rank r gives counts[r] elements (some 0), at the sum of the counts before it.
// Modes as allgather_case.
template <class E>
void allgatherv_case(Ctx& x, const std::vector<size_t>& counts, int mode, uint64_t seed) {
  using T = typename E::T;
  const bool from_comm = mode >= 2, in_place = mode % 2 == 1;
  size_t total = 0, start = 0;
  for (int r = 0; r < x.size; ++r) {
    if (r == x.rank) start = total;
    total += counts[static_cast<size_t>(r)];
  }
  const size_t len = counts[static_cast<size_t>(x.rank)];
  std::vector<T> want(total);
  for (size_t i = 0, r = 0, at = 0; i < total; ++i) {
    while (i >= at + counts[r]) at += counts[r++];
    want[i] = moved<E>(static_cast<int>(r), i, seed);
  }
  Buf<T> send(x, x.c, len, from_comm), recv(x, x.c, total, from_comm);
  T* part = in_place ? recv.data() + start : send.data();
  for (size_t k = 0; k < len; ++k) part[k] = moved<E>(x.rank, start + k, seed);
  if (!EXPECT_OK(
          x, gradsync_comm_allgatherv(x.c, in_place ? nullptr : send.data(), recv.data(), counts.data(), E::dtype))) {
    return;
  }
  EXPECT_BITS(E, x, want.data(), recv.data(), total, "allgatherv %s of %zu (mode %d)", E::name, total, mode);
}

void s_allgatherv(Ctx& x) {
  uint64_t seed = 1700;
  const auto n = static_cast<size_t>(x.size);
  std::vector<std::vector<size_t>> shapes;
  for (size_t scale : {size_t{1}, size_t{97}, size_t{40009}}) {  // inline, staged, several pipeline chunks
    std::vector<size_t> c(n);
    for (size_t r = 0; r < n; ++r) c[r] = r % 3 == 1 ? 0 : scale * (r + 1);  // every third rank gives nothing
    shapes.push_back(c);
  }
  shapes.push_back(std::vector<size_t>(n, 0));
  for (const auto& counts : shapes) {
    for (int mode = 0; mode < 4; ++mode) {
      allgatherv_case<F32>(x, counts, mode, ++seed);
      allgatherv_case<I64>(x, counts, mode, ++seed);
      allgatherv_case<BF16>(x, counts, mode, ++seed);
    }
  }
  // The partition rule's counts make it the plain allgather: the two calls match.
  if (x.rank == 0) {
    std::vector<size_t> rule(n);
    for (size_t r = 0; r < n; ++r) rule[r] = part_of(1001, x.size, static_cast<int>(r)).len;
    std::vector<float> recv(1001);
    EXPECT_OK(x, gradsync_comm_allgatherv(x.c, nullptr, recv.data(), rule.data(), GRADSYNC_F32));
  } else {
    std::vector<float> recv(1001);
    EXPECT_OK(x, gradsync_comm_allgather(x.c, nullptr, recv.data(), 1001, GRADSYNC_F32));
  }
  if (x.size < 2) return;
  // Counts that differ on one rank: every rank fails alike, and the next call works.
  std::vector<size_t> counts(n, 4);
  if (x.rank == x.size - 1) counts[0] = 5;
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<float> part(counts[static_cast<size_t>(x.rank)], 1.0f), recv(total);
  EXPECT_STATUS(x, gradsync_comm_allgatherv(x.c, part.data(), recv.data(), counts.data(), GRADSYNC_F32),
                GRADSYNC_E_MISMATCH, "allgather");
  next_call_works(x, x.c, __LINE__);
}

// Uneven parts of a reduction: rank r receives the counts[r] elements after the counts before it,
// reduced in rank order (the reference), recv apart (mode 0) or inside send at its offset (mode 1).
// The part is also the slice of the allreduce of the same buffers, bit for bit, whatever order the
// transport reduces in (on the hierarchical transport, that of its levels).
template <class E>
void reduce_scatterv_case(Ctx& x, const std::vector<size_t>& counts, int32_t op, int mode, uint64_t seed) {
  using T = typename E::T;
  size_t total = 0, start = 0;
  for (int r = 0; r < x.size; ++r) {
    if (r == x.rank) start = total;
    total += counts[static_cast<size_t>(r)];
  }
  const size_t len = counts[static_cast<size_t>(x.rank)];
  std::vector<T> send = inputs<E>(x.rank, total, seed), apart(len), all(total);
  if (!EXPECT_OK(x, gradsync_comm_allreduce(x.c, send.data(), all.data(), total, E::dtype, op))) return;
  T* out = mode == 1 ? send.data() + start : apart.data();
  if (!EXPECT_OK(x, gradsync_comm_reduce_scatterv(x.c, send.data(), out, counts.data(), E::dtype, op))) return;
  const auto want = reference<E>(op, x.size, len, seed, start, by_levels<E>(total * sizeof(T)));
  EXPECT_BITS(E, x, want.data(), out, len, "reduce_scatterv %s %s of %zu (mode %d)", E::name, op_name(op), total, mode);
  EXPECT_BITS(E, x, all.data() + start, out, len,
              "reduce_scatterv %s %s of %zu (mode %d) against the allreduce's slice", E::name, op_name(op), total,
              mode);
}

void s_reduce_scatterv(Ctx& x) {
  uint64_t seed = 1900;
  const auto n = static_cast<size_t>(x.size);
  for (size_t scale : {size_t{1}, size_t{97}, size_t{40009}}) {
    std::vector<size_t> c(n);
    for (size_t r = 0; r < n; ++r) c[r] = r % 3 == 1 ? 0 : scale * (r + 1);
    for (int mode = 0; mode < 2; ++mode) {
      reduce_scatterv_case<F32>(x, c, GRADSYNC_SUM, mode, ++seed);
      reduce_scatterv_case<I64>(x, c, GRADSYNC_MEAN, mode, ++seed);
      reduce_scatterv_case<BF16>(x, c, GRADSYNC_MAX, mode, ++seed);
    }
  }
  if (x.size < 2) return;
  std::vector<size_t> counts(n, 4);
  if (x.rank == x.size - 1) counts[0] = 5;
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<float> send(total, 1.0f), recv(counts[static_cast<size_t>(x.rank)]);
  EXPECT_STATUS(x,
                gradsync_comm_reduce_scatterv(x.c, send.data(), recv.data(), counts.data(), GRADSYNC_F32, GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "reduce_scatter");
  next_call_works(x, x.c, __LINE__);
}

// This rank's part of the reduction. Modes: 0 recv apart, 1 recv inside send at this rank's
// offset, 2 and 3 the same on the comm's memory.
template <class E>
void reduce_scatter_case(Ctx& x, size_t total, int32_t op, int mode, uint64_t seed) {
  using T = typename E::T;
  const bool from_comm = mode >= 2, in_place = mode % 2 == 1;
  const Part mine = part_of(total, x.size, x.rank);
  const auto data = inputs<E>(x.rank, total, seed);
  const auto want = reference<E>(op, x.size, mine.len, seed, mine.start, by_levels<E>(total * sizeof(T)));
  Buf<T> send(x, x.c, total, from_comm), recv(x, x.c, mine.len, from_comm);
  send.fill(data);
  T* out = in_place ? send.data() + mine.start : recv.data();
  if (!EXPECT_OK(x, gradsync_comm_reduce_scatter(x.c, send.data(), out, total, E::dtype, op))) return;
  const std::string what = format("reduce_scatter %s %s of %zu (mode %d)", E::name, op_name(op), total, mode);
  EXPECT_BITS(E, x, want.data(), out, mine.len, "%s", what.c_str());
  if (!in_place) EXPECT_BITS(E, x, data.data(), send.data(), total, "%s: the send buffer", what.c_str());
}

void s_reduce_scatter(Ctx& x) {
  uint64_t seed = 1400;
  for (const size_t total : partition_sizes(x)) {
    for (int mode = 0; mode < 4; ++mode) {
      for (int32_t op : kOps) {
        reduce_scatter_case<F32>(x, total, op, mode, ++seed);
        reduce_scatter_case<I32>(x, total, op, mode, ++seed);
      }
      reduce_scatter_case<F64>(x, total, GRADSYNC_SUM, mode, ++seed);
      reduce_scatter_case<I64>(x, total, GRADSYNC_MEAN, mode, ++seed);
      reduce_scatter_case<BF16>(x, total, GRADSYNC_SUM, mode, ++seed);
      reduce_scatter_case<F16>(x, total, GRADSYNC_MAX, mode, ++seed);
    }
  }
  for (int mode = 0; mode < 4; ++mode) {
    for (int32_t op : kOps) reduce_scatter_case<F32>(x, 300007, op, mode, ++seed);  // pipeline chunks
  }
}

// Reduce-scatters around the hierarchical transport's threshold (16 KiB) and well above it, every
// op, the partition rule's counts and uneven ones (some 0), in place and apart: the reference and
// the allreduce's slice.
void s_reduce_scatter_slice(Ctx& x) {
  uint64_t seed = 2100;
  const auto n = static_cast<size_t>(x.size);
  for (const size_t total : {size_t{1001}, size_t{4099}, size_t{70001}, size_t{1} << 20}) {
    std::vector<size_t> rule(n), uneven(n);
    for (size_t r = 0; r < n; ++r) {
      rule[r] = part_of(total, x.size, static_cast<int>(r)).len;
      uneven[r] = r % 3 == 1 ? 0 : total / n * (r + 1) / 2 + r;
    }
    for (int32_t op : kOps) {
      for (int mode = 0; mode < 2; ++mode) {
        reduce_scatterv_case<F32>(x, rule, op, mode, ++seed);
        reduce_scatterv_case<F32>(x, uneven, op, mode, ++seed);
      }
    }
    reduce_scatterv_case<F64>(x, rule, GRADSYNC_SUM, 0, ++seed);
    reduce_scatterv_case<F64>(x, uneven, GRADSYNC_MEAN, 1, ++seed);
    reduce_scatterv_case<I32>(x, uneven, GRADSYNC_SUM, 0, ++seed);
    reduce_scatterv_case<I64>(x, rule, GRADSYNC_MAX, 1, ++seed);
  }
}

// Rank i's part j lands in rank j's block i: recv holds size blocks of this rank's part length.
template <class E>
void alltoall_case(Ctx& x, size_t total, bool from_comm, uint64_t seed) {
  using T = typename E::T;
  const Part mine = part_of(total, x.size, x.rank);
  const size_t n = static_cast<size_t>(x.size);
  Buf<T> send(x, x.c, total, from_comm), recv(x, x.c, mine.len * n, from_comm);
  std::vector<T> data(total), want(mine.len * n);
  for (size_t i = 0; i < total; ++i) data[i] = moved<E>(x.rank, i, seed);
  for (size_t r = 0; r < n; ++r) {
    for (size_t k = 0; k < mine.len; ++k) want[r * mine.len + k] = moved<E>(static_cast<int>(r), mine.start + k, seed);
  }
  send.fill(data);
  if (!EXPECT_OK(x, gradsync_comm_alltoall(x.c, send.data(), recv.data(), total, E::dtype))) return;
  EXPECT_BITS(E, x, want.data(), recv.data(), want.size(), "alltoall %s of %zu%s", E::name, total,
              from_comm ? " (comm memory)" : "");
  EXPECT_BITS(E, x, data.data(), send.data(), total, "alltoall %s of %zu: the send buffer", E::name, total);
}

void s_alltoall(Ctx& x) {
  uint64_t seed = 1500;
  for (const size_t total : partition_sizes(x)) {
    for (bool from_comm : {false, true}) {
      alltoall_case<I64>(x, total, from_comm, ++seed);
      alltoall_case<F32>(x, total, from_comm, ++seed);
      alltoall_case<BF16>(x, total, from_comm, ++seed);
      alltoall_case<F64>(x, total, from_comm, ++seed);
    }
  }
  for (bool from_comm : {false, true}) alltoall_case<F32>(x, 300007, from_comm, ++seed);  // pipeline chunks
}

// Rank s's part for rank d: c(s, d) elements, some 0, element k being moved(s, d * 1000003 + k).
size_t exchange_count(int s, int d, size_t scale) {
  return (s * 7 + d * 3) % 4 == 0 ? 0 : scale * static_cast<size_t>(1 + (s + d) % 3);
}

// Counts and displacements of each rank's own. Send parts lie in reverse rank order with a gap of
// one element before each, so displacements matter; recv parts are packed (displacements NULL,
// modes 0 and 2) or, as send, reversed with gaps (modes 1 and 3); modes 2 and 3 on the comm's memory.
template <class E>
void alltoallv_case(Ctx& x, size_t scale, int mode, uint64_t seed) {
  using T = typename E::T;
  const auto n = static_cast<size_t>(x.size);
  const bool from_comm = mode >= 2, gaps = mode % 2 == 1;
  std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
  size_t send_len = 0, recv_len = 0;
  for (size_t k = n; k-- > 0;) {
    sc[k] = exchange_count(x.rank, static_cast<int>(k), scale);
    sd[k] = send_len + 1;
    send_len += sc[k] + 1;
  }
  if (gaps) {
    for (size_t k = n; k-- > 0;) {
      rc[k] = exchange_count(static_cast<int>(k), x.rank, scale);
      rd[k] = recv_len + 1;
      recv_len += rc[k] + 1;
    }
  } else {
    for (size_t k = 0; k < n; ++k) {
      rc[k] = exchange_count(static_cast<int>(k), x.rank, scale);
      rd[k] = recv_len;
      recv_len += rc[k];
    }
  }
  Buf<T> send(x, x.c, send_len, from_comm), recv(x, x.c, recv_len, from_comm);
  for (size_t d = 0; d < n; ++d)
    for (size_t k = 0; k < sc[d]; ++k) send.data()[sd[d] + k] = moved<E>(x.rank, d * 1000003 + k, seed);
  if (!EXPECT_OK(x, gradsync_comm_alltoallv(x.c, send.data(), sc.data(), sd.data(), recv.data(), rc.data(),
                                            gaps ? rd.data() : nullptr, E::dtype))) {
    return;
  }
  std::vector<T> want(recv_len), got(recv_len);
  for (size_t s = 0; s < n; ++s) {
    for (size_t k = 0; k < rc[s]; ++k) {
      want[rd[s] + k] = moved<E>(static_cast<int>(s), static_cast<size_t>(x.rank) * 1000003 + k, seed);
      got[rd[s] + k] = recv.data()[rd[s] + k];  // the gaps are not the call's
    }
  }
  EXPECT_BITS(E, x, want.data(), got.data(), recv_len, "alltoallv %s, scale %zu (mode %d)", E::name, scale, mode);
}

void s_alltoallv(Ctx& x) {
  uint64_t seed = 2100;
  for (size_t scale : {size_t{1}, size_t{97}, size_t{40009}}) {  // inline, staged, several pipeline chunks
    for (int mode = 0; mode < 4; ++mode) {
      alltoallv_case<F32>(x, scale, mode, ++seed);
      alltoallv_case<I64>(x, scale, mode, ++seed);
      alltoallv_case<BF16>(x, scale, mode, ++seed);
    }
  }
  if (x.size < 2) return;
  // The last rank expects one element more from rank 0 than rank 0 sends: every rank fails alike,
  // naming both, and nothing moves.
  const auto n = static_cast<size_t>(x.size);
  std::vector<size_t> sc(n, 4), rc(n, 4);
  if (x.rank == x.size - 1) rc[0] = 5;
  std::vector<float> send(4 * n, 1.0f), recv(4 * n + 1, 0.0f);
  EXPECT_STATUS(
      x, gradsync_comm_alltoallv(x.c, send.data(), sc.data(), nullptr, recv.data(), rc.data(), nullptr, GRADSYNC_F32),
      GRADSYNC_E_MISMATCH,
      format("rank 0 sends 4 elements to rank %d, but rank %d expects 5 from rank 0", x.size - 1, x.size - 1));
  CHECK(x, recv == std::vector<float>(4 * n + 1, 0.0f), "recv was written on a mismatch");
  next_call_works(x, x.c, __LINE__);
}

// reduce, gather, gatherv, scatter and scatterv to and from every root.
template <class E>
void rooted_case(Ctx& x, int root, size_t count, int32_t op, uint64_t seed) {
  using T = typename E::T;
  const auto n = static_cast<size_t>(x.size);
  const bool at_root = x.rank == root;
  {
    std::vector<T> send = inputs<E>(x.rank, count, seed), out(count);
    const bool in_place = seed % 2 == 0;
    T* recv = at_root ? (in_place ? send.data() : out.data()) : nullptr;
    if (EXPECT_OK(x, gradsync_comm_reduce(x.c, send.data(), recv, count, E::dtype, op, root)) && at_root) {
      const auto want = reference<E>(op, x.size, count, seed);
      EXPECT_BITS(E, x, want.data(), recv, count, "reduce %s %s of %zu to %d", E::name, op_name(op), count, root);
    }
  }
  // gather: rank r's count elements at r * count at the root.
  std::vector<T> part(count), all(at_root ? n * count : 0);
  for (size_t k = 0; k < count; ++k) part[k] = moved<E>(x.rank, k, seed);
  if (EXPECT_OK(x, gradsync_comm_gather(x.c, part.data(), at_root ? all.data() : nullptr, count, E::dtype, root)) &&
      at_root) {
    std::vector<T> want(n * count);
    for (size_t r = 0; r < n; ++r)
      for (size_t k = 0; k < count; ++k) want[r * count + k] = moved<E>(static_cast<int>(r), k, seed);
    EXPECT_BITS(E, x, want.data(), all.data(), want.size(), "gather %s of %zu to %d", E::name, count, root);
  }
  // scatter: rank r receives the root's block r.
  std::vector<T> blocks(at_root ? n * count : 0), mine(count);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = moved<E>(root, i, seed);
  if (EXPECT_OK(x, gradsync_comm_scatter(x.c, at_root ? blocks.data() : nullptr, mine.data(), count, E::dtype, root))) {
    std::vector<T> want(count);
    for (size_t k = 0; k < count; ++k) want[k] = moved<E>(root, static_cast<size_t>(x.rank) * count + k, seed);
    EXPECT_BITS(E, x, want.data(), mine.data(), count, "scatter %s of %zu from %d", E::name, count, root);
  }
  // The v-forms: rank r gives (gets) counts[r] elements, every third rank none.
  std::vector<size_t> counts(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) total += counts[r] = r % 3 == 1 ? 0 : count + r;
  const size_t own = counts[static_cast<size_t>(x.rank)];
  std::vector<T> vpart(own), vall(at_root ? total : 0), want(total);
  for (size_t k = 0; k < own; ++k) vpart[k] = moved<E>(x.rank, k, seed + 1);
  for (size_t r = 0, at = 0; r < n; at += counts[r++])
    for (size_t k = 0; k < counts[r]; ++k) want[at + k] = moved<E>(static_cast<int>(r), k, seed + 1);
  if (EXPECT_OK(x, gradsync_comm_gatherv(x.c, vpart.data(), own, at_root ? vall.data() : nullptr,
                                         at_root ? counts.data() : nullptr, E::dtype, root)) &&
      at_root) {
    EXPECT_BITS(E, x, want.data(), vall.data(), total, "gatherv %s of %zu to %d", E::name, total, root);
  }
  std::vector<T> vmine(own);
  if (EXPECT_OK(x, gradsync_comm_scatterv(x.c, at_root ? want.data() : nullptr, at_root ? counts.data() : nullptr,
                                          vmine.data(), own, E::dtype, root))) {
    EXPECT_BITS(E, x, vpart.data(), vmine.data(), own, "scatterv %s of %zu from %d", E::name, own, root);
  }
}

void s_rooted(Ctx& x) {
  uint64_t seed = 2300;
  for (int root = 0; root < x.size; ++root) {
    for (size_t count : {size_t{0}, size_t{5}, size_t{97}, size_t{40009}}) {
      rooted_case<F32>(x, root, count, GRADSYNC_SUM, ++seed);
      rooted_case<I64>(x, root, count, GRADSYNC_MEAN, ++seed);
      rooted_case<BF16>(x, root, count, GRADSYNC_MAX, ++seed);
      rooted_case<F64>(x, root, count, GRADSYNC_MIN, ++seed);
    }
  }
  // A root out of range on every rank: every rank gets E_OUT_OF_RANGE; nothing moves.
  std::vector<float> v(4, 1.0f), w(4 * static_cast<size_t>(x.size), 0.0f);
  const size_t four = 4;
  std::vector<size_t> fours(static_cast<size_t>(x.size), 4);
  EXPECT_STATUS(x, gradsync_comm_reduce(x.c, v.data(), w.data(), 4, GRADSYNC_F32, GRADSYNC_SUM, x.size),
                GRADSYNC_E_OUT_OF_RANGE, "root");
  EXPECT_STATUS(x, gradsync_comm_gather(x.c, v.data(), w.data(), 4, GRADSYNC_F32, -1), GRADSYNC_E_OUT_OF_RANGE, "root");
  EXPECT_STATUS(x, gradsync_comm_scatterv(x.c, w.data(), fours.data(), v.data(), four, GRADSYNC_F32, x.size + 3),
                GRADSYNC_E_OUT_OF_RANGE, "root");
  CHECK(x, w == std::vector<float>(w.size(), 0.0f), "recv was written for a root out of range");
  next_call_works(x, x.c, __LINE__);
  if (x.size < 2) return;
  // Ranks that disagree on the root, or on a count: every rank fails alike, naming the calls.
  const int other = x.rank == x.size - 1 ? 1 : 0;
  EXPECT_STATUS(
      x, gradsync_comm_reduce(x.c, v.data(), w.data(), 4, GRADSYNC_F32, GRADSYNC_SUM, other), GRADSYNC_E_MISMATCH,
      format("rank %d called reduce of 4 f32 (sum) to root 1 but rank 0 called reduce of 4 f32 (sum) to root 0",
             x.size - 1));
  EXPECT_STATUS(
      x, gradsync_comm_gather(x.c, v.data(), w.data(), 4, GRADSYNC_F32, other), GRADSYNC_E_MISMATCH,
      format("rank %d called gather of 4 f32 to root 1 but rank 0 called gather of 4 f32 to root 0", x.size - 1));
  EXPECT_STATUS(
      x, gradsync_comm_gatherv(x.c, v.data(), 4, w.data(), fours.data(), GRADSYNC_F32, other), GRADSYNC_E_MISMATCH,
      format("rank %d called gatherv of f32 to root 1 but rank 0 called gatherv of f32 to root 0", x.size - 1));
  const size_t expect = x.rank == x.size - 1 ? 3 : 4;
  EXPECT_STATUS(
      x, gradsync_comm_scatterv(x.c, w.data(), fours.data(), v.data(), expect, GRADSYNC_F32, 0), GRADSYNC_E_MISMATCH,
      format("rank 0 sends 4 elements to rank %d, but rank %d expects 3 from rank 0", x.size - 1, x.size - 1));
  CHECK(x, w == std::vector<float>(w.size(), 0.0f) && v == std::vector<float>(4, 1.0f),
        "a buffer was written on a mismatch");
  next_call_works(x, x.c, __LINE__);
}

void s_barrier(Ctx& x) {
  for (int i = 0; i < 50; ++i) EXPECT_OK(x, gradsync_comm_barrier(x.c));
  if (x.size == 1) return;
  // A barrier waits for the last rank, which comes 200 ms late. Threads and processes see it
  // posted before its barrier; under MPI the others time their wait, and a wait cut short by a
  // loaded machine (a rank descheduled before the barrier) is retried, agreed over the group.
  const bool late = x.rank == x.size - 1;
  for (int attempt = 0;; ++attempt) {
    if (late) {
      sleep_ms(200);
      x.post(attempt + 1);
    }
    const auto start = Clock::now();
    EXPECT_OK(x, gradsync_comm_barrier(x.c));
    const int64_t waited = ms_since(start);
    if (x.ledger != nullptr) {
      const bool seen = x.ledger->step[x.size - 1].load() >= (x.index + 1) * 64 + attempt + 1;
      CHECK(x, late || seen, "the barrier returned before the late rank came to it");
      return;
    }
    int32_t ok = late || waited >= 100 ? 1 : 0, all = 0;
    EXPECT_OK(x, gradsync_comm_allreduce(x.c, &ok, &all, 1, GRADSYNC_I32, GRADSYNC_MIN));
    if (all == 1) return;
    if (attempt == 2) {
      CHECK(x, ok == 1, "the barrier returned after %" PRId64 " ms, before the late rank came (3 tries)", waited);
      return;
    }
  }
}

// ---------------------------------------------------------------- a group of one

// comm.h: a group of size 1 returns at once, leaving the buffers bit for bit (recv = send): even
// a mean or a weighted mean keeps a signalling NaN signalling and -0 negative.
template <class E>
void one_case(Ctx& x, bool from_comm) {
  using T = typename E::T;
  const size_t count = 37;
  std::vector<T> data(count);
  for (size_t i = 0; i < count; ++i) data[i] = i < 10 ? special<E>(static_cast<int>(i)) : input<E>(0, i, 11);
  for (int32_t op : kOps) {
    for (bool in_place : {false, true}) {
      Buf<T> send(x, x.c, count, from_comm), recv(x, x.c, count, from_comm);
      send.fill(data);
      T* out = in_place ? send.data() : recv.data();
      if (EXPECT_OK(x, gradsync_comm_allreduce(x.c, send.data(), out, count, E::dtype, op))) {
        EXPECT_BITS(E, x, data.data(), out, count, "allreduce %s %s, in place %d", E::name, op_name(op), in_place);
      }
    }
  }
  Buf<T> a(x, x.c, count, from_comm), b(x, x.c, count, from_comm);
  a.fill(data);
  if (EXPECT_OK(x, gradsync_comm_broadcast(x.c, a.data(), count, E::dtype, 0))) {
    EXPECT_BITS(E, x, data.data(), a.data(), count, "broadcast %s", E::name);
  }
  if (EXPECT_OK(x, gradsync_comm_allgather(x.c, a.data(), b.data(), count, E::dtype))) {
    EXPECT_BITS(E, x, data.data(), b.data(), count, "allgather %s", E::name);
  }
  if (EXPECT_OK(x, gradsync_comm_allgather(x.c, nullptr, b.data(), count, E::dtype))) {
    EXPECT_BITS(E, x, data.data(), b.data(), count, "allgather %s in place", E::name);
  }
  std::memset(static_cast<void*>(b.data()), 0xA5, count * sizeof(T));
  if (EXPECT_OK(x, gradsync_comm_reduce_scatter(x.c, a.data(), b.data(), count, E::dtype, GRADSYNC_MEAN))) {
    EXPECT_BITS(E, x, data.data(), b.data(), count, "reduce_scatter %s", E::name);
  }
  std::memset(static_cast<void*>(b.data()), 0xA5, count * sizeof(T));
  if (EXPECT_OK(x, gradsync_comm_alltoall(x.c, a.data(), b.data(), count, E::dtype))) {
    EXPECT_BITS(E, x, data.data(), b.data(), count, "alltoall %s", E::name);
  }
  void* recvs[2] = {a.data(), b.data()};
  const size_t counts[2] = {count, 5};
  b.fill(data);
  if (EXPECT_OK(x, gradsync_comm_allreduce_many(x.c, nullptr, recvs, counts, 2, E::dtype, GRADSYNC_MEAN))) {
    EXPECT_BITS(E, x, data.data(), a.data(), count, "allreduce_many %s", E::name);
    EXPECT_BITS(E, x, data.data(), b.data(), 5, "allreduce_many %s (second buffer)", E::name);
  }
  if constexpr (std::is_same_v<E, F32> || std::is_same_v<E, F64>) {
    uint64_t total = 0;
    std::memset(static_cast<void*>(b.data()), 0xA5, count * sizeof(T));
    if (EXPECT_OK(x, gradsync_comm_weighted_mean(x.c, a.data(), b.data(), count, E::dtype, 3, &total))) {
      EXPECT_BITS(E, x, data.data(), b.data(), count, "weighted_mean %s", E::name);
      CHECK(x, total == 3, "weighted_mean %s: total weight %" PRIu64, E::name, total);
    }
  }
}

void s_group_of_one(Ctx& x) {
  for (bool from_comm : {false, true}) {
    one_case<F32>(x, from_comm);
    one_case<F64>(x, from_comm);
    one_case<I32>(x, from_comm);
    one_case<I64>(x, from_comm);
    one_case<BF16>(x, from_comm);
    one_case<F16>(x, from_comm);
  }
  EXPECT_OK(x, gradsync_comm_barrier(x.c));
}

// ---------------------------------------------------------------- the communicator's memory

void s_alloc(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  for (const size_t bytes : {size_t{1}, size_t{4097}, size_t{1} << 20}) {
    void* p = nullptr;
    if (!EXPECT_OK(x, gradsync_comm_alloc(g, bytes, &p))) continue;
    CHECK(x, reinterpret_cast<uintptr_t>(p) % 4096 == 0, "gradsync_comm_alloc(%zu) gave %p, not 4096-aligned", bytes,
          p);
    std::memset(p, 0x5A, bytes);
    CHECK(x, static_cast<unsigned char*>(p)[bytes - 1] == 0x5A, "the last byte of %zu did not hold", bytes);
    EXPECT_OK(x, gradsync_comm_free_buffer(g, p));
    EXPECT_STATUS(x, gradsync_comm_free_buffer(g, p), GRADSYNC_E_INVALID_ARG);  // freed already
  }
  void* p = &x;
  EXPECT_STATUS(x, gradsync_comm_alloc(g, 0, &p), GRADSYNC_E_INVALID_ARG);
  CHECK(x, p == nullptr, "ptr left at %p by a failed gradsync_comm_alloc", p);
  EXPECT_STATUS(x, gradsync_comm_alloc(g, 16, nullptr), GRADSYNC_E_INVALID_ARG);
  EXPECT_STATUS(x, gradsync_comm_alloc(nullptr, 16, &p), GRADSYNC_E_MISUSE);
  int local = 0;
  EXPECT_STATUS(x, gradsync_comm_free_buffer(g, &local), GRADSYNC_E_INVALID_ARG);
  EXPECT_OK(x, gradsync_comm_free_buffer(g, nullptr));
  // A buffer still allocated is released by gradsync_comm_free (the scenario's end); a leak
  // checker would see it otherwise.
  void* kept = nullptr;
  EXPECT_OK(x, gradsync_comm_alloc(g, 3000, &kept));
  // A buffer of one communicator is not another's.
  if (kept != nullptr) EXPECT_STATUS(x, gradsync_comm_free_buffer(x.c, kept), GRADSYNC_E_INVALID_ARG);
}

// ---------------------------------------------------------------- disagreements and bad arguments

// Every kind of disagreement: E_MISMATCH on every rank in that same call, naming both sides,
// nothing written (the signatures are compared at arrival, before any data moves), and the next
// call works. The last rank is the odd one out.
struct Variant {
  const char* name;
  std::string expect;  // a piece of the message
  std::function<int(float*, float*)> call;
};

void run_variants(Ctx& x, gradsync_comm* g, const std::vector<Variant>& variants) {
  for (const Variant& variant : variants) {
    std::vector<float> v(100000, 7.0f), w(100000, -3.0f);
    const int st = variant.call(v.data(), w.data());
    expect_status(x, __LINE__, variant.name, st, GRADSYNC_E_MISMATCH, {variant.expect});
    CHECK(x,
          std::all_of(v.begin(), v.end(), [](float f) { return f == 7.0f; }) &&
              std::all_of(w.begin(), w.end(), [](float f) { return f == -3.0f; }),
          "%s: a buffer was written", variant.name);
    NEXT_CALL_WORKS(x, g);
  }
}

void s_mismatch(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  const int o = x.size - 1;
  const bool odd = x.rank == o;
  const std::vector<Variant> variants{
      {"count", format("rank %d called allreduce of 3 f32 (sum) but rank 0 called allreduce of 4 f32 (sum)", o),
       [&](float* v, float*) { return gradsync_comm_allreduce(g, v, v, odd ? 3 : 4, GRADSYNC_F32, GRADSYNC_SUM); }},
      {"count over the inline limit",
       format("rank %d called allreduce of 99999 f32 (sum) but rank 0 called allreduce of 100000 f32 (sum)", o),
       [&](float* v, float*) {
         return gradsync_comm_allreduce(g, v, v, odd ? 99999 : 100000, GRADSYNC_F32, GRADSYNC_SUM);
       }},
      {"dtype", format("rank %d called allreduce of 2 i32 (sum) but rank 0 called allreduce of 2 f32 (sum)", o),
       [&](float* v, float*) {
         return gradsync_comm_allreduce(g, v, v, 2, odd ? GRADSYNC_I32 : GRADSYNC_F32, GRADSYNC_SUM);
       }},
      {"op", format("rank %d called allreduce of 4 f32 (max) but rank 0 called allreduce of 4 f32 (sum)", o),
       [&](float* v, float*) {
         return gradsync_comm_allreduce(g, v, v, 4, GRADSYNC_F32, odd ? GRADSYNC_MAX : GRADSYNC_SUM);
       }},
      {"root",
       format("rank %d called broadcast of 4 f32 from root 1 but rank 0 called broadcast of 4 f32 from root 0", o),
       [&](float* v, float*) { return gradsync_comm_broadcast(g, v, 4, GRADSYNC_F32, odd ? 1 : 0); }},
      {"collective",
       format("rank %d called broadcast of 4 f32 from root 0 but rank 0 called allreduce of 4 f32 (sum)", o),
       [&](float* v, float*) {
         return odd ? gradsync_comm_broadcast(g, v, 4, GRADSYNC_F32, 0)
                    : gradsync_comm_allreduce(g, v, v, 4, GRADSYNC_F32, GRADSYNC_SUM);
       }},
      {"barrier against a collective", format("rank %d called barrier but rank 0 called allreduce of 4 f32 (sum)", o),
       [&](float* v, float*) {
         return odd ? gradsync_comm_barrier(g) : gradsync_comm_allreduce(g, v, v, 4, GRADSYNC_F32, GRADSYNC_SUM);
       }},
      {"number of fused buffers",
       format("rank %d called allreduce of 4 f32 (sum) but rank 0 called allreduce of 2 buffers (4 f32 in all) (sum)",
              o),
       [&](float* v, float*) {
         void* recvs[2] = {v, v + 2};
         const size_t two[2] = {2, 2}, one[1] = {4};
         return gradsync_comm_allreduce_many(g, nullptr, recvs, odd ? one : two, odd ? 1 : 2, GRADSYNC_F32,
                                             GRADSYNC_SUM);
       }},
      {"sizes of fused buffers",
       format("rank %d called allreduce of 2 buffers (10 f32 in all) (sum) with other buffer sizes but rank 0 called "
              "allreduce of 2 buffers (10 f32 in all) (sum)",
              o),
       [&](float* v, float*) {
         void* recvs[2] = {v, v + 5};
         const size_t even[2] = {5, 5}, uneven[2] = {4, 6};
         return gradsync_comm_allreduce_many(g, nullptr, recvs, odd ? uneven : even, 2, GRADSYNC_F32, GRADSYNC_SUM);
       }},
      {"alltoall total", format("rank %d called alltoall of 10 f32 but rank 0 called alltoall of 12 f32", o),
       [&](float* v, float* w) { return gradsync_comm_alltoall(g, v, w, odd ? 10 : 12, GRADSYNC_F32); }},
      {"allgather total", format("rank %d called allgather of 10 f32 but rank 0 called allgather of 12 f32", o),
       [&](float* v, float* w) { return gradsync_comm_allgather(g, v, w, odd ? 10 : 12, GRADSYNC_F32); }},
      {"reduce_scatter op",
       format("rank %d called reduce_scatter of 12 f32 (min) but rank 0 called reduce_scatter of 12 f32 (sum)", o),
       [&](float* v, float* w) {
         return gradsync_comm_reduce_scatter(g, v, w, 12, GRADSYNC_F32, odd ? GRADSYNC_MIN : GRADSYNC_SUM);
       }},
  };
  run_variants(x, g, variants);
}

// The weighted mean is a collective like the others: a disagreement on its dtype, its count, or
// with another collective is E_MISMATCH on every rank, naming both calls.
void s_weighted_mismatch(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  const int o = x.size - 1;
  const bool odd = x.rank == o;
  run_variants(x, g,
               {
                   {"weighted_mean dtype",
                    format("rank %d called weighted_mean of 4 f64 but rank 0 called weighted_mean of 4 f32", o),
                    [&](float* v, float* w) {
                      return gradsync_comm_weighted_mean(g, v, w, 4, odd ? GRADSYNC_F64 : GRADSYNC_F32, 1, nullptr);
                    }},
                   {"weighted_mean count",
                    format("rank %d called weighted_mean of 2 f32 but rank 0 called weighted_mean of 4 f32", o),
                    [&](float* v, float* w) {
                      return gradsync_comm_weighted_mean(g, v, w, odd ? 2 : 4, GRADSYNC_F32, 1, nullptr);
                    }},
                   {"weighted_mean against allreduce",
                    format("rank %d called allreduce of 5 f64 (sum) but rank 0 called weighted_mean of 4 f32", o),
                    [&](float* v, float* w) {
                      return odd ? gradsync_comm_allreduce(g, v, v, 5, GRADSYNC_F64, GRADSYNC_SUM)
                                 : gradsync_comm_weighted_mean(g, v, w, 4, GRADSYNC_F32, 1, nullptr);
                    }},
               });
}

// A root out of range is judged by the group: passed by every rank, E_OUT_OF_RANGE on every rank;
// passed by one rank only, it is a disagreement on the root like any other, which comm.h's
// mismatch rule ("count, dtype, op, root, collective") makes E_MISMATCH on every rank, naming the
// rank and its root. Either way in that same call, nothing written, and the next call works.
void s_root_out_of_range(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  std::vector<float> v(4, 7.0f);
  for (const int32_t root : {x.size, -1, x.size + 1000}) {
    EXPECT_STATUS(x, gradsync_comm_broadcast(g, v.data(), 4, GRADSYNC_F32, root), GRADSYNC_E_OUT_OF_RANGE,
                  format("root %d", root));
    CHECK(x, v == std::vector<float>(4, 7.0f), "broadcast from root %d wrote the buffer", root);
    NEXT_CALL_WORKS(x, g);
  }
  if (x.size == 1) return;
  const int last = x.size - 1;
  for (const int32_t root : {x.size, -1}) {
    EXPECT_STATUS(x, gradsync_comm_broadcast(g, v.data(), 4, GRADSYNC_F32, x.rank == last ? root : 0),
                  GRADSYNC_E_MISMATCH, format("rank %d called broadcast of 4 f32 from root %d", last, root));
    CHECK(x, v == std::vector<float>(4, 7.0f), "broadcast with a bad root on rank %d wrote the buffer", last);
    NEXT_CALL_WORKS(x, g);
  }
}

// comm.h: an argument only the group can judge fails every rank in that same call, naming the
// rank that passed it. A weight over 2^53 (weights travel as doubles) on the last rank only.
void s_weighted_oversized(Ctx& x) {
  // A short deadline: a transport that refuses the weight on that rank alone leaves the others
  // waiting, and the scenario stops at the first wrong outcome rather than cascading.
  gradsync_comm* g = x.group(1000);
  if (g == nullptr) return;
  std::vector<float> send(8, 1.0f), recv(8, 7.0f);
  const int last = x.size - 1;
  const uint64_t huge = (uint64_t{1} << 53) + 1;
  for (const size_t count : {size_t{8}, size_t{0}}) {
    const int st = gradsync_comm_weighted_mean(g, send.data(), recv.data(), count, GRADSYNC_F32,
                                               x.rank == last ? huge : 1, nullptr);
    if (!expect_status(
            x, __LINE__, "weighted_mean with a weight over 2^53 on one rank", st, GRADSYNC_E_INVALID_ARG,
            {x.size > 1 ? format("rank %d passed weight %" PRIu64, last, huge) : format("%" PRIu64, huge)})) {
      return;
    }
    CHECK(x, recv == std::vector<float>(8, 7.0f), "weighted_mean with a bad weight wrote recv");
    NEXT_CALL_WORKS(x, g);
  }
}

// A dtype the weighted mean lacks, passed by every rank: E_INVALID_ARG on every rank.
void s_weighted_integer(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  std::vector<int32_t> ints(8, 1), out(8, 7);
  EXPECT_STATUS(x, gradsync_comm_weighted_mean(g, ints.data(), out.data(), 8, GRADSYNC_I32, 1, nullptr),
                GRADSYNC_E_INVALID_ARG, "weighted mean needs f32 or f64");
  CHECK(x, out == std::vector<int32_t>(8, 7), "weighted_mean of i32 wrote recv");
  NEXT_CALL_WORKS(x, g);
}

// Values outside the enums, passed alike by every rank: E_INVALID_ARG, and the group goes on.
// (Every dtype is reducible now, bf16 and f16 in f32; an unknown one is the unsupported dtype.)
void s_invalid_enums(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  float v[4] = {1, 2, 3, 4};
  EXPECT_STATUS(x, gradsync_comm_allreduce(g, v, v, 4, 77, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  EXPECT_STATUS(x, gradsync_comm_allreduce(g, v, v, 4, GRADSYNC_F32, 9), GRADSYNC_E_INVALID_ARG);
  EXPECT_STATUS(x, gradsync_comm_allreduce(g, v, v, 4, GRADSYNC_F32, -1), GRADSYNC_E_INVALID_ARG);
  EXPECT_STATUS(x, gradsync_comm_broadcast(g, v, 4, -3, 0), GRADSYNC_E_INVALID_ARG);
  EXPECT_STATUS(x, gradsync_comm_reduce_scatter(g, v, v, 4, GRADSYNC_F32, 4), GRADSYNC_E_INVALID_ARG);
  CHECK(x, v[0] == 1 && v[1] == 2 && v[2] == 3 && v[3] == 4, "a refused call wrote its buffer");
  NEXT_CALL_WORKS(x, g);
}

// ---------------------------------------------------------------- one thread per handle

// comm.h: a call on a handle while another thread is inside one fails at once with E_MISUSE and
// touches nothing; the running call is unaffected; the getters are exempt.
extern "C" int note_waiting(void* flag) {
  static_cast<std::atomic<bool>*>(flag)->store(true);
  return 0;  // never interrupt
}

void s_one_thread_per_handle(Ctx& x) {
  float v[2] = {1, 2};
  EXPECT_STATUS(x, gradsync_comm_allreduce(nullptr, v, v, 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_MISUSE);
  EXPECT_STATUS(x, gradsync_comm_barrier(nullptr), GRADSYNC_E_MISUSE);
  if (x.size == 1) return;
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  void* buffer = nullptr;
  EXPECT_OK(x, gradsync_comm_alloc(g, 64, &buffer));
  if (x.rank == 0) {
    // A thread of rank 0 waits in a barrier (the others come only when rank 0 is done); the
    // interrupt check, which comm.h has called while a collective waits, tells that it is inside.
    std::atomic<bool> waiting{false};
    EXPECT_OK(x, gradsync_comm_set_interrupt(g, note_waiting, &waiting));
    int st = -1000;
    std::thread inside([&] { st = gradsync_comm_barrier(g); });
    const auto limit = Clock::now() + 10s;
    while (!waiting && Clock::now() < limit) sleep_ms(1);
    if (CHECK(x, waiting.load(), "the interrupt check was not called while a barrier waited 10 s")) {
      const auto start = Clock::now();
      EXPECT_STATUS(x, gradsync_comm_allreduce(g, v, v, 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_MISUSE);
      EXPECT_STATUS(x, gradsync_comm_broadcast(g, v, 2, GRADSYNC_F32, 0), GRADSYNC_E_MISUSE);
      EXPECT_STATUS(x, gradsync_comm_reset(g), GRADSYNC_E_MISUSE);
      void* p = nullptr;
      EXPECT_STATUS(x, gradsync_comm_alloc(g, 64, &p), GRADSYNC_E_MISUSE);
      EXPECT_STATUS(x, gradsync_comm_free_buffer(g, buffer), GRADSYNC_E_MISUSE);
      int32_t rank = -1, size = -1, transport = -1;
      EXPECT_OK(x, gradsync_comm_rank(g, &rank));
      EXPECT_OK(x, gradsync_comm_size(g, &size));
      EXPECT_OK(x, gradsync_comm_transport(g, &transport));
      CHECK(x, rank == 0 && size == x.size && transport == x.transport, "getters during a call gave %d %d %d", rank,
            size, transport);
      const int64_t took = ms_since(start);
      CHECK(x, took < 1000, "the refused calls took %" PRId64 " ms, not failing at once", took);
      CHECK(x, v[0] == 1 && v[1] == 2, "a refused call wrote its buffer");
    }
    x.post(1);
    inside.join();
    CHECK(x, st == GRADSYNC_OK, "the running barrier was disturbed: %d", st);
    EXPECT_OK(x, gradsync_comm_set_interrupt(g, nullptr, nullptr));
  } else {
    x.wait_for(0, 1, 1000);
    EXPECT_OK(x, gradsync_comm_barrier(g));
  }
  EXPECT_OK(x, gradsync_comm_free_buffer(g, buffer));  // still this communicator's
  NEXT_CALL_WORKS(x, g);
}

// ---------------------------------------------------------------- abort, timeout, reset

// After a stop every call fails fast with E_ABORTED until every rank resets; then the group works.
void stopped_until_reset(Ctx& x, gradsync_comm* g, int line) {
  const auto start = Clock::now();
  expect_status(x, line, "a barrier on the stopped group", gradsync_comm_barrier(g), GRADSYNC_E_ABORTED, {});
  float v = 1;
  expect_status(x, line, "an allreduce on the stopped group",
                gradsync_comm_allreduce(g, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED, {});
  const int64_t took = ms_since(start);
  CHECK(x, took < kGroupTimeoutMs / 2, "calls on the stopped group took %" PRId64 " ms, not failing fast", took);
  // The reset is collective and bounded by the group's timeout: the ranks come to it together.
  EXPECT_OK(x, gradsync_comm_barrier(x.c));
  expect_status(x, line, "gradsync_comm_reset", gradsync_comm_reset(g), GRADSYNC_OK, {});
  next_call_works(x, g, line);
}

void s_abort(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  // Every rank aborts its own handle (a group of one too): its calls fail until the reset.
  EXPECT_OK(x, gradsync_comm_abort(g));
  float v = 1;
  EXPECT_STATUS(x, gradsync_comm_allreduce(g, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED);
  stopped_until_reset(x, g, __LINE__);
  if (x.size == 1) return;

  // The last rank, in no call, aborts while the others wait in a large allreduce: every waiter
  // gets E_ABORTED, and so does the aborter's own next call. (Which rank the waiters' message
  // names is not part of comm.h: on MPI a waiter may hear of the abort from a peer that passed
  // the notice on, and names that peer.)
  const int last = x.size - 1;
  std::vector<float> big(100000, 1.0f);
  if (x.rank == last) {
    sleep_ms(100);
    EXPECT_OK(x, gradsync_comm_abort(g));
    EXPECT_STATUS(x, gradsync_comm_allreduce(g, big.data(), big.data(), big.size(), GRADSYNC_F32, GRADSYNC_SUM),
                  GRADSYNC_E_ABORTED);
  } else {
    const auto start = Clock::now();
    EXPECT_STATUS(x, gradsync_comm_allreduce(g, big.data(), big.data(), big.size(), GRADSYNC_F32, GRADSYNC_SUM),
                  GRADSYNC_E_ABORTED);
    const int64_t waited = ms_since(start);
    CHECK(x, waited < kGroupTimeoutMs / 2, "the abort took %" PRId64 " ms to reach the waiter", waited);
  }
  stopped_until_reset(x, g, __LINE__);

  // Rank 0 waits in a barrier and another of its threads aborts; the others come after the abort
  // and find the group aborted, naming rank 0.
  if (x.rank == 0) {
    int aborted = -1000;
    std::thread aborter([&] {
      sleep_ms(50);
      aborted = gradsync_comm_abort(g);
      x.post(1);
    });
    EXPECT_STATUS(x, gradsync_comm_barrier(g), GRADSYNC_E_ABORTED);
    aborter.join();
    CHECK(x, aborted == GRADSYNC_OK, "gradsync_comm_abort from another thread returned %d", aborted);
  } else {
    x.wait_for(0, 1, 600);
    EXPECT_STATUS(x, gradsync_comm_barrier(g), GRADSYNC_E_ABORTED, "rank 0");
  }
  stopped_until_reset(x, g, __LINE__);
}

// The last rank does not come to a collective within the deadline (it comes once the others
// have timed out, to another collective): the waiters get E_TIMEOUT, the late rank E_ABORTED,
// every later call fails fast until the reset on every rank, then the group works.
void s_timeout(Ctx& x) {
  gradsync_comm* g = x.group(kShortTimeoutMs);
  if (g == nullptr) return;
  const bool late = x.rank == x.size - 1;
  if (late) {
    if (x.ledger == nullptr) {
      sleep_ms(kShortTimeoutMs + 1200);  // MPI: well past the waiters' deadline, even on a loaded machine
    } else {
      for (int r = 0; r < x.size - 1; ++r) x.wait_for(r, 1, 0);
    }
    EXPECT_STATUS(x, gradsync_comm_barrier(g), GRADSYNC_E_ABORTED, "time");  // "timed out", "timeout"
  } else {
    std::vector<float> v(4, 1.0f);
    const auto start = Clock::now();
    EXPECT_STATUS(x, gradsync_comm_allreduce(g, v.data(), v.data(), 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_TIMEOUT,
                  format("%" PRId64 " ms", kShortTimeoutMs));
    const int64_t waited = ms_since(start);
    x.post(1);
    CHECK(x, waited >= kShortTimeoutMs - 50 && waited < kShortTimeoutMs + 5000,
          "the timeout came after %" PRId64 " ms (deadline %" PRId64 " ms)", waited, kShortTimeoutMs);
  }
  stopped_until_reset(x, g, __LINE__);
}

// The v and rooted collectives stop like every other call (they run on the same round engine; this
// holds them to it): each of them, on every rank, meets an abort by the last rank, and a rank
// late past the deadline to a gatherv; each stop lasts until the reset.
// 8 and 9: allgatherv and reduce_scatterv above 16 KiB (the hierarchical transport's levels).
int v_or_rooted(int which, gradsync_comm* g, int rank, int size) {
  const size_t n = static_cast<size_t>(size), me = static_cast<size_t>(rank);
  const size_t scale = which >= 8 ? 5000 : 1;
  std::vector<size_t> counts(n), displs(n);
  for (size_t r = 0; r < n; ++r) counts[r] = scale * (r + 1), displs[r] = scale * r * (r + 1) / 2;
  const size_t total = scale * n * (n + 1) / 2;
  std::vector<float> send(5 * n + total, 1.0f), recv(5 * n + total, 0.0f);
  std::vector<size_t> pairs(n, 2), pair_displs(n);
  for (size_t r = 0; r < n; ++r) pair_displs[r] = 2 * r;
  switch (which) {
    case 0:
    case 8: return gradsync_comm_allgatherv(g, send.data(), recv.data(), counts.data(), GRADSYNC_F32);
    case 1:
    case 9:
      return gradsync_comm_reduce_scatterv(g, send.data(), recv.data(), counts.data(), GRADSYNC_F32, GRADSYNC_SUM);
    case 2:
      return gradsync_comm_alltoallv(g, send.data(), pairs.data(), pair_displs.data(), recv.data(), pairs.data(),
                                     pair_displs.data(), GRADSYNC_F32);
    case 3: return gradsync_comm_reduce(g, send.data(), recv.data(), 5, GRADSYNC_F32, GRADSYNC_SUM, 0);
    case 4: return gradsync_comm_gather(g, send.data(), recv.data(), 5, GRADSYNC_F32, 0);
    case 5: return gradsync_comm_gatherv(g, send.data(), me + 1, recv.data(), counts.data(), GRADSYNC_F32, 0);
    case 6: return gradsync_comm_scatter(g, send.data(), recv.data(), 5, GRADSYNC_F32, 0);
    case 7: return gradsync_comm_scatterv(g, send.data(), counts.data(), recv.data(), me + 1, GRADSYNC_F32, 0);
    default: return GRADSYNC_E_INVALID_ARG;
  }
}
constexpr const char* kVOrRootedNames[] = {"allgatherv",
                                           "reduce_scatterv",
                                           "alltoallv",
                                           "reduce",
                                           "gather",
                                           "gatherv",
                                           "scatter",
                                           "scatterv",
                                           "allgatherv of 20 KiB and more",
                                           "reduce_scatterv of 20 KiB and more"};

void s_stop_v_and_rooted(Ctx& x) {
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  const int last = x.size - 1;
  for (int which = 0; which < 10; ++which) {
    if (x.rank == last) {
      sleep_ms(50);
      EXPECT_OK(x, gradsync_comm_abort(g));
    }
    const int st = v_or_rooted(which, g, x.rank, x.size);
    CHECK(x, st == GRADSYNC_E_ABORTED, "%s after the last rank's abort gave %d: %s", kVOrRootedNames[which], st,
          gradsync_last_error_message());
    stopped_until_reset(x, g, __LINE__);
    CHECK(x, v_or_rooted(which, g, x.rank, x.size) == GRADSYNC_OK, "%s after the reset: %s", kVOrRootedNames[which],
          gradsync_last_error_message());
  }
  gradsync_comm* t = x.group(kShortTimeoutMs);
  if (t == nullptr) return;
  if (x.rank == last) {
    if (x.ledger == nullptr) {
      sleep_ms(kShortTimeoutMs + 1200);
    } else {
      for (int r = 0; r < last; ++r) x.wait_for(r, 1, 0);
    }
    const int st = v_or_rooted(5, t, x.rank, x.size);
    CHECK(x, st == GRADSYNC_E_ABORTED, "the late rank's gatherv gave %d: %s", st, gradsync_last_error_message());
  } else {
    const int st = v_or_rooted(5, t, x.rank, x.size);
    CHECK(x, st == GRADSYNC_E_TIMEOUT, "a gatherv waiting for a late rank gave %d: %s", st,
          gradsync_last_error_message());
    x.post(1);
  }
  stopped_until_reset(x, t, __LINE__);
}

// comm.h: any timeout up to INT64_MAX works; a deadline too far to represent never passes.
void s_no_timeout(Ctx& x) {
  for (const int64_t timeout : {GRADSYNC_NO_TIMEOUT, GRADSYNC_NO_TIMEOUT - 1, int64_t{1} << 62}) {
    gradsync_comm* g = x.group(timeout);
    if (g == nullptr) continue;
    NEXT_CALL_WORKS(x, g);
    EXPECT_OK(x, gradsync_comm_barrier(g));
  }
}

// The library's first acceptance case: 2 ranks [2,4] and [4,8], mean gives [3,6] on both; with
// 3 ranks, lengths 4, 7, 4 give every rank the mismatch, then the next round works.
void s_seed(Ctx& x) {
  if (x.size == 2) {
    float v[2] = {2.0f * static_cast<float>(x.rank + 1), 4.0f * static_cast<float>(x.rank + 1)};
    EXPECT_OK(x, gradsync_comm_allreduce(x.c, v, v, 2, GRADSYNC_F32, GRADSYNC_MEAN));
    CHECK(x, v[0] == 3.0f && v[1] == 6.0f, "got [%g, %g]", static_cast<double>(v[0]), static_cast<double>(v[1]));
    return;
  }
  gradsync_comm* g = x.group(kGroupTimeoutMs);
  if (g == nullptr) return;
  std::vector<float> v(7, 1.0f);
  EXPECT_STATUS(x, gradsync_comm_allreduce(g, v.data(), v.data(), x.rank == 1 ? 7 : 4, GRADSYNC_F32, GRADSYNC_MEAN),
                GRADSYNC_E_MISMATCH,
                "rank 1 called allreduce of 7 f32 (mean) but rank 0 called allreduce of 4 f32 (mean)");
  CHECK(x, v == std::vector<float>(7, 1.0f), "a buffer was written on a mismatch");
  NEXT_CALL_WORKS(x, g);
}

}  // namespace

const char* always(const Ctx&) { return nullptr; }
const char* needs_peers(const Ctx& x) { return x.size < 2 ? "needs 2 or more ranks" : nullptr; }
const char* needs_one(const Ctx& x) { return x.size != 1 ? "a group of one only (run with 1 rank)" : nullptr; }
const char* seed_sizes(const Ctx& x) {
  return x.size == 2 || x.size == 3 ? nullptr : "the seed cases have 2 or 3 ranks";
}
const char* none(const Ctx&) { return nullptr; }

extern const Scenario kScenarios[] = {
    {"seed", s_seed, seed_sizes, none},
    {"allreduce/f32", s_allreduce<F32>, always, none},
    {"allreduce/f64", s_allreduce<F64>, always, none},
    {"allreduce/i32", s_allreduce<I32>, always, none},
    {"allreduce/i64", s_allreduce<I64>, always, none},
    {"allreduce/bf16", s_allreduce<BF16>, always, none},
    {"allreduce/f16", s_allreduce<F16>, always, none},
    {"allreduce/arrival-order", s_arrival_order, always, none},
    {"allreduce_many", s_allreduce_many, always, none},
    {"allreduce_mixed", s_allreduce_mixed, always, none},
    {"weighted_mean", s_weighted_mean, always, none},
    {"weighted_mean/zero-total", s_weighted_zero_total, always, none},
    {"weighted_mean/integer-dtype", s_weighted_integer, always, none},
    {"weighted_mean/mismatch", s_weighted_mismatch, needs_peers, none},
    {"weighted_mean/oversized-weight", s_weighted_oversized, always, none},
    {"broadcast", s_broadcast, always, none},
    {"allgather", s_allgather, always, none},
    {"allgatherv", s_allgatherv, always, none},
    {"reduce_scatter", s_reduce_scatter, always, none},
    {"reduce_scatterv", s_reduce_scatterv, always, none},
    {"reduce_scatter_slice", s_reduce_scatter_slice, always, none},
    {"alltoallv", s_alltoallv, always, none},
    {"rooted", s_rooted, always, none},
    {"alltoall", s_alltoall, always, none},
    {"barrier", s_barrier, always, none},
    {"group-of-one", s_group_of_one, needs_one, none},
    {"alloc", s_alloc, always, none},
    {"mismatch", s_mismatch, needs_peers, none},
    {"root-out-of-range", s_root_out_of_range, always, none},
    {"invalid-enums", s_invalid_enums, always, none},
    {"one-thread-per-handle", s_one_thread_per_handle, always, none},
    {"abort", s_abort, always, none},
    {"timeout", s_timeout, needs_peers, none},
    {"stop/v-and-rooted", s_stop_v_and_rooted, needs_peers, none},
    {"no-timeout", s_no_timeout, always, none},
};
extern const int kCount = static_cast<int>(sizeof kScenarios / sizeof kScenarios[0]);
static_assert(kCount <= kMaxScenarios);

}  // namespace conformance
