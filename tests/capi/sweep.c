// SPDX-License-Identifier: Apache-2.0
/* The hostile-argument sweep of the whole C ABI: every exported function (all GRADSYNC_API
 * declarations of the public headers) called with NULL for every pointer, a handle of the wrong
 * kind (and a pointer to memory that is no handle at all), zero and huge counts and sizes, counts
 * whose products overflow, negative and huge ranks, rows and timeouts, unknown enum values, and
 * options structs whose struct_size or version fit no version of the struct.
 *
 * What every call must do: return (no crash, no hang, no sanitizer report); on failure return the
 * documented non-OK status (never GRADSYNC_E_INTERNAL) with a message that starts with the
 * function's name and says more, and write nothing: everything a failing call could write
 * through is in `out` below, filled with a canary before each call and compared after, and a
 * constructor must leave its out-handle NULL. Freed handles are swept only where the contract
 * detects them without a use after free: a shard whose communicator was freed, a buffer freed
 * twice. (A freed handle itself is dangling memory in C: using it is the caller's bug.) */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"

/* ------------------------------------------------------------------ the checking machinery */

/* An expected status meaning "any failure but GRADSYNC_E_INTERNAL", where the contract names none. */
#define ANY_ERROR 1

static int sweep_calls = 0;

/* Everything a call may write through. Filled with the canary before each call; a failed call
 * must leave it as it was. */
static struct {
  float f32[64];
  double f64[16];
  uint16_t enc[64];
  int64_t i64[16];
  uint64_t u64[16];
  int32_t i32[8];
  size_t sz[4];
  const void* view;
  void* ptr;
  double opts[4200 / sizeof(double)]; /* an options struct for *_init, up to 4096 bytes and more */
} out;
static unsigned char canary[sizeof out];

/* A non-NULL value for a constructor's out-handle before the call: failure must set it to NULL. */
#define UNSET_HANDLE ((void*)canary)

static void sweep_begin(void) {
  memset(&out, 0xA5, sizeof out);
  gradsync_last_error_clear();
}

/* The function a call text names: "gradsync_table_get(t, -1, ...)" -> "gradsync_table_get". */
static void function_of(const char* text, char* name, size_t size) {
  size_t n = strcspn(text, "( ");
  if (n >= size) n = size - 1;
  memcpy(name, text, n);
  name[n] = '\0';
}

static void sweep_failed(const char* text, int line, const char* why) {
  fprintf(stderr, "sweep.c:%d: %s: %s (last error: \"%s\")\n", line, text, why, gradsync_last_error_message());
  check_failed();
}

/* made: -1 not a constructor; else whether the out-handle is NULL (0), a new handle (1), or untouched (2). */
static void sweep_end(int expected, int status, const char* function, const char* text, int line, int made) {
  char name[96], why[256];
  const char* message = gradsync_last_error_message();
  ++sweep_calls;
  if (function == NULL) {
    function_of(text, name, sizeof name);
    function = name;
  }
  if (status == GRADSYNC_E_INTERNAL) {
    sweep_failed(text, line, "GRADSYNC_E_INTERNAL for a bad argument");
    return;
  }
  if (expected == ANY_ERROR ? status == GRADSYNC_OK : status != expected) {
    snprintf(why, sizeof why, "returned %s, expected %s", gradsync_status_string(status),
             expected == ANY_ERROR ? "an error" : gradsync_status_string(expected));
    sweep_failed(text, line, why);
    return;
  }
  if (status == GRADSYNC_OK) {
    if (made == 0 || made == 2) sweep_failed(text, line, "succeeded without a handle");
    return;
  }
  if (gradsync_last_error_status() != status) sweep_failed(text, line, "gradsync_last_error_status() disagrees");
  if (strncmp(message, function, strlen(function)) != 0 || strncmp(message + strlen(function), ": ", 2) != 0 ||
      strlen(message) <= strlen(function) + 2) {
    snprintf(why, sizeof why, "the message does not start with \"%s: \" and a reason", function);
    sweep_failed(text, line, why);
  }
  if (memcmp(&out, canary, sizeof out) != 0) sweep_failed(text, line, "wrote output on failure");
  if (made == 1) sweep_failed(text, line, "wrote a handle on failure");
  if (made == 2) sweep_failed(text, line, "left the out-handle unset on failure (must be NULL)");
}

/* One call with the expected status (or ANY_ERROR). */
#define EXPECT(expected, call) EXPECT_AS(expected, call, #call)
#define EXPECT_AS(expected, call, text)                       \
  do {                                                        \
    int status_;                                              \
    sweep_begin();                                            \
    status_ = (int)(call);                                    \
    sweep_end((expected), status_, NULL, text, __LINE__, -1); \
  } while (0)

/* A constructor call writing `handle`: NULL on failure, a handle on success (the caller frees it). */
#define EXPECT_NEW(expected, handle, call)                \
  do {                                                    \
    int status_;                                          \
    (handle) = UNSET_HANDLE;                              \
    sweep_begin();                                        \
    status_ = (int)(call);                                \
    sweep_end((expected), status_, NULL, #call, __LINE__, \
              (void*)(handle) == UNSET_HANDLE ? 2         \
              : (handle) == NULL              ? 0         \
                                              : 1);                    \
    if ((void*)(handle) == UNSET_HANDLE) (handle) = NULL; \
  } while (0)

/* A function that returns a value, not a status: the condition must hold. */
#define EXPECT_TRUE(cond)                                        \
  do {                                                           \
    ++sweep_calls;                                               \
    if (!(cond)) sweep_failed(#cond, __LINE__, "does not hold"); \
  } while (0)

/* ------------------------------------------------------------------ fixtures */

static const float in_f32[64] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const double in_f64[16] = {1, 2, 3, 4};
static const uint16_t in_enc[64] = {0x3f80, 0x4000, 0x4040, 0x4080};
static const int64_t ids_ok[4] = {0, 1, 2, 3};
static const int64_t ids_bad_last[4] = {0, 1, 2, 8}; /* row 8 of an 8-row table */
static const int64_t ids_negative[1] = {-1};
static const int64_t ids_min[1] = {INT64_MIN};

/* One live handle of every kind, for the wrong-kind sweep; also the objects the sections use. */
enum kind { K_COUNTER32, K_COUNTER64, K_FLAG, K_MUTEX, K_COMM, K_TABLE, K_ACCUM, K_SHARD, K_REQUEST, K_COUNT };
static const char* const kind_names[K_COUNT] = {"counter32", "counter64",   "flag",  "mutex",  "comm",
                                                "table",     "accumulator", "shard", "request"};
static void* live[K_COUNT];

static gradsync_counter32* c32;
static gradsync_request* request; /* a completed one */
static gradsync_counter64* c64;
static gradsync_flag* flag;
static gradsync_mutex* mtx;
static gradsync_comm* comm;       /* thread transport, 1 rank */
static gradsync_table* table;     /* anonymous 8 x 4 */
static gradsync_table* params;    /* anonymous 8 x 4, for apply */
static gradsync_table* state;     /* anonymous 8 x 1, for apply */
static gradsync_table* narrow;    /* anonymous 8 x 2 */
static gradsync_table* read_only; /* a file of 8 x 4 opened read-only */
static gradsync_accum* accum;     /* anonymous 8 x 4 */
static gradsync_shard* shard;     /* 10 parameters on comm, initialised */
static float shard_weights[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};

/* Memory that is no handle: 64 bytes of zeros. Its "magic" is read (4 bytes), nothing more. */
static const uint64_t not_a_handle[8];

static char dir[] = "/tmp/gradsync-capi-sweep-XXXXXX";
static char table_path[256], accum_path[256];

static gradsync_table_options anon_table_options(int64_t rows, int64_t dim) {
  gradsync_table_options o = GRADSYNC_TABLE_OPTIONS_INIT;
  o.mode = GRADSYNC_TABLE_ANONYMOUS;
  o.rows = rows;
  o.dim = dim;
  return o;
}

static gradsync_accum_options anon_accum_options(void) {
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
  o.mode = GRADSYNC_TABLE_ANONYMOUS;
  o.rows = 8;
  o.dim = 4;
  return o;
}

static gradsync_comm_options comm_options(const char* name) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  o.rank = 0;
  o.size = 1;
  o.timeout_ms = 10000;
  strncpy(o.name, name, sizeof o.name - 1);
  return o;
}

static int setup(void) {
  gradsync_table_options o;
  gradsync_accum_options ao = anon_accum_options();
  gradsync_comm_options co = comm_options("capi-sweep");
  gradsync_table* file_table = NULL;
  int ok = 1;

  if (mkdtemp(dir) == NULL) return 0;
  snprintf(table_path, sizeof table_path, "%s/table.gst", dir);
  snprintf(accum_path, sizeof accum_path, "%s/grads.gst", dir);

  ok &= gradsync_counter32_create(&c32, 0) == GRADSYNC_OK;
  ok &= gradsync_counter64_create(&c64, 0) == GRADSYNC_OK;
  ok &= gradsync_flag_create(&flag) == GRADSYNC_OK;
  ok &= gradsync_mutex_create(&mtx) == GRADSYNC_OK;
  ok &= gradsync_comm_create(&comm, &co) == GRADSYNC_OK;
  o = anon_table_options(8, 4);
  ok &= gradsync_table_open(&table, NULL, &o) == GRADSYNC_OK;
  ok &= gradsync_table_open(&params, NULL, &o) == GRADSYNC_OK;
  o.dim = 1;
  ok &= gradsync_table_open(&state, NULL, &o) == GRADSYNC_OK;
  o.dim = 2;
  ok &= gradsync_table_open(&narrow, NULL, &o) == GRADSYNC_OK;
  o = anon_table_options(8, 4);
  o.mode = GRADSYNC_TABLE_CREATE;
  ok &= gradsync_table_open(&file_table, table_path, &o) == GRADSYNC_OK;
  ok &= gradsync_table_flush(file_table) == GRADSYNC_OK;
  gradsync_table_free(file_table);
  o.mode = GRADSYNC_TABLE_OPEN;
  o.read_only = 1;
  ok &= gradsync_table_open(&read_only, table_path, &o) == GRADSYNC_OK;
  ok &= gradsync_accum_open(&accum, NULL, &ao) == GRADSYNC_OK;
  ao.mode = GRADSYNC_TABLE_CREATE;
  {
    gradsync_accum* file_accum = NULL; /* an accumulator's file, to open as a table */
    ok &= gradsync_accum_open(&file_accum, accum_path, &ao) == GRADSYNC_OK;
    gradsync_accum_free(file_accum);
  }
  ok &= comm != NULL && gradsync_shard_create(&shard, comm, 10, NULL) == GRADSYNC_OK;
  ok &= shard != NULL && gradsync_shard_init(shard, shard_weights, 10) == GRADSYNC_OK;
  ok &= comm != NULL && gradsync_comm_ibarrier(comm, &request) == GRADSYNC_OK;
  ok &= request != NULL && gradsync_request_wait(request, -1) == GRADSYNC_OK;
  if (!ok) {
    fprintf(stderr, "sweep: setup failed: %s\n", gradsync_last_error_message());
    return 0;
  }
  live[K_COUNTER32] = c32;
  live[K_COUNTER64] = c64;
  live[K_FLAG] = flag;
  live[K_MUTEX] = mtx;
  live[K_COMM] = comm;
  live[K_TABLE] = table;
  live[K_ACCUM] = accum;
  live[K_SHARD] = shard;
  live[K_REQUEST] = request;
  return 1;
}

static void teardown(void) {
  gradsync_request_free(request);
  gradsync_shard_free(shard);
  gradsync_comm_free(comm);
  gradsync_accum_free(accum);
  gradsync_table_free(read_only);
  gradsync_table_free(narrow);
  gradsync_table_free(state);
  gradsync_table_free(params);
  gradsync_table_free(table);
  gradsync_mutex_free(mtx);
  gradsync_flag_free(flag);
  gradsync_counter64_free(c64);
  gradsync_counter32_free(c32);
  unlink(table_path);
  unlink(accum_path);
  rmdir(dir);
}

/* ------------------------------------------------------------------ NULL and wrong-kind handles */

/* Each entry calls one function with `h` in one handle position and valid arguments elsewhere. */
typedef int (*handle_call)(void* h);
struct handle_case {
  const char* function;
  enum kind takes;
  int null_allowed; /* NULL is a valid value of this position (an optional handle) */
  handle_call call;
};

/* clang-format off */
static int h_counter32_fetch_add(void *h) { return gradsync_counter32_fetch_add(h, 1, &out.i32[0], &out.i32[1]); }
static int h_counter32_load(void *h) { return gradsync_counter32_load(h, &out.i32[0]); }
static int h_counter32_store(void *h) { return gradsync_counter32_store(h, 7); }
static int h_counter64_fetch_add(void *h) { return gradsync_counter64_fetch_add(h, 1, &out.i64[0], &out.i64[1]); }
static int h_counter64_load(void *h) { return gradsync_counter64_load(h, &out.i64[0]); }
static int h_counter64_store(void *h) { return gradsync_counter64_store(h, 7); }
static int h_flag_conditional_set(void *h) { return gradsync_flag_conditional_set(h, 1, &out.i32[0]); }
static int h_flag_check(void *h) { return gradsync_flag_check(h, &out.i32[0]); }
static int h_flag_reset(void *h) { return gradsync_flag_reset(h); }
static int h_mutex_lock(void *h) { return gradsync_mutex_lock(h); }
static int h_mutex_try_lock(void *h) { return gradsync_mutex_try_lock(h, &out.i32[0]); }
static int h_mutex_lock_timeout(void *h) { return gradsync_mutex_lock_timeout(h, 0); }
static int h_mutex_unlock(void *h) { return gradsync_mutex_unlock(h); }
static int h_comm_abort(void *h) { return gradsync_comm_abort(h); }
static int h_comm_set_interrupt(void *h) { return gradsync_comm_set_interrupt(h, NULL, NULL); }
static int h_comm_reset(void *h) { return gradsync_comm_reset(h); }
static int h_comm_rank(void *h) { return gradsync_comm_rank(h, &out.i32[0]); }
static int h_comm_size(void *h) { return gradsync_comm_size(h, &out.i32[0]); }
static int h_comm_transport(void *h) { return gradsync_comm_transport(h, &out.i32[0]); }
static int h_comm_allreduce(void *h) { return gradsync_comm_allreduce(h, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM); }
static int h_comm_allreduce_many(void *h) {
  const void *sends[1] = {in_f32};
  void *recvs[1] = {out.f32};
  const size_t counts[1] = {4};
  return gradsync_comm_allreduce_many(h, sends, recvs, counts, 1, GRADSYNC_F32, GRADSYNC_SUM);
}
static int h_comm_allreduce_mixed(void *h) {
  const void *sends[1] = {in_f32};
  void *recvs[1] = {out.f32};
  const size_t counts[1] = {4};
  const int32_t dtypes[1] = {GRADSYNC_F32};
  return gradsync_comm_allreduce_mixed(h, sends, recvs, counts, dtypes, 1, GRADSYNC_SUM);
}
static int h_comm_weighted_mean(void *h) { return gradsync_comm_weighted_mean(h, in_f32, out.f32, 4, GRADSYNC_F32, 1, &out.u64[0]); }
static int h_comm_broadcast(void *h) { return gradsync_comm_broadcast(h, out.f32, 4, GRADSYNC_F32, 0); }
static int h_comm_allgather(void *h) { return gradsync_comm_allgather(h, in_f32, out.f32, 4, GRADSYNC_F32); }
static int h_comm_reduce_scatterv(void *h) {
  const size_t counts[1] = {4};
  return gradsync_comm_reduce_scatterv(h, in_f32, out.f32, counts, GRADSYNC_F32, GRADSYNC_SUM);
}
static int h_comm_allgatherv(void *h) {
  const size_t counts[1] = {4};
  return gradsync_comm_allgatherv(h, in_f32, out.f32, counts, GRADSYNC_F32);
}
static int h_comm_reduce_scatter(void *h) { return gradsync_comm_reduce_scatter(h, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM); }
static int h_comm_alltoall(void *h) { return gradsync_comm_alltoall(h, in_f32, out.f32, 4, GRADSYNC_F32); }
static int h_comm_barrier(void *h) { return gradsync_comm_barrier(h); }
static const size_t four[1] = {4};
static int h_comm_alltoallv(void *h) {
  return gradsync_comm_alltoallv(h, in_f32, four, NULL, out.f32, four, NULL, GRADSYNC_F32);
}
static int h_comm_reduce(void *h) { return gradsync_comm_reduce(h, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM, 0); }
static int h_comm_gather(void *h) { return gradsync_comm_gather(h, in_f32, out.f32, 4, GRADSYNC_F32, 0); }
static int h_comm_gatherv(void *h) { return gradsync_comm_gatherv(h, in_f32, 4, out.f32, four, GRADSYNC_F32, 0); }
static int h_comm_scatter(void *h) { return gradsync_comm_scatter(h, in_f32, out.f32, 4, GRADSYNC_F32, 0); }
static int h_comm_scatterv(void *h) { return gradsync_comm_scatterv(h, in_f32, four, out.f32, 4, GRADSYNC_F32, 0); }
static int h_comm_stats(void *h) {
  gradsync_comm_statistics st = GRADSYNC_COMM_STATISTICS_INIT;
  return gradsync_comm_stats(h, &st, NULL, 0);
}
static int h_comm_timeline(void *h) { return gradsync_comm_timeline(h, NULL); }
/* The non-blocking forms: a request is made only for a live communicator (never here). */
static int started(const char *function, int status, gradsync_request *r) {
  if (r != NULL) sweep_failed(function, __LINE__, "a request was made for a bad handle");
  gradsync_request_free(r);
  return status;
}
#define H_START(name, ...)                                                                          \
  static int h_comm_##name(void *h) {                                                             \
    gradsync_request *r = UNSET_HANDLE;                                                           \
    const int status = gradsync_comm_##name(h, __VA_ARGS__, &r);                                  \
    return started("gradsync_comm_" #name, status, r);                                            \
  }
H_START(iallreduce, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM)
H_START(iweighted_mean, in_f32, out.f32, 4, GRADSYNC_F32, 1, &out.u64[0])
H_START(ibroadcast, out.f32, 4, GRADSYNC_F32, 0)
H_START(iallgather, in_f32, out.f32, 4, GRADSYNC_F32)
H_START(iallgatherv, in_f32, out.f32, (const size_t[]){4}, GRADSYNC_F32)
H_START(ireduce_scatterv, in_f32, out.f32, (const size_t[]){4}, GRADSYNC_F32, GRADSYNC_SUM)
H_START(ireduce_scatter, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM)
H_START(ialltoall, in_f32, out.f32, 4, GRADSYNC_F32)
H_START(ialltoallv, in_f32, four, NULL, out.f32, four, NULL, GRADSYNC_F32)
H_START(ireduce, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM, 0)
H_START(igather, in_f32, out.f32, 4, GRADSYNC_F32, 0)
H_START(igatherv, in_f32, 4, out.f32, four, GRADSYNC_F32, 0)
H_START(iscatter, in_f32, out.f32, 4, GRADSYNC_F32, 0)
H_START(iscatterv, in_f32, four, out.f32, 4, GRADSYNC_F32, 0)
static int h_comm_iallreduce_many(void *h) {
  const void *sends[1] = {in_f32};
  void *recvs[1] = {out.f32};
  const size_t counts[1] = {4};
  gradsync_request *r = UNSET_HANDLE;
  const int status = gradsync_comm_iallreduce_many(h, sends, recvs, counts, 1, GRADSYNC_F32, GRADSYNC_SUM, &r);
  return started("gradsync_comm_iallreduce_many", status, r);
}
static int h_comm_iallreduce_mixed(void *h) {
  const void *sends[1] = {in_f32};
  void *recvs[1] = {out.f32};
  const size_t counts[1] = {4};
  const int32_t dtypes[1] = {GRADSYNC_F32};
  gradsync_request *r = UNSET_HANDLE;
  const int status = gradsync_comm_iallreduce_mixed(h, sends, recvs, counts, dtypes, 1, GRADSYNC_SUM, &r);
  return started("gradsync_comm_iallreduce_mixed", status, r);
}
static int h_comm_ibarrier(void *h) {
  gradsync_request *r = UNSET_HANDLE;
  const int status = gradsync_comm_ibarrier(h, &r);
  return started("gradsync_comm_ibarrier", status, r);
}
static int h_comm_get_async_error(void *h) { return gradsync_comm_get_async_error(h, &out.i32[0]); }
static int h_request_wait(void *h) { return gradsync_request_wait(h, 0); }
static int h_request_test(void *h) { return gradsync_request_test(h, &out.i32[0]); }
static int h_comm_alloc(void *h) {
  void *p = UNSET_HANDLE; /* NULL on failure, by contract */
  const int status = gradsync_comm_alloc(h, 64, &p);
  if (p != NULL) sweep_failed("gradsync_comm_alloc", __LINE__, "the buffer is not NULL on failure");
  return status;
}
static int h_comm_free_buffer(void *h) { return gradsync_comm_free_buffer(h, NULL); }
static int h_comm_grow(void *h) {
  gradsync_comm *g = NULL;
  const int status = gradsync_comm_grow(h, "capi-sweep-grow", 1, &g, NULL);
  if (g != NULL) gradsync_comm_free(g); /* only if the sweep fails */
  return status;
}
static int h_shard_create(void *h) {
  gradsync_shard *s = NULL;
  const int status = gradsync_shard_create(&s, h, 10, NULL);
  if (s != NULL) gradsync_shard_free(s); /* only if the sweep fails */
  return status;
}
static int h_table_shape(void *h) { return gradsync_table_shape(h, &out.i64[0], &out.i64[1]); }
static int h_table_created(void *h) { return gradsync_table_created(h, &out.i32[0]); }
static int h_table_get(void *h) { return gradsync_table_get(h, 0, out.f32, 4); }
static int h_table_set(void *h) { return gradsync_table_set(h, 0, in_f32, 4); }
static int h_table_gather(void *h) { return gradsync_table_gather(h, ids_ok, 4, out.f32, 16); }
static int h_table_scatter(void *h) { return gradsync_table_scatter(h, ids_ok, 4, in_f32, 16); }
static int h_table_fill_zero(void *h) { return gradsync_table_fill_zero(h); }
static int h_table_fill_uniform(void *h) { return gradsync_table_fill_uniform(h, 1, -1.0f, 1.0f); }
static int h_table_flush(void *h) { return gradsync_table_flush(h); }
static int h_table_prefetch(void *h) { return gradsync_table_prefetch(h, ids_ok, 4); }
static int h_table_view(void *h) { return gradsync_table_view(h, &out.view, &out.sz[0]); }
static int h_accum_shape(void *h) { return gradsync_accum_shape(h, &out.i64[0], &out.i64[1]); }
static int h_accum_get_concurrency(void *h) { return gradsync_accum_get_concurrency(h, &out.i32[0], &out.i64[0]); }
static int h_accum_add(void *h) { return gradsync_accum_add(h, 0, in_f32, 4); }
static int h_accum_add_batch(void *h) { return gradsync_accum_add_batch(h, ids_ok, 4, in_f32, 16); }
static int h_accum_get(void *h) { return gradsync_accum_get(h, 0, out.f32, 4); }
static int h_accum_zero(void *h) { return gradsync_accum_zero(h); }
static int h_accum_touched_count(void *h) { return gradsync_accum_touched_count(h, &out.i64[0]); }
static int h_accum_touched(void *h) { return gradsync_accum_touched(h, out.i64, 16, &out.sz[0]); }
static int h_accum_apply_accum(void *h) { return gradsync_accum_apply(h, params, NULL, NULL); }
static int h_accum_apply_params(void *h) { return gradsync_accum_apply(accum, h, NULL, NULL); }
static int h_accum_apply_state(void *h) {
  gradsync_optimizer opt = GRADSYNC_OPTIMIZER_INIT;
  opt.kind = GRADSYNC_OPTIM_ROW_ADAGRAD;
  return gradsync_accum_apply(accum, params, &opt, h);
}
static int h_accum_flush(void *h) { return gradsync_accum_flush(h); }
static int h_accum_view(void *h) { return gradsync_accum_view(h, &out.view, &out.sz[0]); }
static int h_shard_part(void *h) { return gradsync_shard_part(h, -1, 0, &out.u64[0], &out.u64[1]); }
static int h_shard_ranges(void *h) { return gradsync_shard_ranges(h, 0, out.u64, 16, &out.sz[0]); }
static int h_shard_memory(void *h) { return gradsync_shard_memory(h, &out.u64[0], &out.u64[1], &out.u64[2]); }
static int h_shard_updates(void *h) { return gradsync_shard_updates(h, &out.i64[0]); }
static int h_shard_set_lr(void *h) { return gradsync_shard_set_lr(h, 0.5); }
static int h_shard_init(void *h) { return gradsync_shard_init(h, shard_weights, 10); }
static int h_shard_restore(void *h) { return gradsync_shard_restore(h, shard_weights, NULL, NULL, 10, 0); }
static int h_shard_step(void *h) { return gradsync_shard_step(h, in_f32, out.f32, 10, 1); }
static int h_shard_put(void *h) { return gradsync_shard_put(h, in_f32, 10, 1); }
static int h_shard_aggregate(void *h) { return gradsync_shard_aggregate(h); }
static int h_shard_update(void *h) { return gradsync_shard_update(h); }
static int h_shard_read_slice(void *h) { return gradsync_shard_read_slice(h, GRADSYNC_SHARD_WEIGHTS, out.f32, 10); }
static int h_shard_write_weights(void *h) { return gradsync_shard_write_weights(h, shard_weights, 10); }
static int h_shard_gather(void *h) { return gradsync_shard_gather(h, out.f32, 10); }

static const struct handle_case handle_cases[] = {
  {"gradsync_counter32_fetch_add", K_COUNTER32, 0, h_counter32_fetch_add},
  {"gradsync_counter32_load", K_COUNTER32, 0, h_counter32_load},
  {"gradsync_counter32_store", K_COUNTER32, 0, h_counter32_store},
  {"gradsync_counter64_fetch_add", K_COUNTER64, 0, h_counter64_fetch_add},
  {"gradsync_counter64_load", K_COUNTER64, 0, h_counter64_load},
  {"gradsync_counter64_store", K_COUNTER64, 0, h_counter64_store},
  {"gradsync_flag_conditional_set", K_FLAG, 0, h_flag_conditional_set},
  {"gradsync_flag_check", K_FLAG, 0, h_flag_check},
  {"gradsync_flag_reset", K_FLAG, 0, h_flag_reset},
  {"gradsync_mutex_lock", K_MUTEX, 0, h_mutex_lock},
  {"gradsync_mutex_try_lock", K_MUTEX, 0, h_mutex_try_lock},
  {"gradsync_mutex_lock_timeout", K_MUTEX, 0, h_mutex_lock_timeout},
  {"gradsync_mutex_unlock", K_MUTEX, 0, h_mutex_unlock},
  {"gradsync_comm_abort", K_COMM, 0, h_comm_abort},
  {"gradsync_comm_grow", K_COMM, 0, h_comm_grow},
  {"gradsync_comm_set_interrupt", K_COMM, 0, h_comm_set_interrupt},
  {"gradsync_comm_reset", K_COMM, 0, h_comm_reset},
  {"gradsync_comm_rank", K_COMM, 0, h_comm_rank},
  {"gradsync_comm_size", K_COMM, 0, h_comm_size},
  {"gradsync_comm_transport", K_COMM, 0, h_comm_transport},
  {"gradsync_comm_allreduce", K_COMM, 0, h_comm_allreduce},
  {"gradsync_comm_allreduce_many", K_COMM, 0, h_comm_allreduce_many},
  {"gradsync_comm_allreduce_mixed", K_COMM, 0, h_comm_allreduce_mixed},
  {"gradsync_comm_allgatherv", K_COMM, 0, h_comm_allgatherv},
  {"gradsync_comm_iallgatherv", K_COMM, 0, h_comm_iallgatherv},
  {"gradsync_comm_reduce_scatterv", K_COMM, 0, h_comm_reduce_scatterv},
  {"gradsync_comm_ireduce_scatterv", K_COMM, 0, h_comm_ireduce_scatterv},
  {"gradsync_comm_stats", K_COMM, 0, h_comm_stats},
  {"gradsync_comm_timeline", K_COMM, 0, h_comm_timeline},
  {"gradsync_comm_weighted_mean", K_COMM, 0, h_comm_weighted_mean},
  {"gradsync_comm_broadcast", K_COMM, 0, h_comm_broadcast},
  {"gradsync_comm_allgather", K_COMM, 0, h_comm_allgather},
  {"gradsync_comm_reduce_scatter", K_COMM, 0, h_comm_reduce_scatter},
  {"gradsync_comm_alltoall", K_COMM, 0, h_comm_alltoall},
  {"gradsync_comm_barrier", K_COMM, 0, h_comm_barrier},
  {"gradsync_comm_iallreduce", K_COMM, 0, h_comm_iallreduce},
  {"gradsync_comm_iallreduce_many", K_COMM, 0, h_comm_iallreduce_many},
  {"gradsync_comm_iallreduce_mixed", K_COMM, 0, h_comm_iallreduce_mixed},
  {"gradsync_comm_iweighted_mean", K_COMM, 0, h_comm_iweighted_mean},
  {"gradsync_comm_ibroadcast", K_COMM, 0, h_comm_ibroadcast},
  {"gradsync_comm_iallgather", K_COMM, 0, h_comm_iallgather},
  {"gradsync_comm_ireduce_scatter", K_COMM, 0, h_comm_ireduce_scatter},
  {"gradsync_comm_ialltoall", K_COMM, 0, h_comm_ialltoall},
  {"gradsync_comm_ibarrier", K_COMM, 0, h_comm_ibarrier},
  {"gradsync_comm_alltoallv", K_COMM, 0, h_comm_alltoallv},
  {"gradsync_comm_ialltoallv", K_COMM, 0, h_comm_ialltoallv},
  {"gradsync_comm_reduce", K_COMM, 0, h_comm_reduce},
  {"gradsync_comm_ireduce", K_COMM, 0, h_comm_ireduce},
  {"gradsync_comm_gather", K_COMM, 0, h_comm_gather},
  {"gradsync_comm_igather", K_COMM, 0, h_comm_igather},
  {"gradsync_comm_gatherv", K_COMM, 0, h_comm_gatherv},
  {"gradsync_comm_igatherv", K_COMM, 0, h_comm_igatherv},
  {"gradsync_comm_scatter", K_COMM, 0, h_comm_scatter},
  {"gradsync_comm_iscatter", K_COMM, 0, h_comm_iscatter},
  {"gradsync_comm_scatterv", K_COMM, 0, h_comm_scatterv},
  {"gradsync_comm_iscatterv", K_COMM, 0, h_comm_iscatterv},
  {"gradsync_comm_get_async_error", K_COMM, 0, h_comm_get_async_error},
  {"gradsync_request_wait", K_REQUEST, 0, h_request_wait},
  {"gradsync_request_test", K_REQUEST, 0, h_request_test},
  {"gradsync_comm_alloc", K_COMM, 0, h_comm_alloc},
  {"gradsync_comm_free_buffer", K_COMM, 0, h_comm_free_buffer},
  {"gradsync_shard_create", K_COMM, 0, h_shard_create},
  {"gradsync_table_shape", K_TABLE, 0, h_table_shape},
  {"gradsync_table_created", K_TABLE, 0, h_table_created},
  {"gradsync_table_get", K_TABLE, 0, h_table_get},
  {"gradsync_table_set", K_TABLE, 0, h_table_set},
  {"gradsync_table_gather", K_TABLE, 0, h_table_gather},
  {"gradsync_table_scatter", K_TABLE, 0, h_table_scatter},
  {"gradsync_table_fill_zero", K_TABLE, 0, h_table_fill_zero},
  {"gradsync_table_fill_uniform", K_TABLE, 0, h_table_fill_uniform},
  {"gradsync_table_flush", K_TABLE, 0, h_table_flush},
  {"gradsync_table_prefetch", K_TABLE, 0, h_table_prefetch},
  {"gradsync_table_view", K_TABLE, 0, h_table_view},
  {"gradsync_accum_shape", K_ACCUM, 0, h_accum_shape},
  {"gradsync_accum_get_concurrency", K_ACCUM, 0, h_accum_get_concurrency},
  {"gradsync_accum_add", K_ACCUM, 0, h_accum_add},
  {"gradsync_accum_add_batch", K_ACCUM, 0, h_accum_add_batch},
  {"gradsync_accum_get", K_ACCUM, 0, h_accum_get},
  {"gradsync_accum_zero", K_ACCUM, 0, h_accum_zero},
  {"gradsync_accum_touched_count", K_ACCUM, 0, h_accum_touched_count},
  {"gradsync_accum_touched", K_ACCUM, 0, h_accum_touched},
  {"gradsync_accum_apply", K_ACCUM, 0, h_accum_apply_accum},
  {"gradsync_accum_apply", K_TABLE, 0, h_accum_apply_params},
  {"gradsync_accum_apply", K_TABLE, 1, h_accum_apply_state},
  {"gradsync_accum_flush", K_ACCUM, 0, h_accum_flush},
  {"gradsync_accum_view", K_ACCUM, 0, h_accum_view},
  {"gradsync_shard_part", K_SHARD, 0, h_shard_part},
  {"gradsync_shard_ranges", K_SHARD, 0, h_shard_ranges},
  {"gradsync_shard_memory", K_SHARD, 0, h_shard_memory},
  {"gradsync_shard_updates", K_SHARD, 0, h_shard_updates},
  {"gradsync_shard_set_lr", K_SHARD, 0, h_shard_set_lr},
  {"gradsync_shard_init", K_SHARD, 0, h_shard_init},
  {"gradsync_shard_restore", K_SHARD, 0, h_shard_restore},
  {"gradsync_shard_step", K_SHARD, 0, h_shard_step},
  {"gradsync_shard_put", K_SHARD, 0, h_shard_put},
  {"gradsync_shard_aggregate", K_SHARD, 0, h_shard_aggregate},
  {"gradsync_shard_update", K_SHARD, 0, h_shard_update},
  {"gradsync_shard_read_slice", K_SHARD, 0, h_shard_read_slice},
  {"gradsync_shard_write_weights", K_SHARD, 0, h_shard_write_weights},
  {"gradsync_shard_gather", K_SHARD, 0, h_shard_gather},
};

/* The *_free functions: given anything but their own kind they must log and leave it alone. */
static void f_counter32(void *h) { gradsync_counter32_free(h); }
static void f_counter64(void *h) { gradsync_counter64_free(h); }
static void f_flag(void *h) { gradsync_flag_free(h); }
static void f_mutex(void *h) { gradsync_mutex_free(h); }
static void f_comm(void *h) { gradsync_comm_free(h); }
static void f_table(void *h) { gradsync_table_free(h); }
static void f_accum(void *h) { gradsync_accum_free(h); }
static void f_shard(void *h) { gradsync_shard_free(h); }
static void f_request(void *h) { gradsync_request_free(h); }
static void (*const free_of_kind[K_COUNT])(void *) = {f_counter32, f_counter64, f_flag, f_mutex, f_comm,
                                                       f_table, f_accum, f_shard, f_request};
/* clang-format on */

/* Log lines of expected complaints go to a counter rather than stderr. */
static int logged_errors = 0;
static int32_t initial_log_level;
static void count_errors(void* user_data, int32_t level, const char* message) {
  (void)user_data;
  (void)message;
  if (level >= GRADSYNC_LOG_ERROR) ++logged_errors;
}
static void logs_to_counter(void) {
  CHECK(gradsync_set_log_callback(count_errors, NULL, GRADSYNC_LOG_WARN) == GRADSYNC_OK);
}
static void logs_to_stderr(void) { CHECK(gradsync_set_log_callback(NULL, NULL, initial_log_level) == GRADSYNC_OK); }

static void sweep_handles(void) {
  size_t i;
  int k;
  char text[160];
  for (i = 0; i < sizeof handle_cases / sizeof handle_cases[0]; ++i) {
    const struct handle_case* c = &handle_cases[i];
    /* NULL, memory that is no handle, then every other kind */
    for (k = -2; k < K_COUNT; ++k) {
      void* h = k == -2 ? NULL : k == -1 ? (void*)(uintptr_t)not_a_handle : live[k];
      const char* needle = k == -2 ? "NULL" : k == -1 ? "not a gradsync" : "wrong kind of handle";
      int status;
      if (k == (int)c->takes || (k == -2 && c->null_allowed)) continue;
      snprintf(text, sizeof text, "%s(<%s>)", c->function, k == -2 ? "NULL" : k == -1 ? "not a handle" : kind_names[k]);
      sweep_begin();
      status = c->call(h);
      sweep_end(GRADSYNC_E_MISUSE, status, c->function, text, __LINE__, -1);
      if (status == GRADSYNC_E_MISUSE && !check_message_has(needle))
        sweep_failed(text, __LINE__, "the message does not say what is wrong with the handle");
    }
  }
  /* Frees: NULL is a no-op; any other kind, or no handle at all, is logged and left alone. */
  logs_to_counter();
  for (i = 0; i < K_COUNT; ++i) {
    free_of_kind[i](NULL);
    ++sweep_calls;
    for (k = -1; k < K_COUNT; ++k) {
      const int before = logged_errors;
      if (k == (int)i) continue;
      free_of_kind[i](k == -1 ? (void*)(uintptr_t)not_a_handle : live[k]);
      ++sweep_calls;
      if (logged_errors == before) {
        snprintf(text, sizeof text, "gradsync_%s_free(<%s>)", kind_names[i], k == -1 ? "not a handle" : kind_names[k]);
        sweep_failed(text, __LINE__, "no error was logged for the wrong handle");
      }
    }
  }
  logs_to_stderr();
  /* ... and every handle is still alive */
  CHECK(gradsync_counter32_load(c32, &out.i32[0]) == GRADSYNC_OK);
  CHECK(gradsync_counter64_load(c64, &out.i64[0]) == GRADSYNC_OK);
  CHECK(gradsync_flag_check(flag, &out.i32[0]) == GRADSYNC_OK);
  CHECK(gradsync_mutex_try_lock(mtx, &out.i32[0]) == GRADSYNC_OK && out.i32[0] == 1);
  CHECK(gradsync_mutex_unlock(mtx) == GRADSYNC_OK);
  CHECK(gradsync_comm_barrier(comm) == GRADSYNC_OK);
  CHECK(gradsync_table_shape(table, &out.i64[0], &out.i64[1]) == GRADSYNC_OK && out.i64[0] == 8);
  CHECK(gradsync_accum_shape(accum, &out.i64[0], &out.i64[1]) == GRADSYNC_OK && out.i64[1] == 4);
  CHECK(gradsync_shard_updates(shard, &out.i64[0]) == GRADSYNC_OK);
}

/* ------------------------------------------------------------------ options structs */

/* struct_size and version as a caller's header could have them, right or wrong. Every options
 * struct starts with uint32_t struct_size, uint32_t version. */
struct options_case {
  const char* what;
  int size_kind; /* 0: the value below; 1: version 1's size + delta; 2: sizeof + delta */
  long delta;
  long version_delta; /* added to the library's version; or ... */
  int version_abs;    /* ... if >= 0, this version */
  int tail;           /* a non-zero byte past this library's sizeof */
  int expected;
};
static const struct options_case options_cases[] = {
    {"struct_size 0", 0, 0, 0, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"struct_size 8 (the header only)", 0, 8, 0, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"struct_size one short of version 1", 1, -1, 0, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"struct_size too large for its version", 2, 8, 0, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"struct_size 4097", 0, 4097, 1, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"struct_size UINT32_MAX", 0, -1, 1, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"version 0", 2, 0, 0, 0, 0, GRADSYNC_E_INVALID_ARG},
    {"a newer version that is no larger", 2, 0, 1, -1, 0, GRADSYNC_E_INVALID_ARG},
    {"a newer version that sets an unknown field", 2, 8, 1, -1, 1, GRADSYNC_E_INVALID_ARG},
    {"version UINT32_MAX, its tail 0", 0, 4096, 0, -2, 0, GRADSYNC_OK},
    {"version 1 at version 1's size", 1, 0, 0, 1, 0, GRADSYNC_OK},
};

static union {
  gradsync_table_options table;
  gradsync_accum_options accum;
  gradsync_optimizer optimizer;
  gradsync_comm_options comm;
  gradsync_shard_options shard;
  unsigned char bytes[4200];
} obuf;

/* Writes the case's struct_size and version over the valid struct in obuf. */
static void apply_options_case(const struct options_case* c, size_t v1_size, size_t own_size, uint32_t own_version) {
  uint32_t size, version;
  size = c->size_kind == 1   ? (uint32_t)((long)v1_size + c->delta)
         : c->size_kind == 2 ? (uint32_t)((long)own_size + c->delta)
                             : (uint32_t)c->delta;
  version = c->version_abs == -2  ? UINT32_MAX
            : c->version_abs >= 0 ? (uint32_t)c->version_abs
                                  : own_version + (uint32_t)c->version_delta;
  memset(obuf.bytes + own_size, 0, sizeof obuf.bytes - own_size);
  if (c->tail) obuf.bytes[own_size + 3] = 1;
  memcpy(obuf.bytes, &size, sizeof size);
  memcpy(obuf.bytes + 4, &version, sizeof version);
}

static uint32_t struct_size_of(const void* options) {
  uint32_t size;
  memcpy(&size, options, sizeof size);
  return size;
}

static void report_options_case(const char* function, const char* what, int expected, int status, int line) {
  char text[160];
  snprintf(text, sizeof text, "%s(options with %s)", function, what);
  sweep_end(expected, status, function, text, line, -1);
}

static void sweep_options_structs(void) {
  size_t i;
  for (i = 0; i < sizeof options_cases / sizeof options_cases[0]; ++i) {
    const struct options_case* c = &options_cases[i];
    int status;
    gradsync_table* t = NULL;
    gradsync_accum* a = NULL;
    gradsync_comm* m = NULL;
    gradsync_shard* s = NULL;

    obuf.table = anon_table_options(2, 2);
    apply_options_case(c, offsetof(gradsync_table_options, hi) + sizeof(double), sizeof obuf.table,
                       GRADSYNC_TABLE_OPTIONS_VERSION);
    sweep_begin();
    status = gradsync_table_open(&t, NULL, &obuf.table);
    report_options_case("gradsync_table_open", c->what, c->expected, status, __LINE__);
    if (status != GRADSYNC_OK && t != NULL) sweep_failed("gradsync_table_open", __LINE__, "handle on failure");
    gradsync_table_free(t);

    obuf.accum = anon_accum_options();
    apply_options_case(c, offsetof(gradsync_accum_options, rows_per_lock) + sizeof(int64_t), sizeof obuf.accum,
                       GRADSYNC_ACCUM_OPTIONS_VERSION);
    sweep_begin();
    status = gradsync_accum_open(&a, NULL, &obuf.accum);
    report_options_case("gradsync_accum_open", c->what, c->expected, status, __LINE__);
    if (status != GRADSYNC_OK && a != NULL) sweep_failed("gradsync_accum_open", __LINE__, "handle on failure");
    gradsync_accum_free(a);

    {
      const gradsync_optimizer defaults = GRADSYNC_OPTIMIZER_INIT;
      obuf.optimizer = defaults;
    }
    apply_options_case(c, offsetof(gradsync_optimizer, eps) + sizeof(double), sizeof obuf.optimizer,
                       GRADSYNC_OPTIMIZER_VERSION);
    sweep_begin();
    status = gradsync_accum_apply(accum, params, &obuf.optimizer, NULL);
    report_options_case("gradsync_accum_apply", c->what, c->expected, status, __LINE__);

    obuf.comm = comm_options("capi-sweep-options");
    apply_options_case(c, offsetof(gradsync_comm_options, host), sizeof obuf.comm, GRADSYNC_COMM_OPTIONS_VERSION);
    sweep_begin();
    status = gradsync_comm_create(&m, &obuf.comm);
    report_options_case("gradsync_comm_create", c->what, c->expected, status, __LINE__);
    if (status != GRADSYNC_OK && m != NULL) sweep_failed("gradsync_comm_create", __LINE__, "handle on failure");
    gradsync_comm_free(m);

    {
      const gradsync_shard_options defaults = GRADSYNC_SHARD_OPTIONS_INIT;
      obuf.shard = defaults;
    }
    apply_options_case(c, offsetof(gradsync_shard_options, replicas), sizeof obuf.shard,
                       GRADSYNC_SHARD_OPTIONS_VERSION);
    sweep_begin();
    status = gradsync_shard_create(&s, comm, 10, &obuf.shard);
    report_options_case("gradsync_shard_create", c->what, c->expected, status, __LINE__);
    if (status != GRADSYNC_OK && s != NULL) sweep_failed("gradsync_shard_create", __LINE__, "handle on failure");
    gradsync_shard_free(s);
  }

  /* The *_init functions: NULL, too small, beyond any struct; nothing written on refusal. */
#define SWEEP_INIT(fn, type, v1_size)                                                               \
  do {                                                                                              \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn(NULL, sizeof(type)));                                         \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn((type*)(void*)out.opts, 0));                                  \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn((type*)(void*)out.opts, 8));                                  \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn((type*)(void*)out.opts, (v1_size)-1));                        \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn((type*)(void*)out.opts, 4097));                               \
    EXPECT(GRADSYNC_E_INVALID_ARG, fn((type*)(void*)out.opts, SIZE_MAX));                           \
    EXPECT(GRADSYNC_OK, fn((type*)(void*)out.opts, 4096)); /* a newer header's: tail zeroed */      \
    EXPECT_TRUE(((unsigned char*)out.opts)[4095] == 0 && struct_size_of(out.opts) == sizeof(type)); \
  } while (0)
  SWEEP_INIT(gradsync_table_options_init, gradsync_table_options,
             offsetof(gradsync_table_options, hi) + sizeof(double));
  SWEEP_INIT(gradsync_accum_options_init, gradsync_accum_options,
             offsetof(gradsync_accum_options, rows_per_lock) + sizeof(int64_t));
  SWEEP_INIT(gradsync_optimizer_init, gradsync_optimizer, offsetof(gradsync_optimizer, eps) + sizeof(double));
  SWEEP_INIT(gradsync_comm_options_init, gradsync_comm_options, offsetof(gradsync_comm_options, host));
  SWEEP_INIT(gradsync_shard_options_init, gradsync_shard_options, offsetof(gradsync_shard_options, replicas));
#undef SWEEP_INIT
}

/* ------------------------------------------------------------------ core */

static void sweep_core(void) {
  static const int32_t bad_enums[] = {-1, 0, 6, 7, 99, INT32_MIN, INT32_MAX}; /* no dtype, no feature */
  static const int32_t bad_levels[] = {-1, 7, 99, INT32_MIN, INT32_MAX};
  static const int bad_statuses[] = {1, -20, -99, -101, -1000, INT32_MIN, INT32_MAX};
  size_t i;
  const int32_t level = gradsync_get_log_level();

  for (i = 0; i < sizeof bad_enums / sizeof bad_enums[0]; ++i) {
    if (bad_enums[i] != 0) EXPECT_TRUE(gradsync_dtype_size(bad_enums[i]) == 0);
    EXPECT_TRUE(gradsync_has_feature(bad_enums[i]) == 0);
  }
  for (i = 0; i < sizeof bad_levels / sizeof bad_levels[0]; ++i) {
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_set_log_level(bad_levels[i]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_set_log_callback(count_errors, NULL, bad_levels[i]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_set_log_callback(NULL, NULL, bad_levels[i]));
  }
  EXPECT_TRUE(gradsync_get_log_level() == level); /* refused levels change nothing */
  for (i = 0; i < sizeof bad_statuses / sizeof bad_statuses[0]; ++i)
    EXPECT_TRUE(strcmp(gradsync_status_string(bad_statuses[i]), "unknown status") == 0);
  EXPECT_TRUE(strncmp(gradsync_status_string(GRADSYNC_E_INTERNAL), "GRADSYNC_E_INTERNAL", 19) == 0);
  EXPECT_TRUE(gradsync_version_number() == GRADSYNC_VERSION_NUMBER);
  EXPECT_TRUE(strcmp(gradsync_version_string(), GRADSYNC_VERSION_STRING) == 0);
  EXPECT_TRUE(gradsync_abi_version() == GRADSYNC_ABI_VERSION);
  gradsync_last_error_clear();
  EXPECT_TRUE(gradsync_last_error_message()[0] == '\0' && gradsync_last_error_status() == GRADSYNC_OK);
}

/* ------------------------------------------------------------------ atomics */

static void sweep_atomics(void) {
  gradsync_counter32* n32;
  gradsync_counter64* n64;
  gradsync_flag* nf;
  gradsync_mutex* nm;
  static union {
    double aligned;
    char bytes[64];
  } raw;
  float* top = (float*)(uintptr_t)(UINTPTR_MAX - 7); /* 8 bytes below the end of the address space */
  int32_t v32 = 0;
  int64_t v64 = 0;

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_counter32_create(NULL, INT32_MIN));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_counter64_create(NULL, INT64_MIN));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_flag_create(NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_mutex_create(NULL));
  EXPECT_NEW(GRADSYNC_OK, n32, gradsync_counter32_create(&n32, INT32_MIN));
  EXPECT_NEW(GRADSYNC_OK, n64, gradsync_counter64_create(&n64, INT64_MIN));
  EXPECT_NEW(GRADSYNC_OK, nf, gradsync_flag_create(&nf));
  EXPECT_NEW(GRADSYNC_OK, nm, gradsync_mutex_create(&nm));

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_counter32_load(n32, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_counter64_load(n64, NULL));
  /* wrapping at the extremes is defined, and NULL out-parameters are allowed */
  EXPECT(GRADSYNC_OK, gradsync_counter32_fetch_add(n32, INT32_MIN, NULL, NULL));
  EXPECT_TRUE(gradsync_counter32_load(n32, &v32) == GRADSYNC_OK && v32 == 0);
  EXPECT(GRADSYNC_OK, gradsync_counter32_store(n32, INT32_MAX));
  EXPECT_TRUE(gradsync_counter32_fetch_add(n32, INT32_MAX, NULL, &v32) == GRADSYNC_OK && v32 == -2);
  EXPECT(GRADSYNC_OK, gradsync_counter64_fetch_add(n64, INT64_MIN, NULL, NULL));
  EXPECT_TRUE(gradsync_counter64_load(n64, &v64) == GRADSYNC_OK && v64 == 0);
  EXPECT(GRADSYNC_OK, gradsync_counter64_store(n64, INT64_MAX));
  EXPECT_TRUE(gradsync_counter64_fetch_add(n64, INT64_MAX, NULL, &v64) == GRADSYNC_OK && v64 == -2);

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_flag_check(nf, NULL));
  EXPECT(GRADSYNC_OK, gradsync_flag_conditional_set(nf, INT32_MIN, NULL)); /* any non-zero condition sets */
  EXPECT_TRUE(gradsync_flag_check(nf, &v32) == GRADSYNC_OK && v32 == 1);

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_mutex_try_lock(nm, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_mutex_lock_timeout(nm, -1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_mutex_lock_timeout(nm, INT64_MIN));
  EXPECT(GRADSYNC_E_NOT_OWNER, gradsync_mutex_unlock(nm));
  EXPECT(GRADSYNC_OK, gradsync_mutex_lock_timeout(nm, INT64_MAX));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_mutex_lock(nm)); /* would deadlock */
  EXPECT(GRADSYNC_E_MISUSE, gradsync_mutex_try_lock(nm, &out.i32[0]));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_mutex_lock_timeout(nm, INT64_MAX));
  EXPECT(GRADSYNC_OK, gradsync_mutex_unlock(nm));
  EXPECT(GRADSYNC_E_NOT_OWNER, gradsync_mutex_unlock(nm));

  EXPECT(GRADSYNC_OK, gradsync_atomic_add_f32(NULL, NULL, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(NULL, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(out.f32, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(out.f32, in_f32, SIZE_MAX));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(out.f32, in_f32, SIZE_MAX / 4 + 2)); /* n * 4 wraps to 4 */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(out.f32, out.f32 + 1, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(out.f32, out.f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32((float*)(void*)(raw.bytes + 1), in_f32, 2));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f32(top, in_f32, 4));
  EXPECT(GRADSYNC_OK, gradsync_atomic_add_f64(NULL, NULL, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64(NULL, in_f64, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64(out.f64, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64(out.f64, in_f64, SIZE_MAX));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64(out.f64, in_f64, SIZE_MAX / 8 + 2)); /* n * 8 wraps to 8 */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64(out.f64 + 1, out.f64, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64((double*)(void*)(raw.bytes + 4), in_f64, 2));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_atomic_add_f64((double*)(void*)top, in_f64, 2));

  EXPECT(GRADSYNC_OK, gradsync_mutex_lock(nm));
  logs_to_counter();       /* its warning goes there */
  gradsync_mutex_free(nm); /* freeing a locked mutex is allowed */
  ++sweep_calls;
  logs_to_stderr();
  gradsync_flag_free(nf);
  gradsync_counter64_free(n64);
  gradsync_counter32_free(n32);
}

/* ------------------------------------------------------------------ data-parallel helpers */

static void sweep_dataparallel(void) {
  const float* grads[2] = {in_f32, in_f32 + 4};
  const float* null_grad[2] = {NULL, in_f32};
  const size_t lens[2] = {4, 4}, lens_short[2] = {4, 3};
  const uint64_t counts[2] = {1, 3}, zero_counts[2] = {0, 0}, huge_counts[2] = {UINT64_MAX, 1};
  const double losses[2] = {0.5, 1.5};
  size_t needed = 0;

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_partition(10, 0, 0, &out.u64[0], &out.u64[1]));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_partition(10, 3, 3, &out.u64[0], &out.u64[1]));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_partition(10, 3, UINT32_MAX, &out.u64[0], &out.u64[1]));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_partition(10, 3, 0, NULL, &out.u64[1]));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_partition(10, 3, 0, &out.u64[0], NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_partition(UINT64_MAX, 0, UINT32_MAX, NULL, NULL));
  EXPECT(GRADSYNC_OK, gradsync_partition(UINT64_MAX, UINT32_MAX, UINT32_MAX - 1, &out.u64[0], &out.u64[1]));
  EXPECT_TRUE(out.u64[0] + out.u64[1] == UINT64_MAX); /* the last part ends at n */
  EXPECT(GRADSYNC_OK, gradsync_partition(0, UINT32_MAX, 7, &out.u64[0], &out.u64[1]));
  EXPECT_TRUE(out.u64[0] == 0 && out.u64[1] == 0);

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_split_round_robin(10, 0, 0, out.u64, 16, &needed));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_split_round_robin(10, 3, 3, out.u64, 16, &needed));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_split_round_robin(10, 3, UINT32_MAX, out.u64, 16, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_split_round_robin(10, 3, 0, out.u64, 16, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_split_round_robin(10, 3, 0, NULL, 16, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_split_round_robin(10, 3, 0, NULL, SIZE_MAX, &needed));
  EXPECT(GRADSYNC_E_BUFS, gradsync_split_round_robin(10, 3, 0, out.u64, 3, &needed));
  EXPECT_TRUE(needed == 4);
  EXPECT(GRADSYNC_E_BUFS, gradsync_split_round_robin(UINT64_MAX, 1, 0, NULL, 0, &needed));
  EXPECT_TRUE(needed == SIZE_MAX);
  EXPECT(GRADSYNC_E_BUFS, gradsync_split_round_robin(UINT64_MAX, UINT32_MAX, 0, out.u64, 16, &needed));
  EXPECT(GRADSYNC_OK, gradsync_split_round_robin(0, UINT32_MAX, UINT32_MAX - 1, NULL, 0, &needed));
  EXPECT_TRUE(needed == 0);
  EXPECT(GRADSYNC_OK, gradsync_split_round_robin(10, 3, 2, out.u64, SIZE_MAX, &needed)); /* writes 3 */
  EXPECT_TRUE(needed == 3 && out.u64[2] == 8 && out.u64[3] == UINT64_C(0xA5A5A5A5A5A5A5A5));

  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, lens, counts, losses, 0, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(NULL, lens, counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, NULL, counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, lens, NULL, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, lens, counts, NULL, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, NULL, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(null_grad, lens, counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_MISMATCH,
         gradsync_weighted_merge_f32(grads, lens_short, counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_MISMATCH,
         gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out.f32, SIZE_MAX, &out.f64[0], &out.u64[0]));
  /* workers is checked against each length before the next entry is read: the first one differs */
  EXPECT(GRADSYNC_E_MISMATCH,
         gradsync_weighted_merge_f32(grads, lens_short + 1, counts, losses, SIZE_MAX, out.f32, 4, NULL, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_weighted_merge_f32(grads, lens, huge_counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_ZERO_WEIGHT,
         gradsync_weighted_merge_f32(grads, lens, zero_counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
  EXPECT(GRADSYNC_E_MISMATCH, gradsync_weighted_merge_f32(grads, lens, counts, NULL, 2, NULL, 0, NULL, NULL));
  EXPECT(GRADSYNC_OK,
         gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out.f32, 4, &out.f64[0], &out.u64[0]));
}

/* ------------------------------------------------------------------ codecs */

static void sweep_codecs(void) {
  static const int32_t bad_codecs[] = {GRADSYNC_CODEC_NONE, -1, 4, 99, INT32_MIN, INT32_MAX};
  size_t i;
  for (i = 0; i < sizeof bad_codecs / sizeof bad_codecs[0]; ++i) {
    const int32_t c = bad_codecs[i];
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_encode(c, in_f32, 4, out.enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, 0, out.f32, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, 4, 0, in_enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, 4, 0, in_enc, 4));
  }
  for (i = GRADSYNC_CODEC_BIGDL_FP16; i <= GRADSYNC_CODEC_FP16; ++i) {
    const int32_t c = (int32_t)i;
    EXPECT(GRADSYNC_OK, gradsync_codec_encode(c, NULL, 0, NULL, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_encode(c, NULL, 4, out.enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_encode(c, in_f32, 4, NULL, 4));
    EXPECT(GRADSYNC_E_BUFS, gradsync_codec_encode(c, in_f32, 4, out.enc, 3));
    EXPECT(GRADSYNC_E_BUFS, gradsync_codec_encode(c, in_f32, 4, NULL, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_encode(c, in_f32, SIZE_MAX, out.enc, SIZE_MAX));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_encode(c, in_f32, SIZE_MAX / 2 + 1, out.enc, 64));

    EXPECT(GRADSYNC_OK, gradsync_codec_decode(c, NULL, 0, 0, NULL, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, NULL, 4, 0, out.f32, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, 0, NULL, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, 1, out.f32, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, 5, out.f32, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, SIZE_MAX, out.f32, 1));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, 4, 2, out.f32, SIZE_MAX)); /* 2 + SIZE_MAX wraps */
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_decode(c, in_enc, SIZE_MAX, SIZE_MAX - 1, out.f32, 1));

    EXPECT(GRADSYNC_OK, gradsync_codec_add(c, NULL, 0, 0, NULL, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, NULL, 4, 0, in_enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, 4, 0, NULL, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, 4, 1, in_enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, 4, SIZE_MAX, in_enc, 2));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, 4, 3, in_enc, SIZE_MAX));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_add(c, out.enc, SIZE_MAX, 0, in_enc, 4));

    EXPECT(GRADSYNC_OK, gradsync_codec_accumulate(c, NULL, 0, 0, NULL, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, NULL, 4, 0, in_enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, 4, 0, NULL, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, 4, 1, in_enc, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, 4, SIZE_MAX, in_enc, 2));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, 4, 3, in_enc, SIZE_MAX));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_codec_accumulate(c, out.f32, SIZE_MAX, 0, in_enc, 4));
  }
}

/* ------------------------------------------------------------------ tables */

/* The 32 floats of `t` (8 x 4), to see that a refused call changed nothing. */
static void table_contents(gradsync_table* t, float* into) {
  CHECK(gradsync_table_gather(t, (const int64_t[]){0, 1, 2, 3, 4, 5, 6, 7}, 8, into, 32) == GRADSYNC_OK);
}

static void sweep_tables(void) {
  static const int32_t bad_modes[] = {0, 5, -1, INT32_MIN, INT32_MAX};
  gradsync_table_options o;
  gradsync_table* t = NULL;
  float before[32], after[32];
  char missing[300], long_path[5000];
  size_t i;

  /* open: every field wrong in turn */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_open(NULL, NULL, NULL));
  o = anon_table_options(8, 4);
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_open(NULL, NULL, &o));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, NULL));     /* default mode needs a path */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, table_path, &o)); /* anonymous has none */
  for (i = 0; i < sizeof bad_modes / sizeof bad_modes[0]; ++i) {
    o = anon_table_options(8, 4);
    o.mode = bad_modes[i];
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  }
  o = anon_table_options(8, 4), o.read_only = 2;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.read_only = 1; /* read-only is for mode OPEN */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(0, 4);
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(-1, 4);
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(GRADSYNC_UNSET_I64, 4); /* creating needs rows */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 0);
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, INT64_MIN + 1);
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(INT64_MAX, INT64_MAX); /* rows * dim overflows */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options((int64_t)1 << 32, (int64_t)1 << 32); /* rows * dim = 2^64 wraps to 0 */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(INT64_MAX / 2, 2); /* elements fit, bytes do not */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.dtype = GRADSYNC_F64;
  EXPECT_NEW(GRADSYNC_E_UNSUPPORTED, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.dtype = 99;
  EXPECT_NEW(ANY_ERROR, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.init = 2;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.init = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.lo = NAN;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.hi = INFINITY;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.lo = 1, o.hi = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.init = GRADSYNC_TABLE_INIT_UNIFORM, o.lo = -1e300; /* finite, but not as a float */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.hi = 1e39;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.file_mode = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.file_mode = 01000;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));
  o = anon_table_options(8, 4), o.allow_other_owner = 2;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, NULL, &o));

  /* paths: empty, missing, not a file, too long, the wrong kind of file, another shape */
  snprintf(missing, sizeof missing, "%s/no/such/dir/t.gst", dir);
  memset(long_path, 'x', sizeof long_path - 1);
  long_path[0] = '/';
  long_path[sizeof long_path - 1] = '\0';
  o = anon_table_options(8, 4), o.mode = GRADSYNC_TABLE_CREATE_OR_OPEN;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, "", &o));
  EXPECT_NEW(GRADSYNC_E_IO, t, gradsync_table_open(&t, missing, &o));
  EXPECT_NEW(ANY_ERROR, t, gradsync_table_open(&t, dir, &o));
  EXPECT_NEW(ANY_ERROR, t, gradsync_table_open(&t, long_path, &o));
  EXPECT_NEW(GRADSYNC_E_MISMATCH, t, gradsync_table_open(&t, accum_path, &o));
  o.dim = 5;
  EXPECT_NEW(GRADSYNC_E_MISMATCH, t, gradsync_table_open(&t, table_path, &o));
  o.mode = GRADSYNC_TABLE_CREATE;
  EXPECT_NEW(GRADSYNC_E_IO, t, gradsync_table_open(&t, table_path, &o)); /* exists */
  o.mode = GRADSYNC_TABLE_OPEN, o.rows = GRADSYNC_UNSET_I64, o.dim = GRADSYNC_UNSET_I64;
  EXPECT_NEW(GRADSYNC_E_IO, t, gradsync_table_open(&t, missing, &o));
  EXPECT_NEW(ANY_ERROR, t, gradsync_table_open(&t, "/dev/null", &o));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, t, gradsync_table_open(&t, table_path + strlen(table_path), &o));
  EXPECT_TRUE(access(missing, F_OK) != 0);
  /* 2^61 bytes: representable, never available; a file that cannot be made leaves nothing behind */
  o = anon_table_options((int64_t)1 << 39, (int64_t)1 << 20);
  EXPECT_NEW(GRADSYNC_E_NOMEM, t, gradsync_table_open(&t, NULL, &o));
  o.mode = GRADSYNC_TABLE_CREATE;
  snprintf(missing, sizeof missing, "%s/huge.gst", dir);
  EXPECT_NEW(ANY_ERROR, t, gradsync_table_open(&t, missing, &o));
  EXPECT_TRUE(access(missing, F_OK) != 0);

  /* queries */
  EXPECT(GRADSYNC_OK, gradsync_table_shape(table, NULL, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_created(table, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_view(table, NULL, &out.sz[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_view(table, &out.view, NULL));

  /* rows: ids and counts out of range, NULL buffers, counts whose n * dim overflows */
  CHECK(gradsync_table_fill_uniform(table, 7, -1.0f, 1.0f) == GRADSYNC_OK);
  table_contents(table, before);
  {
    static const int64_t bad_rows[] = {-1, 8, INT64_MIN, INT64_MAX};
    static const size_t bad_counts[] = {0, 3, 5, SIZE_MAX};
    for (i = 0; i < 4; ++i) {
      EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_get(table, bad_rows[i], out.f32, 4));
      EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_set(table, bad_rows[i], in_f32, 4));
      EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_get(table, 0, out.f32, bad_counts[i]));
      EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_set(table, 0, in_f32, bad_counts[i]));
    }
  }
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_get(table, 0, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_set(table, 0, NULL, 4));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_gather(table, ids_bad_last, 4, out.f32, 16));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_gather(table, ids_negative, 1, out.f32, 4));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_gather(table, ids_min, 1, out.f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, NULL, 1, out.f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, ids_ok, 1, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, ids_ok, 4, out.f32, 15));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, ids_ok, (SIZE_MAX / 4) + 1, out.f32, 0)); /* wraps to 0 */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, ids_ok, (SIZE_MAX / 4) + 2, out.f32, 4)); /* wraps to 4 */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_gather(table, ids_ok, SIZE_MAX, out.f32, SIZE_MAX));
  EXPECT(GRADSYNC_OK, gradsync_table_gather(table, NULL, 0, NULL, 0));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_scatter(table, ids_bad_last, 4, in_f32, 16));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_scatter(table, ids_min, 1, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_scatter(table, NULL, 1, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_scatter(table, ids_ok, 1, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_scatter(table, ids_ok, 4, in_f32, 17));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_scatter(table, ids_ok, (SIZE_MAX / 4) + 2, in_f32, 4));
  EXPECT(GRADSYNC_OK, gradsync_table_scatter(table, NULL, 0, NULL, 0));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_prefetch(table, ids_bad_last, 4));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_prefetch(table, ids_min, 1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_prefetch(table, NULL, 1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_prefetch(table, NULL, SIZE_MAX));
  EXPECT(GRADSYNC_OK, gradsync_table_prefetch(table, NULL, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_fill_uniform(table, 1, NAN, 1.0f));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_fill_uniform(table, 1, 0.0f, INFINITY));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_fill_uniform(table, 1, -INFINITY, 0.0f));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_table_fill_uniform(table, UINT64_MAX, 1.0f, -1.0f));
  table_contents(table, after);
  EXPECT_TRUE(memcmp(before, after, sizeof before) == 0); /* no refused call wrote a row */

  /* values read from the table's own view, overlapping the rows they overwrite */
  {
    const void* view = NULL;
    size_t bytes = 0;
    CHECK(gradsync_table_view(table, &view, &bytes) == GRADSYNC_OK && bytes == sizeof before);
    EXPECT(GRADSYNC_OK, gradsync_table_set(table, 0, (const float*)view + 1, 4));
    EXPECT(GRADSYNC_OK, gradsync_table_set(table, 2, (const float*)view + 8, 4));
    EXPECT(GRADSYNC_OK, gradsync_table_scatter(table, ids_ok + 1, 2, (const float*)view + 2, 8));
    /* b = the floats before: row 0 = b[1..4]; row 2 as it was; then row 1 from the floats [2, 6)
     * as they are by then, and row 2 from [6, 10) as they are after row 1 was written */
    {
      const float* b = before;
      const float expect[12] = {b[1], b[2], b[3], b[4], b[3], b[4], b[4], b[5], b[4], b[5], b[8], b[9]};
      table_contents(table, after);
      EXPECT_TRUE(memcmp(after, expect, sizeof expect) == 0);
      EXPECT_TRUE(memcmp(after + 12, before + 12, 20 * sizeof(float)) == 0);
    }
  }

  /* a read-only table refuses every write, and the file is left as it was */
  table_contents(read_only, before);
  EXPECT(GRADSYNC_E_MISUSE, gradsync_table_set(read_only, 0, in_f32, 4));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_table_scatter(read_only, ids_ok, 4, in_f32, 16));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_table_fill_zero(read_only));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_table_fill_uniform(read_only, 1, -1.0f, 1.0f));
  EXPECT(GRADSYNC_OK, gradsync_table_flush(read_only)); /* a no-op */
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_table_prefetch(read_only, ids_bad_last, 4));
  table_contents(read_only, after);
  EXPECT_TRUE(memcmp(before, after, sizeof before) == 0);
}

/* ------------------------------------------------------------------ accumulator */

static int64_t touched_count(void) {
  int64_t n = -1;
  CHECK(gradsync_accum_touched_count(accum, &n) == GRADSYNC_OK);
  return n;
}

static void sweep_accumulator(void) {
  static const int32_t bad_modes[] = {0, 5, -1, INT32_MIN, INT32_MAX};
  static const int64_t bad_rows[] = {-1, 8, INT64_MIN, INT64_MAX};
  static const size_t bad_counts[] = {0, 3, 5, SIZE_MAX};
  gradsync_accum_options o;
  gradsync_optimizer opt;
  gradsync_accum* a = NULL;
  float params_before[32], params_after[32];
  size_t i, needed = 0;

  /* open */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_open(NULL, NULL, NULL));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, NULL));
  o = anon_accum_options();
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, accum_path, &o));
  for (i = 0; i < sizeof bad_modes / sizeof bad_modes[0]; ++i) {
    o = anon_accum_options(), o.mode = bad_modes[i];
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  }
  o = anon_accum_options(), o.concurrency = 4;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.concurrency = GRADSYNC_ACCUM_OWNER, o.threads = 65;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.concurrency = GRADSYNC_ACCUM_OWNER, o.threads = -2;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.concurrency = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.concurrency = INT32_MAX;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows = GRADSYNC_UNSET_I64;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows = INT64_MAX;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows = (int64_t)1 << 59; /* the touched set's region does not fit */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.dim = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.dim = INT64_MAX; /* rows * dim overflows */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows_per_lock = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.rows_per_lock = -5;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, NULL, &o));
  o = anon_accum_options(), o.mode = GRADSYNC_TABLE_OPEN;
  EXPECT_NEW(GRADSYNC_E_MISMATCH, a, gradsync_accum_open(&a, table_path, &o)); /* a plain table's file */
  o.dim = 5;
  EXPECT_NEW(GRADSYNC_E_MISMATCH, a, gradsync_accum_open(&a, accum_path, &o));
  o.dim = 4, o.mode = GRADSYNC_TABLE_CREATE;
  EXPECT_NEW(GRADSYNC_E_IO, a, gradsync_accum_open(&a, accum_path, &o));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, a, gradsync_accum_open(&a, "", &o));

  /* queries */
  EXPECT(GRADSYNC_OK, gradsync_accum_shape(accum, NULL, NULL));
  EXPECT(GRADSYNC_OK, gradsync_accum_get_concurrency(accum, NULL, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_touched_count(accum, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_touched(accum, out.i64, 16, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_touched(accum, NULL, 16, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_touched(accum, NULL, SIZE_MAX, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_view(accum, NULL, &out.sz[0]));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_view(accum, &out.view, NULL));

  /* adds: nothing is added or touched by a refused one */
  CHECK(gradsync_accum_zero(accum) == GRADSYNC_OK);
  for (i = 0; i < 4; ++i) {
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_accum_add(accum, bad_rows[i], in_f32, 4));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_accum_get(accum, bad_rows[i], out.f32, 4));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add(accum, 0, in_f32, bad_counts[i]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_get(accum, 0, out.f32, bad_counts[i]));
  }
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add(accum, 0, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_get(accum, 0, NULL, 4));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_accum_add_batch(accum, ids_bad_last, 4, in_f32, 16));
  EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_accum_add_batch(accum, ids_min, 1, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add_batch(accum, NULL, 1, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add_batch(accum, ids_ok, 1, NULL, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add_batch(accum, ids_ok, 4, in_f32, 15));
  EXPECT(GRADSYNC_OK, gradsync_accum_add_batch(accum, NULL, 0, NULL, 0));
  /* n * dim overflows: refused before any of the n ids (past the 4 there are) is read */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add_batch(accum, ids_ok, (SIZE_MAX / 4) + 2, in_f32, 4));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_add_batch(accum, ids_ok, SIZE_MAX, in_f32, SIZE_MAX));
  EXPECT_TRUE(touched_count() == 0);

  /* touched: capacity too small copies nothing and reports the size */
  CHECK(gradsync_accum_add_batch(accum, ids_ok, 3, in_f32, 12) == GRADSYNC_OK);
  EXPECT(GRADSYNC_E_BUFS, gradsync_accum_touched(accum, out.i64, 2, &needed));
  EXPECT_TRUE(needed == 3);
  EXPECT(GRADSYNC_E_BUFS, gradsync_accum_touched(accum, NULL, 0, &needed));
  EXPECT(GRADSYNC_OK, gradsync_accum_touched(accum, out.i64, SIZE_MAX, &needed)); /* writes 3 */
  EXPECT_TRUE(needed == 3 && out.i64[2] == 2 && out.i64[3] == (int64_t)UINT64_C(0xA5A5A5A5A5A5A5A5));

  /* apply: every refusal leaves the parameters and the touched rows as they were */
  CHECK(gradsync_table_fill_uniform(params, 3, -1.0f, 1.0f) == GRADSYNC_OK);
  table_contents(params, params_before);
  opt = (gradsync_optimizer)GRADSYNC_OPTIMIZER_INIT;
  EXPECT(GRADSYNC_E_MISMATCH, gradsync_accum_apply(accum, narrow, &opt, NULL));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_accum_apply(accum, read_only, &opt, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state)); /* SGD keeps no state */
  /* common.h: the optimizers apply does not take give GRADSYNC_E_UNSUPPORTED */
  opt.kind = GRADSYNC_OPTIM_ADAMW;
  EXPECT(GRADSYNC_E_UNSUPPORTED, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.kind = GRADSYNC_OPTIM_MOMENTUM;
  EXPECT(GRADSYNC_E_UNSUPPORTED, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.kind = 99;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.kind = -1;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.kind = INT32_MIN;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt = (gradsync_optimizer)GRADSYNC_OPTIMIZER_INIT, opt.reserved0 = 1;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt = (gradsync_optimizer)GRADSYNC_OPTIMIZER_INIT, opt.lr = NAN;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.lr = -INFINITY;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL));
  opt.lr = 1e300;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL)); /* inf as a float */
  opt = (gradsync_optimizer)GRADSYNC_OPTIMIZER_INIT, opt.kind = GRADSYNC_OPTIM_ROW_ADAGRAD;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL)); /* needs state */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, params));
  EXPECT(GRADSYNC_E_MISMATCH, gradsync_accum_apply(accum, params, &opt, narrow));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_accum_apply(accum, params, &opt, read_only));
  opt.eps = -1;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state));
  opt.eps = NAN;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state));
  opt.eps = 1e-300;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state)); /* 0 as a float */
  /* Adam: a state table of rows x (2 * dim + 1), betas in [0, 1) */
  opt = (gradsync_optimizer)GRADSYNC_OPTIMIZER_INIT, opt.kind = GRADSYNC_OPTIM_ADAM;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, NULL)); /* needs state */
  EXPECT(GRADSYNC_E_MISMATCH, gradsync_accum_apply(accum, params, &opt, state));   /* rows x 1 */
  opt.beta1 = 1.0;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state));
  opt.beta1 = 0.9, opt.beta2 = -0.5;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state));
  opt.beta2 = NAN;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_accum_apply(accum, params, &opt, state));
  table_contents(params, params_after);
  EXPECT_TRUE(memcmp(params_before, params_after, sizeof params_before) == 0);
  EXPECT_TRUE(touched_count() == 3);
  CHECK(gradsync_accum_zero(accum) == GRADSYNC_OK);
}

/* ------------------------------------------------------------------ communicator */

static void sweep_comm(void) {
  static const int32_t bad_dtypes[] = {-1, 6, 99, INT32_MIN, INT32_MAX};
  static const int32_t bad_ops[] = {-1, 4, INT32_MIN, INT32_MAX};
  static const int32_t bad_roots[] = {-1, 1, INT32_MIN, INT32_MAX};
  gradsync_comm_options o;
  gradsync_comm* m = NULL;
  void* buffer = NULL;
  size_t i;

  /* grow and join: arguments this member judges alone, before anything starts */
  {
    gradsync_grow_result r;
    char long_name[80];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, NULL, 1, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "", 1, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, long_name, 1, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", 0, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", -1, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", INT32_MIN, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", INT32_MAX, &m, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", 1024, &m, NULL));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_grow(comm, "capi-sweep-grow", 1, NULL, NULL));
    memset(&r, 0, sizeof r);
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", 1, &m, &r));
    r.struct_size = sizeof r;
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_grow(comm, "capi-sweep-grow", 1, &m, &r));
    o = comm_options("capi-sweep-join");
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_join(NULL, &o, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, NULL, NULL));
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, &o, &r));
    o.rank = 1;
    EXPECT_NEW(GRADSYNC_E_OUT_OF_RANGE, m, gradsync_comm_join(&m, &o, NULL));
    o.rank = -1;
    EXPECT_NEW(GRADSYNC_E_OUT_OF_RANGE, m, gradsync_comm_join(&m, &o, NULL));
    o = comm_options("capi-sweep-join"), o.size = 1024;
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, &o, NULL));
    o = comm_options("capi-sweep-join"), o.transport = 4;
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, &o, NULL));
    o = comm_options("capi-sweep-join"), o.timeout_ms = 0;
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, &o, NULL));
    o = comm_options("");
    EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_join(&m, &o, NULL));
  }

  /* create */
  o = comm_options("capi-sweep-create");
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_create(NULL, &o));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, NULL));
  o.transport = 4;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.transport = 7;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.transport = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.transport = INT32_MIN;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("capi-sweep-create"), o.size = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.size = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.size = GRADSYNC_UNSET_I32;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.size = INT32_MAX;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.size = 1025;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.transport = GRADSYNC_TRANSPORT_SHM;
  o.size = INT32_MAX;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("capi-sweep-create");
  o.rank = -1;
  EXPECT_NEW(GRADSYNC_E_OUT_OF_RANGE, m, gradsync_comm_create(&m, &o));
  o.rank = 1;
  EXPECT_NEW(GRADSYNC_E_OUT_OF_RANGE, m, gradsync_comm_create(&m, &o));
  o.rank = INT32_MAX;
  EXPECT_NEW(GRADSYNC_E_OUT_OF_RANGE, m, gradsync_comm_create(&m, &o));
  o.rank = GRADSYNC_UNSET_I32;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("");
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("x"), memset(o.name, 'x', sizeof o.name); /* not NUL-terminated */
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("capi-sweep-create");
  o.timeout_ms = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.timeout_ms = -1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o.timeout_ms = INT64_MIN + 1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("capi-sweep-create"), o.reserved0 = 1;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  o = comm_options("capi-sweep-create"), o.reserved0 = INT32_MIN;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, m, gradsync_comm_create(&m, &o));
  /* a group whose other rank never comes: a timeout, not a hang */
  o = comm_options("capi-sweep-alone"), o.size = 2, o.timeout_ms = 1;
  EXPECT_NEW(GRADSYNC_E_TIMEOUT, m, gradsync_comm_create(&m, &o));
  o.transport = GRADSYNC_TRANSPORT_SHM;
  EXPECT_NEW(GRADSYNC_E_TIMEOUT, m, gradsync_comm_create(&m, &o));
  /* a timeout without end, and a name that tries to leave /dev/shm, are fine */
  o = comm_options("../../tmp/capi-sweep-escape"), o.transport = GRADSYNC_TRANSPORT_SHM, o.timeout_ms = INT64_MAX;
  EXPECT_NEW(GRADSYNC_OK, m, gradsync_comm_create(&m, &o));
  EXPECT_TRUE(access("/tmp/capi-sweep-escape", F_OK) != 0);
  gradsync_comm_free(m);

  /* getters */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_rank(comm, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_size(comm, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_transport(comm, NULL));
  EXPECT(GRADSYNC_OK, gradsync_comm_set_interrupt(comm, NULL, NULL));

  /* collectives: bad dtypes and ops, NULL buffers, counts too large */
  for (i = 0; i < sizeof bad_dtypes / sizeof bad_dtypes[0]; ++i) {
    const int32_t d = bad_dtypes[i];
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_f32, out.f32, 4, d, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_allreduce_many(comm, NULL, (void* const[]){out.f32}, (const size_t[]){4}, 1, d, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_allreduce_mixed(comm, NULL, (void* const[]){out.f32, out.f32}, (const size_t[]){4, 4},
                                         (const int32_t[]){GRADSYNC_F32, d}, 2, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, d, 1, &out.u64[0]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_broadcast(comm, out.f32, 4, d, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, in_f32, out.f32, 4, d));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgatherv(comm, in_f32, out.f32, (const size_t[]){4}, d));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_reduce_scatterv(comm, in_f32, out.f32, (const size_t[]){4}, d, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce_scatter(comm, in_f32, out.f32, 4, d, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, in_f32, out.f32, 4, d));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, in_f32, four, NULL, out.f32, four, NULL, d));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce(comm, in_f32, out.f32, 4, d, GRADSYNC_SUM, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_gather(comm, in_f32, out.f32, 4, d, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_gatherv(comm, in_f32, 4, out.f32, four, d, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_scatter(comm, in_f32, out.f32, 4, d, 0));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_scatterv(comm, in_f32, four, out.f32, 4, d, 0));
  }
  for (i = 0; i < sizeof bad_ops / sizeof bad_ops[0]; ++i) {
    const int32_t op = bad_ops[i];
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_f32, out.f32, 4, GRADSYNC_F32, op));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce_many(comm, NULL, (void* const[]){out.f32},
                                                                (const size_t[]){4}, 1, GRADSYNC_F32, op));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce_scatter(comm, in_f32, out.f32, 4, GRADSYNC_F32, op));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce(comm, in_f32, out.f32, 4, GRADSYNC_F32, op, 0));
  }
  for (i = 0; i < sizeof bad_roots / sizeof bad_roots[0]; ++i) {
    const int32_t root = bad_roots[i];
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_broadcast(comm, out.f32, 4, GRADSYNC_F32, root));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_reduce(comm, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM, root));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_gather(comm, in_f32, out.f32, 4, GRADSYNC_F32, root));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_gatherv(comm, in_f32, 4, out.f32, four, GRADSYNC_F32, root));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_scatter(comm, in_f32, out.f32, 4, GRADSYNC_F32, root));
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_comm_scatterv(comm, in_f32, four, out.f32, 4, GRADSYNC_F32, root));
  }
  /* the exchange's counts and displacements: NULL, overflowing, disagreeing; overlapping buffers */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, in_f32, NULL, NULL, out.f32, four, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, in_f32, four, NULL, out.f32, NULL, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, in_f32, four, (const size_t[]){SIZE_MAX - 1}, out.f32,
                                                         four, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, in_f32, (const size_t[]){SIZE_MAX / 2}, NULL, out.f32,
                                                         four, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoallv(comm, NULL, four, NULL, out.f32, four, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_alltoallv(comm, out.f32, four, NULL, out.f32 + 2, four, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_MISMATCH,
         gradsync_comm_alltoallv(comm, in_f32, four, NULL, out.f32, (const size_t[]){3}, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_gatherv(comm, in_f32, 4, out.f32, NULL, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_scatterv(comm, in_f32, NULL, out.f32, 4, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_gather(comm, in_f32, out.f32, SIZE_MAX / 2, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_gather(comm, in_f32, NULL, 4, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_scatter(comm, NULL, out.f32, 4, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce(comm, in_f32, NULL, 4, GRADSYNC_F32, GRADSYNC_SUM, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce(comm, out.f32, out.f32 + 1, 4, GRADSYNC_F32, GRADSYNC_SUM, 0));

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, NULL, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_f32, NULL, 4, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_f32, out.f32, SIZE_MAX, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce(comm, in_f32, out.f32, SIZE_MAX / 4 + 1, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_OK, gradsync_comm_allreduce(comm, NULL, NULL, 0, GRADSYNC_F32, GRADSYNC_SUM));

  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_many(comm, NULL, NULL, (const size_t[]){4}, 1, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_many(comm, NULL, (void* const[]){out.f32}, NULL, 1, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_many(comm, NULL, NULL, NULL, SIZE_MAX, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce_many(comm, NULL, NULL, NULL, GRADSYNC_MAX_FUSED_BUFFERS + 1,
                                                              GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce_mixed(comm, NULL, (void* const[]){out.f32},
                                                               (const size_t[]){4}, NULL, 1, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_mixed(comm, NULL, (void* const[]){out.f32}, (const size_t[]){4},
                                       (const int32_t[]){GRADSYNC_F32}, 1, 9));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_mixed(comm, NULL, NULL, NULL, NULL, GRADSYNC_MAX_FUSED_BUFFERS + 1, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgatherv(comm, in_f32, out.f32, NULL, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_reduce_scatterv(comm, in_f32, out.f32, NULL, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_reduce_scatterv(comm, in_f32, out.f32, (const size_t[]){4}, GRADSYNC_F32, 9));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgatherv(comm, in_f32, NULL, (const size_t[]){4}, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allgatherv(comm, in_f32, out.f32, (const size_t[]){SIZE_MAX / 2}, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_many(comm, NULL, (void* const[]){out.f32, out.f32 + 4}, (const size_t[]){4, SIZE_MAX},
                                      2, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce_many(comm, NULL, (void* const[]){out.f32, NULL},
                                                              (const size_t[]){4, 4}, 2, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_allreduce_many(comm, (const void* const[]){in_f32, NULL}, (void* const[]){out.f32, out.f32 + 4},
                                      (const size_t[]){4, 4}, 2, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_OK, gradsync_comm_allreduce_many(comm, NULL, NULL, NULL, 0, GRADSYNC_F32, GRADSYNC_SUM));

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, GRADSYNC_I32, 1, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, GRADSYNC_BF16, 1, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, GRADSYNC_F32, ((uint64_t)1 << 53) + 1, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, GRADSYNC_F32, UINT64_MAX, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, NULL, out.f32, 4, GRADSYNC_F32, 1, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, NULL, 4, GRADSYNC_F32, 1, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f32, out.f32, SIZE_MAX, GRADSYNC_F64, 1, NULL));
  EXPECT(GRADSYNC_E_ZERO_WEIGHT, gradsync_comm_weighted_mean(comm, in_f32, out.f32, 4, GRADSYNC_F32, 0, NULL));

  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_broadcast(comm, NULL, 4, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_broadcast(comm, out.f32, SIZE_MAX, GRADSYNC_F32, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, in_f32, NULL, 4, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, in_f32, out.f32, SIZE_MAX, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, NULL, NULL, 4, GRADSYNC_F64));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce_scatter(comm, NULL, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_reduce_scatter(comm, in_f32, NULL, 4, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_E_INVALID_ARG,
         gradsync_comm_reduce_scatter(comm, in_f32, out.f32, SIZE_MAX, GRADSYNC_I64, GRADSYNC_MAX));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, NULL, out.f32, 4, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, in_f32, NULL, 4, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, in_f32, out.f32, SIZE_MAX, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, out.f32, out.f32, 4, GRADSYNC_F32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alltoall(comm, out.f32 + 2, out.f32, 4, GRADSYNC_F32));

  /* The collectives that reduce need aligned buffers; send and recv are in place or disjoint. */
  {
    const char* in_bytes = (const char*)in_f32; /* a misaligned view of the inputs ... */
    char* out_bytes = (char*)out.f32;           /* ... and of the outputs */
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_bytes + 1, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_f32, out_bytes + 2, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, in_bytes + 4, out.f64, 2, GRADSYNC_F64, GRADSYNC_MAX));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_allreduce(comm, out_bytes + 1, out_bytes + 1, 4, GRADSYNC_BF16, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, out.f32 + 1, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce(comm, out.f32, out.f32 + 3, 4, GRADSYNC_I32, GRADSYNC_MIN));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_allreduce_many(comm, (const void* const[]){in_bytes + 2}, (void* const[]){out.f32},
                                        (const size_t[]){4}, 1, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allreduce_many(comm, (const void* const[]){in_f32, out.f32 + 9},
                                                                (void* const[]){out.f32, out.f32 + 8},
                                                                (const size_t[]){4, 4}, 2, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_bytes + 1, out.f32, 4, GRADSYNC_F32, 1, NULL));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, in_f64, out_bytes + 4, 2, GRADSYNC_F64, 1, NULL));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_weighted_mean(comm, out.f32 + 2, out.f32, 4, GRADSYNC_F32, 1, NULL));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_reduce_scatter(comm, in_bytes + 1, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_reduce_scatter(comm, in_f32, out_bytes + 1, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG,
           gradsync_comm_reduce_scatter(comm, out.f32, out.f32 + 1, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, out.f32 + 1, out.f32, 4, GRADSYNC_F32));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_allgather(comm, out.f32, out.f32 + 2, 4, GRADSYNC_F32));
    /* in place is fine, and so is any alignment for the collectives that only move bytes */
    EXPECT(GRADSYNC_OK, gradsync_comm_allreduce(comm, out.f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_OK, gradsync_comm_weighted_mean(comm, out.f64, out.f64, 4, GRADSYNC_F64, 3, NULL));
    EXPECT(GRADSYNC_OK, gradsync_comm_reduce_scatter(comm, out.f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
    EXPECT(GRADSYNC_OK, gradsync_comm_allgather(comm, out.f32, out.f32, 4, GRADSYNC_F32));
    EXPECT(GRADSYNC_OK, gradsync_comm_allgather(comm, NULL, out.f32, 4, GRADSYNC_F32));
    EXPECT(GRADSYNC_OK, gradsync_comm_broadcast(comm, out_bytes + 1, 4, GRADSYNC_F64, 0));
    EXPECT(GRADSYNC_OK, gradsync_comm_allgather(comm, in_bytes + 1, out_bytes + 3, 4, GRADSYNC_F64));
    EXPECT(GRADSYNC_OK, gradsync_comm_alltoall(comm, in_bytes + 1, out_bytes + 3, 4, GRADSYNC_F64));
  }

  /* buffers */
  buffer = UNSET_HANDLE;
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alloc(comm, 0, &buffer));
  EXPECT_TRUE(buffer == NULL);
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_alloc(comm, 64, NULL));
  buffer = UNSET_HANDLE;
  EXPECT(GRADSYNC_E_NOMEM, gradsync_comm_alloc(comm, SIZE_MAX, &buffer));
  EXPECT_TRUE(buffer == NULL);
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_free_buffer(comm, out.f32));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_free_buffer(comm, (void*)(uintptr_t)not_a_handle));
  EXPECT(GRADSYNC_OK, gradsync_comm_alloc(comm, 1, &buffer));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_free_buffer(comm, (char*)buffer + 1));
  EXPECT(GRADSYNC_OK, gradsync_comm_free_buffer(comm, buffer));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_comm_free_buffer(comm, buffer)); /* freed twice */
  EXPECT(GRADSYNC_OK, gradsync_comm_free_buffer(comm, NULL));

  /* an aborted group fails fast until reset; abort twice is fine */
  EXPECT(GRADSYNC_OK, gradsync_comm_abort(comm));
  EXPECT(GRADSYNC_OK, gradsync_comm_abort(comm));
  EXPECT(GRADSYNC_E_ABORTED, gradsync_comm_barrier(comm));
  EXPECT(GRADSYNC_E_ABORTED, gradsync_comm_allreduce(comm, in_f32, out.f32, 4, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(GRADSYNC_OK, gradsync_comm_reset(comm));
  EXPECT(GRADSYNC_OK, gradsync_comm_barrier(comm));
}

/* ------------------------------------------------------------------ sharded parameter */

static void sweep_shard(void) {
  static const int32_t bad_ranks[] = {-2, 1, INT32_MIN, INT32_MAX};
  static const size_t bad_counts[] = {0, 9, 11, SIZE_MAX};
  gradsync_shard_options o;
  gradsync_shard* s = NULL;
  gradsync_comm* orphan_comm = NULL;
  gradsync_comm_options co = comm_options("capi-sweep-orphan");
  float weights_before[10], weights_after[10];
  size_t needed = 0, i;

  /* create */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_create(NULL, comm, 10, NULL));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, s, gradsync_shard_create(&s, comm, 0, NULL));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, s, gradsync_shard_create(&s, comm, UINT64_MAX, NULL));
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, s, gradsync_shard_create(&s, comm, ((uint64_t)1 << 60) + 1, NULL));
#define BAD_OPTION(expected, field, value)                            \
  do {                                                                \
    o = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;          \
    o.field = (value);                                                \
    EXPECT_NEW(expected, s, gradsync_shard_create(&s, comm, 10, &o)); \
  } while (0)
  BAD_OPTION(GRADSYNC_E_UNSUPPORTED, optimizer, GRADSYNC_OPTIM_ROW_ADAGRAD);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, optimizer, 5);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, optimizer, -1);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, optimizer, INT32_MIN);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, compress, 4);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, compress, -1);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, compress, INT32_MAX);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, error_feedback, 2);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, error_feedback, -1);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, clamp, 2);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, lr, -1.0);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, lr, NAN);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, lr, INFINITY);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, lr, 1e300);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, momentum, 1.0);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, momentum, -0.5);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, beta1, 1.0);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, beta2, NAN);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, eps, 0.0);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, eps, -INFINITY);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, weight_decay, -1e-9);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, clip_norm, -1.0);
  BAD_OPTION(GRADSYNC_E_INVALID_ARG, clip_norm, INFINITY);
  o = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT, o.clamp = 1, o.clamp_min = 1, o.clamp_max = 0;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, s, gradsync_shard_create(&s, comm, 10, &o));
  o.clamp_min = NAN;
  EXPECT_NEW(GRADSYNC_E_INVALID_ARG, s, gradsync_shard_create(&s, comm, 10, &o));
#undef BAD_OPTION

  /* queries */
  for (i = 0; i < sizeof bad_ranks / sizeof bad_ranks[0]; ++i)
    EXPECT(GRADSYNC_E_OUT_OF_RANGE, gradsync_shard_part(shard, bad_ranks[i], 0, &out.u64[0], &out.u64[1]));
  EXPECT(GRADSYNC_OK, gradsync_shard_part(shard, -1, UINT64_MAX, NULL, NULL));
  EXPECT(GRADSYNC_E_BUFS, gradsync_shard_ranges(shard, 0, out.u64, 1, &needed));
  EXPECT_TRUE(needed == 2);
  EXPECT(GRADSYNC_E_BUFS, gradsync_shard_ranges(shard, 0, NULL, 0, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_ranges(shard, 0, NULL, 2, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_ranges(shard, 0, NULL, SIZE_MAX, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_ranges(shard, UINT64_MAX, out.u64, 16, &needed));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_ranges(shard, UINT64_MAX - 9, out.u64, 16, &needed));
  EXPECT(GRADSYNC_OK, gradsync_shard_ranges(shard, 1, out.u64, SIZE_MAX, NULL)); /* writes 2 */
  EXPECT_TRUE(out.u64[0] == 1 && out.u64[1] == 10 && out.u64[2] == UINT64_C(0xA5A5A5A5A5A5A5A5));
  EXPECT(GRADSYNC_OK, gradsync_shard_memory(shard, NULL, NULL, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_updates(shard, NULL));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_set_lr(shard, -1.0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_set_lr(shard, NAN));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_set_lr(shard, -INFINITY));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_set_lr(shard, 1e300));

  /* stages before init, on a new shard */
  EXPECT_NEW(GRADSYNC_OK, s, gradsync_shard_create(&s, comm, 10, NULL));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_put(s, in_f32, 10, 1));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_write_weights(s, in_f32, 10));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_update(s));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_step(s, in_f32, out.f32, 10, 1));
  for (i = 0; i < sizeof bad_counts / sizeof bad_counts[0]; ++i)
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_init(s, in_f32, bad_counts[i]));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_init(s, NULL, 10));
  gradsync_shard_free(s);

  /* the live shard: bad buffers and counts, nothing changes */
  CHECK(gradsync_shard_read_slice(shard, GRADSYNC_SHARD_WEIGHTS, weights_before, 10) == GRADSYNC_OK);
  for (i = 0; i < sizeof bad_counts / sizeof bad_counts[0]; ++i) {
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_put(shard, in_f32, bad_counts[i], 1));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_step(shard, in_f32, out.f32, bad_counts[i], 1));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, GRADSYNC_SHARD_WEIGHTS, out.f32, bad_counts[i]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_write_weights(shard, in_f32, bad_counts[i]));
    EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_gather(shard, out.f32, bad_counts[i]));
  }
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_put(shard, NULL, 10, 1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_put(shard, in_f32, 10, UINT64_MAX));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_step(shard, NULL, out.f32, 10, 1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_step(shard, in_f32, NULL, 10, 1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_step(shard, in_f32, out.f32, 10, (uint64_t)1 << 63));
  EXPECT(GRADSYNC_E_ZERO_WEIGHT, gradsync_shard_step(shard, in_f32, out.f32, 10, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, 4, out.f32, 10));
  /* SGD keeps no optimizer state: none to read, none to restore */
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, GRADSYNC_SHARD_STATE1, out.f32, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, GRADSYNC_SHARD_STATE2, out.f32, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, in_f32, in_f32, NULL, 10, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, in_f32, NULL, in_f32, 10, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, NULL, NULL, NULL, 10, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, in_f32, NULL, NULL, 9, 0));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, in_f32, NULL, NULL, 10, -1));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_restore(shard, in_f32, NULL, NULL, 10, INT64_MIN));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, -1, out.f32, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, INT32_MIN, out.f32, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_read_slice(shard, GRADSYNC_SHARD_GRADIENT, NULL, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_write_weights(shard, NULL, 10));
  EXPECT(GRADSYNC_E_INVALID_ARG, gradsync_shard_gather(shard, NULL, 10));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_update(shard)); /* nothing aggregated */
  CHECK(gradsync_shard_read_slice(shard, GRADSYNC_SHARD_WEIGHTS, weights_after, 10) == GRADSYNC_OK);
  EXPECT_TRUE(memcmp(weights_before, weights_after, sizeof weights_before) == 0);
  /* after all that, a step works (its first collective stage may report the last local failure) */
  if (gradsync_shard_step(shard, in_f32, out.f32, 10, 1) != GRADSYNC_OK)
    CHECK(gradsync_shard_step(shard, in_f32, out.f32, 10, 1) == GRADSYNC_OK);

  /* a shard whose communicator was freed: its collective stages are refused, local calls work */
  CHECK(gradsync_comm_create(&orphan_comm, &co) == GRADSYNC_OK);
  CHECK(gradsync_shard_create(&s, orphan_comm, 10, NULL) == GRADSYNC_OK);
  CHECK(gradsync_shard_init(s, shard_weights, 10) == GRADSYNC_OK);
  gradsync_comm_free(orphan_comm);
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_step(s, in_f32, out.f32, 10, 1));
  EXPECT(GRADSYNC_OK, gradsync_shard_put(s, in_f32, 10, 1));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_aggregate(s));
  EXPECT(GRADSYNC_E_MISUSE, gradsync_shard_gather(s, out.f32, 10));
  EXPECT(GRADSYNC_OK, gradsync_shard_read_slice(s, GRADSYNC_SHARD_WEIGHTS, out.f32, 10));
  gradsync_shard_free(s);
}

int main(void) {
  int failures;
  memset(canary, 0xA5, sizeof canary);
  initial_log_level = gradsync_get_log_level();
  if (!setup()) return 1;
  sweep_core();
  sweep_handles();
  sweep_options_structs();
  sweep_atomics();
  sweep_dataparallel();
  sweep_codecs();
  sweep_tables();
  sweep_accumulator();
  sweep_comm();
  sweep_shard();
  teardown();

  pthread_mutex_lock(&check_failures_lock);
  failures = check_failures;
  pthread_mutex_unlock(&check_failures_lock);
  printf("sweep: %d calls, %d failures\n", sweep_calls, failures);
  return failures == 0 ? 0 : 1;
}
