/* SPDX-License-Identifier: Apache-2.0 */
/* Threads as ranks of an MPI or hierarchical group (comm.h, "Threads as ranks"), beyond what the
 * conformance suite runs on them (mpi/threads=T): processes of different thread counts (the path
 * through each team's thread 0), the topology of a threaded group, its subgroups (by thread, by
 * process, reordered, crossed (a subgroup's rank 0 a different thread on each process), mixed, and
 * a split of a split), a non-blocking call, the
 * options a threaded create refuses, and a seeded random sequence of collectives whose every
 * result is checked against a reference computed here.
 *
 *   mpirun -np P threads_program mpi|hier T0,T1,... [H0,H1,...] [seed]
 *
 * Ti: the threads (ranks) of process i; Hi: the host of process i (default: all on host 0), for
 * the topology's check. Float inputs are small integers, whose sums are exact in any order, so the
 * reference holds whatever order the levels add in; that every rank gets the same bits is checked
 * on inputs that are not. */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gradsync/gradsync.h"

#define MAX_PROCS 16
#define MAX_RANKS 64

static int32_t g_transport;
static int g_procs, g_threads[MAX_PROCS], g_hosts[MAX_PROCS], g_me; /* g_me: this process */
static int g_size;
static uint64_t g_seed = 1;
static int g_members[MAX_RANKS]; /* 0, 1, ..., g_size - 1 */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_failures = 0;
static long g_checked = 0; /* results compared with the reference, this process */

#define EXPECT(x, cond, ...)                                                                                           \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      pthread_mutex_lock(&g_lock);                                                                                     \
      fprintf(stderr, "threads_program rank %d (process %d thread %d): line %d: ", (x)->rank, g_me, (x)->t, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                                                                    \
      fprintf(stderr, " (last error: %s)\n", gradsync_last_error_message());                                           \
      g_failures++;                                                                                                    \
      pthread_mutex_unlock(&g_lock);                                                                                   \
    }                                                                                                                  \
  } while (0)
#define OK(x, call) EXPECT(x, (call) == GRADSYNC_OK, "%s failed", #call)

typedef struct {
  int t, rank;
  gradsync_comm* c;
} Thread;

static int first_rank(int p) {
  int r = 0;
  for (int q = 0; q < p; q++) r += g_threads[q];
  return r;
}
static int proc_of(int r) {
  int p = 0;
  while (r >= g_threads[p]) r -= g_threads[p++];
  return p;
}

/* Rank r's input element i of call `seed`: a small integer, whose sums are exact in any order. */
static int64_t input(int r, size_t i, uint64_t seed) {
  uint64_t h = (seed * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)r * 0xBF58476D1CE4E5B9ull) ^ (uint64_t)i;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return (int64_t)(h % 2001) - 1000;
}

static uint64_t rng_next(uint64_t* s) {
  *s += 0x9E3779B97F4A7C15ull;
  uint64_t z = *s;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static gradsync_comm* create(Thread* x, int threads, int thread, const char* name, int* status) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  o.transport = g_transport;
  o.threads = threads;
  o.thread = thread;
  o.deterministic = 1;
  o.timeout_ms = 60000;
  snprintf(o.name, sizeof o.name, "%s", name);
  *status = gradsync_comm_create(&c, &o);
  (void)x;
  return c;
}

/* An allreduce of `count` elements (f64, f32, i64 or i32 by kind) with op, checked. */
static void check_allreduce(Thread* x, gradsync_comm* c, int size, const int* members, size_t count, int kind,
                            int32_t op, uint64_t seed) {
  static const int32_t dtypes[] = {GRADSYNC_F64, GRADSYNC_F32, GRADSYNC_I64, GRADSYNC_I32};
  const size_t es = kind == 0 || kind == 2 ? 8 : 4;
  unsigned char* buf = malloc(count * es + 8);
  int me = 0;
  gradsync_comm_rank(c, &me);
  for (size_t i = 0; i < count; i++) {
    const int64_t v = input(members[me], i, seed);
    if (kind == 0) ((double*)buf)[i] = (double)v;
    if (kind == 1) ((float*)buf)[i] = (float)v;
    if (kind == 2) ((int64_t*)buf)[i] = v;
    if (kind == 3) ((int32_t*)buf)[i] = (int32_t)v;
  }
  const int st = gradsync_comm_allreduce(c, buf, buf, count, dtypes[kind], op);
  EXPECT(x, st == GRADSYNC_OK, "allreduce of %zu (kind %d, op %d) failed", count, kind, (int)op);
  pthread_mutex_lock(&g_lock);
  g_checked += (long)count;
  pthread_mutex_unlock(&g_lock);
  for (size_t i = 0; st == GRADSYNC_OK && i < count; i++) {
    int64_t acc = input(members[0], i, seed);
    for (int r = 1; r < size; r++) {
      const int64_t v = input(members[r], i, seed);
      acc = op == GRADSYNC_MAX ? (v > acc ? v : acc) : op == GRADSYNC_MIN ? (v < acc ? v : acc) : acc + v;
    }
    double want = (double)acc, got = 0;
    if (op == GRADSYNC_MEAN) want = kind < 2 ? (double)acc / size : (double)(acc / size);
    if (kind == 1 && op == GRADSYNC_MEAN) want = (double)((float)acc / (float)size);
    if (kind == 0) got = ((double*)buf)[i];
    if (kind == 1) got = ((float*)buf)[i];
    if (kind == 2) got = (double)((int64_t*)buf)[i];
    if (kind == 3) got = (double)((int32_t*)buf)[i];
    if (got != want) {
      EXPECT(x, 0, "allreduce of %zu (kind %d, op %d): element %zu is %.17g, expected %.17g", count, kind, (int)op, i,
             got, want);
      break;
    }
  }
  free(buf);
}

/* Random float data: every rank must get the same bits, twice. */
static void check_same_bits(Thread* x, gradsync_comm* c, size_t count) {
  float* a = malloc(count * sizeof(float));
  float* b = malloc(count * sizeof(float));
  uint64_t s = 77 + (uint64_t)x->rank, h = 1469598103934665603ull;
  uint64_t* all = malloc((size_t)g_size * sizeof(uint64_t));
  for (size_t i = 0; i < count; i++) a[i] = (float)((double)(rng_next(&s) >> 11) / 9007199254740992.0 - 0.5);
  memcpy(b, a, count * sizeof(float));
  OK(x, gradsync_comm_allreduce(c, a, a, count, GRADSYNC_F32, GRADSYNC_SUM));
  OK(x, gradsync_comm_allreduce(c, b, b, count, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(x, memcmp(a, b, count * sizeof(float)) == 0, "two allreduces of the same %zu floats differ", count);
  const unsigned char* p = (const unsigned char*)a;
  for (size_t i = 0; i < count * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
  OK(x, gradsync_comm_allgather(c, &h, all, (size_t)g_size, GRADSYNC_I64));
  for (int r = 0; r < g_size; r++)
    EXPECT(x, all[r] == h, "rank %d got other bits than rank %d (%zu floats)", r, x->rank, count);
  free(a);
  free(b);
  free(all);
}

static void check_topology(Thread* x) {
  int32_t host = -1, local_rank = -1, local_size = -1, hosts = -1, rank_hosts[MAX_RANKS];
  OK(x, gradsync_comm_topology(x->c, &host, &local_rank, &local_size, &hosts, rank_hosts, (size_t)g_size));
  /* Hosts numbered by their lowest rank; the ranks are process-major. */
  int number[MAX_PROCS], next = 0;
  for (int h = 0; h < MAX_PROCS; h++) number[h] = -1;
  for (int p = 0; p < g_procs; p++)
    if (number[g_hosts[p]] < 0) number[g_hosts[p]] = next++;
  int want_local = 0, want_size = 0;
  for (int r = 0; r < g_size; r++) {
    const int h = number[g_hosts[proc_of(r)]];
    EXPECT(x, rank_hosts[r] == h, "rank %d is on host %d, expected %d", r, (int)rank_hosts[r], h);
    if (h == number[g_hosts[g_me]]) {
      if (r < x->rank) want_local++;
      want_size++;
    }
  }
  EXPECT(x, hosts == next, "%d hosts, expected %d", (int)hosts, next);
  EXPECT(x, host == number[g_hosts[g_me]] && local_rank == want_local && local_size == want_size,
         "host %d local rank %d of %d, expected %d, %d of %d", (int)host, (int)local_rank, (int)local_size,
         number[g_hosts[g_me]], want_local, want_size);
}

/* The collectives besides allreduce, results checked, ints and integer-valued floats. */
static void check_collectives(Thread* x, gradsync_comm* c, uint64_t seed) {
  const int n = g_size, me = x->rank;
  const size_t big = 40000; /* past 16 KiB: the hierarchical lanes' levels, MPI's large paths */
  /* broadcast from every root, small and large */
  double* d = malloc(big * sizeof(double));
  for (int root = 0; root < n; root++) {
    for (size_t count = 3; count <= big; count += big - 3) {
      for (size_t i = 0; i < count; i++) d[i] = me == root ? (double)input(root, i, seed) : -1.0;
      OK(x, gradsync_comm_broadcast(c, d, count, GRADSYNC_F64, root));
      for (size_t i = 0; i < count; i++) {
        if (d[i] != (double)input(root, i, seed)) {
          EXPECT(x, 0, "broadcast of %zu from %d: element %zu is %g", count, root, i, d[i]);
          break;
        }
      }
    }
  }
  free(d);
  /* allgatherv, rank r's part r * 97 + 5 elements */
  size_t counts[MAX_RANKS], displs[MAX_RANKS], total = 0;
  for (int r = 0; r < n; r++) counts[r] = (size_t)r * 97 + 5, displs[r] = total, total += counts[r];
  int64_t* mine = malloc(counts[me] * sizeof(int64_t));
  int64_t* all = malloc(total * sizeof(int64_t));
  for (size_t i = 0; i < counts[me]; i++) mine[i] = input(me, i, seed + 1);
  OK(x, gradsync_comm_allgatherv(c, mine, all, counts, GRADSYNC_I64));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < counts[r]; i++)
      if (all[displs[r] + i] != input(r, i, seed + 1)) {
        EXPECT(x, 0, "allgatherv: rank %d's element %zu is %" PRId64, r, i, all[displs[r] + i]);
        r = n;
        break;
      }
  /* reduce_scatterv of the same counts: every rank's whole buffer summed, its part kept */
  int64_t* send = malloc(total * sizeof(int64_t));
  for (size_t i = 0; i < total; i++) send[i] = input(me, i, seed + 2);
  OK(x, gradsync_comm_reduce_scatterv(c, send, mine, counts, GRADSYNC_I64, GRADSYNC_SUM));
  for (size_t i = 0; i < counts[me]; i++) {
    int64_t want = 0;
    for (int r = 0; r < n; r++) want += input(r, displs[me] + i, seed + 2);
    if (mine[i] != want) {
      EXPECT(x, 0, "reduce_scatterv: element %zu is %" PRId64 ", expected %" PRId64, i, mine[i], want);
      break;
    }
  }
  /* alltoallv: s sends d (s + 2 * d) % 5 elements, input(s, d * 16 + j) */
  size_t sc[MAX_RANKS], sd[MAX_RANKS], rc[MAX_RANKS], rd[MAX_RANKS], st = 0, rt = 0;
  for (int r = 0; r < n; r++) {
    sc[r] = (size_t)((me + 2 * r) % 5), sd[r] = st, st += sc[r];
    rc[r] = (size_t)((r + 2 * me) % 5), rd[r] = rt, rt += rc[r];
  }
  int64_t* out = malloc((st + 1) * sizeof(int64_t));
  int64_t* in = malloc((rt + 1) * sizeof(int64_t));
  for (int r = 0; r < n; r++)
    for (size_t j = 0; j < sc[r]; j++) out[sd[r] + j] = input(me, (size_t)r * 16 + j, seed + 3);
  OK(x, gradsync_comm_alltoallv(c, out, sc, sd, in, rc, rd, GRADSYNC_I64));
  for (int r = 0; r < n; r++)
    for (size_t j = 0; j < rc[r]; j++)
      EXPECT(x, in[rd[r] + j] == input(r, (size_t)me * 16 + j, seed + 3), "alltoallv: from rank %d element %zu", r, j);
  /* gather to and scatter from the last rank */
  const int root = n - 1;
  int64_t v = input(me, 0, seed + 4);
  OK(x, gradsync_comm_gather(c, &v, all, 1, GRADSYNC_I64, root));
  if (me == root)
    for (int r = 0; r < n; r++) EXPECT(x, all[r] == input(r, 0, seed + 4), "gather: rank %d's element", r);
  for (int r = 0; r < n; r++) all[r] = me == root ? input(r, 1, seed + 5) : 0;
  OK(x, gradsync_comm_scatter(c, all, &v, 1, GRADSYNC_I64, root));
  EXPECT(x, v == input(me, 1, seed + 5), "scatter: got %" PRId64, v);
  /* a rooted reduce and the weighted mean */
  v = input(me, 2, seed + 6);
  int64_t sum = 0;
  OK(x, gradsync_comm_reduce(c, &v, &sum, 1, GRADSYNC_I64, GRADSYNC_SUM, 0));
  if (me == 0) {
    int64_t want = 0;
    for (int r = 0; r < n; r++) want += input(r, 2, seed + 6);
    EXPECT(x, sum == want, "reduce to 0: %" PRId64 ", expected %" PRId64, sum, want);
  }
  double w = (double)me, mean = 0;
  uint64_t weights = 0;
  OK(x, gradsync_comm_weighted_mean(c, &w, &mean, 1, GRADSYNC_F64, (uint64_t)me + 1, &weights));
  double num = 0;
  for (int r = 0; r < n; r++) num += (double)r * (r + 1);
  EXPECT(x, weights == (uint64_t)(n * (n + 1) / 2) && mean == num / (double)weights, "weighted mean %g of %" PRIu64,
         mean, weights);
  OK(x, gradsync_comm_barrier(c));
  free(mine);
  free(all);
  free(send);
  free(out);
  free(in);
}

/* One subgroup, its members' allreduce checked; members: the parent ranks in subgroup order. A
 * subgroup whose rank 0 is a different thread on different processes is refused (want). */
static void check_subgroup(Thread* x, int color, int key, const char* what) {
  gradsync_comm* sub = NULL;
  int colors[MAX_RANKS], keys[MAX_RANKS], members[MAX_RANKS], m = 0;
  int32_t pair[2] = {color, key}, all[2 * MAX_RANKS];
  OK(x, gradsync_comm_allgather(x->c, pair, all, (size_t)(2 * g_size), GRADSYNC_I32));
  for (int r = 0; r < g_size; r++) colors[r] = all[2 * r], keys[r] = all[2 * r + 1];
  for (int r = 0; r < g_size; r++)
    if (colors[r] == color) members[m++] = r;
  for (int i = 1; i < m; i++) /* by key, then rank (stable) */
    for (int j = i; j > 0 && keys[members[j - 1]] > keys[members[j]]; j--) {
      const int t = members[j];
      members[j] = members[j - 1];
      members[j - 1] = t;
    }
  const int st = gradsync_comm_split(x->c, color, key, &sub);
  EXPECT(x, st == GRADSYNC_OK, "split %s returned %d", what, st);
  check_allreduce(x, x->c, g_size, g_members, 9, 2, GRADSYNC_SUM, 5); /* the group goes on */
  if (st != GRADSYNC_OK || color == GRADSYNC_SPLIT_NONE) {
    EXPECT(x, sub == NULL, "split %s: a rank of no color got a subgroup", what);
    return;
  }
  int32_t rank = -1, size = -1;
  gradsync_comm_rank(sub, &rank);
  gradsync_comm_size(sub, &size);
  EXPECT(x, size == m && rank >= 0 && rank < m && members[rank] == x->rank, "split %s: rank %d of %d", what, (int)rank,
         (int)size);
  if (size == m) {
    check_allreduce(x, sub, m, members, 50000, 2, GRADSYNC_SUM, 11);
    check_allreduce(x, sub, m, members, 5, 0, GRADSYNC_MAX, 12);
    int64_t mine = x->rank, got[MAX_RANKS];
    OK(x, gradsync_comm_allgather(sub, &mine, got, (size_t)m, GRADSYNC_I64));
    for (int r = 0; r < m; r++)
      EXPECT(x, got[r] == members[r], "split %s: subgroup rank %d is %d", what, r, (int)got[r]);
  }
  gradsync_comm_free(sub);
}

static void* run(void* arg) {
  Thread* x = arg;
  int st = 0;
  int members[MAX_RANKS];
  x->c = create(x, g_threads[g_me], x->t, "threads-program", &st);
  EXPECT(x, st == GRADSYNC_OK, "create");
  if (st != GRADSYNC_OK) return NULL;
  int32_t rank = -1, size = -1, transport = -1;
  gradsync_comm_rank(x->c, &rank);
  gradsync_comm_size(x->c, &size);
  gradsync_comm_transport(x->c, &transport);
  x->rank = rank;
  EXPECT(x, rank == first_rank(g_me) + x->t && size == g_size && transport == g_transport,
         "rank %d of %d (transport %d), expected %d of %d", (int)rank, (int)size, (int)transport,
         first_rank(g_me) + x->t, g_size);
  for (int r = 0; r < g_size; r++) members[r] = r;
  check_topology(x);

  for (int kind = 0; kind < 4; kind++) {
    const int32_t ops[] = {GRADSYNC_SUM, GRADSYNC_MAX, GRADSYNC_MIN, GRADSYNC_MEAN};
    for (int o = 0; o < 4; o++)
      for (size_t count = 1; count <= 300000; count *= 37)
        check_allreduce(x, x->c, g_size, members, count, kind, ops[o], (uint64_t)(kind * 16 + o) * 1000 + count);
  }
  check_same_bits(x, x->c, 7);
  check_same_bits(x, x->c, 200000);
  check_collectives(x, x->c, 100);

  /* The random sequence: every rank draws the same calls from the same seed. */
  uint64_t s = g_seed;
  for (int call = 0; call < 120; call++) {
    const uint64_t r = rng_next(&s);
    const size_t count = (size_t)(rng_next(&s) % 3 == 0 ? rng_next(&s) % 120000 : rng_next(&s) % 300);
    const int which = (int)(r % 4);
    if (which == 0) check_allreduce(x, x->c, g_size, members, count, (int)(rng_next(&s) % 4), GRADSYNC_SUM, r);
    if (which == 1) check_allreduce(x, x->c, g_size, members, count, (int)(rng_next(&s) % 4), GRADSYNC_MAX, r);
    if (which == 2) {
      const int root = (int)(rng_next(&s) % (uint64_t)g_size);
      int64_t* b = malloc((count + 1) * sizeof(int64_t));
      for (size_t i = 0; i < count; i++) b[i] = x->rank == root ? input(root, i, r) : 0;
      OK(x, gradsync_comm_broadcast(x->c, b, count, GRADSYNC_I64, root));
      for (size_t i = 0; i < count; i++)
        if (b[i] != input(root, i, r)) {
          EXPECT(x, 0, "random call %d: broadcast of %zu from %d, element %zu", call, count, root, i);
          break;
        }
      free(b);
    }
    if (which == 3) check_collectives(x, x->c, r);
  }

  /* A non-blocking allreduce (the progress thread calls the levels). */
  int64_t v = x->rank, sum = 0;
  gradsync_request* req = NULL;
  OK(x, gradsync_comm_iallreduce(x->c, &v, &sum, 1, GRADSYNC_I64, GRADSYNC_SUM, &req));
  if (req != NULL) {
    OK(x, gradsync_request_wait(req, -1));
    gradsync_request_free(req);
  }
  EXPECT(x, sum == (int64_t)g_size * (g_size - 1) / 2, "iallreduce gave %" PRId64, sum);

  /* Subgroups: by thread index (one thread of each process that has it), by process (its
   * threads), the whole group reversed, colors that give a subgroup's rank 0 different threads on
   * different processes (crossed), mixed colors and keys with rank 0 in none, and a split of a
   * crossed subgroup, reversed. */
  check_subgroup(x, x->t, 0, "by thread");
  check_subgroup(x, g_me, 0, "by process");
  check_subgroup(x, 0, -x->rank, "reversed");
  check_subgroup(x, (x->t + g_me) % 2, 0, "crossed");
  check_subgroup(x, x->rank == 0 ? GRADSYNC_SPLIT_NONE : x->rank % 3, (x->rank * 7) % 5, "mixed");
  {
    gradsync_comm *a = NULL, *b = NULL;
    int32_t ra = -1, rb = -1, sb = -1;
    const int mine = (x->t + g_me) % 2;
    int in_a[MAX_RANKS], na = 0, want[MAX_RANKS], nb = 0;
    for (int r = 0; r < g_size; r++) {
      const int t = r - first_rank(proc_of(r));
      if ((t + proc_of(r)) % 2 == mine) in_a[na++] = r;
    }
    OK(x, gradsync_comm_split(x->c, mine, 0, &a));
    if (a != NULL) {
      gradsync_comm_rank(a, &ra);
      for (int i = na - 1; i >= 0; i--)
        if (i % 2 == ra % 2) want[nb++] = in_a[i];
      OK(x, gradsync_comm_split(a, ra % 2, -ra, &b));
    }
    if (b != NULL) {
      gradsync_comm_rank(b, &rb);
      gradsync_comm_size(b, &sb);
      int64_t me64 = x->rank, got[MAX_RANKS];
      OK(x, gradsync_comm_allgather(b, &me64, got, (size_t)sb, GRADSYNC_I64));
      EXPECT(x, sb == nb, "a split of a crossed subgroup has %d ranks, expected %d", (int)sb, nb);
      for (int i = 0; i < sb && sb == nb; i++)
        EXPECT(x, got[i] == want[i], "a split of a crossed subgroup: its rank %d is %d, expected %d", i, (int)got[i],
               want[i]);
      check_allreduce(x, b, nb, want, 30001, 1, GRADSYNC_SUM, 13);
    }
    gradsync_comm_free(b);
    gradsync_comm_free(a);
  }

  /* (A shrink and a grow: threads_shrink.c, under mpirun --enable-recovery.) */
  check_allreduce(x, x->c, g_size, members, 9, 2, GRADSYNC_SUM, 6);
  gradsync_comm_free(x->c);
  return NULL;
}

static int parse_list(const char* s, int* out) {
  int n = 0;
  while (*s != '\0' && n < MAX_PROCS) {
    out[n++] = (int)strtol(s, (char**)&s, 10);
    if (*s == ',') s++;
  }
  return n;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s mpi|hier T0,T1,... [H0,H1,...] [seed]\n", argv[0]);
    return 2;
  }
  g_transport = strcmp(argv[1], "hier") == 0 ? GRADSYNC_TRANSPORT_HIER : GRADSYNC_TRANSPORT_MPI;
  g_procs = parse_list(argv[2], g_threads);
  if (argc > 3) parse_list(argv[3], g_hosts);
  if (argc > 4) g_seed = strtoull(argv[4], NULL, 10);
  const char* world_rank = getenv("OMPI_COMM_WORLD_RANK");
  g_me = world_rank != NULL ? atoi(world_rank) : 0;
  for (int p = 0; p < g_procs; p++) g_size += g_threads[p];
  for (int r = 0; r < MAX_RANKS; r++) g_members[r] = r;
  if (g_me >= g_procs || g_size > MAX_RANKS) {
    fprintf(stderr, "process %d: the layout %s names %d processes (at most %d ranks)\n", g_me, argv[2], g_procs,
            MAX_RANKS);
    return 2;
  }

  /* What a threaded create refuses, before any group exists. */
  {
    Thread x0 = {0, -1, NULL};
    Thread* x = &x0;
    gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
    gradsync_comm* c = NULL;
    o.transport = g_transport;
    o.threads = 2;
    EXPECT(x,
           gradsync_comm_create(&c, &o) == GRADSYNC_E_INVALID_ARG &&
               strstr(gradsync_last_error_message(), "thread is not set") != NULL,
           "threads without a thread index");
    o.thread = 2;
    EXPECT(x, gradsync_comm_create(&c, &o) == GRADSYNC_E_OUT_OF_RANGE, "thread 2 of 2");
    o.threads = 0;
    o.thread = 0;
    EXPECT(x, gradsync_comm_create(&c, &o) == GRADSYNC_E_INVALID_ARG, "threads 0");
    o.threads = 2;
    snprintf(o.name, sizeof o.name, "threads-program-join");
    EXPECT(x,
           gradsync_comm_join(&c, &o, NULL) == GRADSYNC_E_INVALID_ARG &&
               strstr(gradsync_last_error_message(), "not started by a grow") != NULL,
           "a join with threads in a process no grow started");
  }

  Thread threads[MAX_RANKS];
  pthread_t ids[MAX_RANKS];
  for (int t = 0; t < g_threads[g_me]; t++) {
    threads[t].t = t;
    threads[t].rank = -1;
    pthread_create(&ids[t], NULL, run, &threads[t]);
  }
  for (int t = 0; t < g_threads[g_me]; t++) pthread_join(ids[t], NULL);
  if (g_me == 0)
    printf("threads_program %s %s: %s (process 0 checked %ld allreduced elements)\n", argv[1], argv[2],
           g_failures == 0 ? "ok" : "FAILED", g_checked);
  return g_failures == 0 ? 0 : 1;
}
