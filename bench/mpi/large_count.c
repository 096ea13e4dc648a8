// SPDX-License-Identifier: Apache-2.0
/* Collectives of more than 2^31 elements on the MPI transport, each result checked element by
 * element: allgather, reduce_scatter (sum), broadcast, gatherv and scatterv (root 0), reduce (sum,
 * to root 0) and alltoall of 2^31 + 3 bf16 elements (4 GiB per buffer; run once, about 16 GiB of
 * memory for 2 ranks at the peak):
 *   mpirun --allow-run-as-root -np 2 build/bench/mpi/mpi_large_count
 * Prints the seconds of each call (and GB/s of the first two) and exits non-zero on any wrong element. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "gradsync/gradsync.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* bf16 bits of small integers, exact in bf16 and in their sums over a few ranks */
static uint16_t bf16_of(unsigned v) {
  float f = (float)v;
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  return (uint16_t)(bits >> 16);
}

static int fail(gradsync_comm* c, const char* what, int status) {
  fprintf(stderr, "%s: status %d: %s\n", what, status, gradsync_last_error_message());
  gradsync_comm_free(c);
  return 1;
}

int main(void) {
  const size_t total = ((size_t)1 << 31) + 3;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  int32_t rank = 0, size = 1;
  uint64_t start = 0, len = 0, wrong = 0;
  uint16_t *buf, *part;
  size_t i;
  double t;
  int status;

  o.transport = GRADSYNC_TRANSPORT_MPI;
  o.timeout_ms = 600000;
  if ((status = gradsync_comm_create(&c, &o)) != GRADSYNC_OK) return fail(NULL, "create", status);
  gradsync_comm_rank(c, &rank);
  gradsync_comm_size(c, &size);
  gradsync_partition(total, (uint32_t)size, (uint32_t)rank, &start, &len);
  buf = malloc(total * sizeof *buf);
  part = malloc(len * sizeof *part);
  if (buf == NULL || part == NULL) return fail(c, "malloc", GRADSYNC_E_NOMEM);

  /* allgather in place: every element from its owner */
  for (i = 0; i < len; ++i) buf[start + i] = bf16_of((unsigned)((start + i) % 61 + (size_t)rank));
  t = now();
  if ((status = gradsync_comm_allgather(c, NULL, buf, total, GRADSYNC_BF16)) != GRADSYNC_OK)
    return fail(c, "allgather", status);
  t = now() - t;
  for (int32_t r = 0; r < size; ++r) {
    uint64_t s, l;
    gradsync_partition(total, (uint32_t)size, (uint32_t)r, &s, &l);
    for (i = s; i < s + l; ++i) wrong += buf[i] != bf16_of((unsigned)(i % 61 + (size_t)r));
  }
  if (rank == 0)
    printf("allgather      %zu bf16 elements: %.2f s, %.2f GB/s received, %llu wrong\n", total, t,
           (double)(total - len) * 2 / t / 1e9, (unsigned long long)wrong);

  /* reduce_scatter sum: rank r contributes (i % 61) + r at element i */
  for (i = 0; i < total; ++i) buf[i] = bf16_of((unsigned)(i % 61 + (size_t)rank));
  t = now();
  if ((status = gradsync_comm_reduce_scatter(c, buf, part, total, GRADSYNC_BF16, GRADSYNC_SUM)) != GRADSYNC_OK)
    return fail(c, "reduce_scatter", status);
  t = now() - t;
  for (i = 0; i < len; ++i)
    wrong += part[i] != bf16_of((unsigned)(((start + i) % 61) * (size_t)size + (size_t)(size * (size - 1) / 2)));
  if (rank == 0)
    printf("reduce_scatter %zu bf16 elements: %.2f s, %.2f GB/s sent, %llu wrong (all ranks' so far)\n", total, t,
           (double)(total - len) * 2 / t / 1e9, (unsigned long long)wrong);

  /* broadcast from the last rank */
  for (i = 0; i < total; ++i) buf[i] = rank == size - 1 ? bf16_of((unsigned)(i % 13)) : 0;
  t = now();
  if ((status = gradsync_comm_broadcast(c, buf, total, GRADSYNC_BF16, size - 1)) != GRADSYNC_OK)
    return fail(c, "broadcast", status);
  t = now() - t;
  for (i = 0; i < total; ++i) wrong += buf[i] != bf16_of((unsigned)(i % 13));
  if (rank == 0) printf("broadcast      %zu bf16 elements: %.2f s\n", total, t);

  /* gatherv to rank 0, each rank its partition's part, then scatterv of the same parts back */
  size_t* counts = malloc((size_t)size * sizeof *counts);
  if (counts == NULL) return fail(c, "malloc", GRADSYNC_E_NOMEM);
  for (int32_t r = 0; r < size; ++r) {
    uint64_t s, l;
    gradsync_partition(total, (uint32_t)size, (uint32_t)r, &s, &l);
    counts[r] = (size_t)l;
  }
  for (i = 0; i < len; ++i) part[i] = bf16_of((unsigned)((start + i) % 59 + (size_t)rank));
  t = now();
  if ((status = gradsync_comm_gatherv(c, part, len, buf, counts, GRADSYNC_BF16, 0)) != GRADSYNC_OK)
    return fail(c, "gatherv", status);
  t = now() - t;
  if (rank == 0) {
    for (int32_t r = 0; r < size; ++r) {
      uint64_t s, l;
      gradsync_partition(total, (uint32_t)size, (uint32_t)r, &s, &l);
      for (i = s; i < s + l; ++i) wrong += buf[i] != bf16_of((unsigned)(i % 59 + (size_t)r));
    }
    printf("gatherv        %zu bf16 elements to rank 0: %.2f s, %llu wrong so far\n", total, t,
           (unsigned long long)wrong);
    for (i = 0; i < total; ++i) buf[i] = bf16_of((unsigned)(i % 53));
  }
  for (i = 0; i < len; ++i) part[i] = 0;
  t = now();
  if ((status = gradsync_comm_scatterv(c, buf, counts, part, len, GRADSYNC_BF16, 0)) != GRADSYNC_OK)
    return fail(c, "scatterv", status);
  t = now() - t;
  for (i = 0; i < len; ++i) wrong += part[i] != bf16_of((unsigned)((start + i) % 53));
  if (rank == 0) printf("scatterv       %zu bf16 elements from rank 0: %.2f s\n", total, t);
  free(counts);
  free(part);

  /* reduce (sum) to rank 0, then alltoall: a second buffer of the whole size */
  uint16_t* out = malloc(total * sizeof *out);
  if (out == NULL) return fail(c, "malloc", GRADSYNC_E_NOMEM);
  for (i = 0; i < total; ++i) buf[i] = bf16_of((unsigned)(i % 61 + (size_t)rank));
  t = now();
  if ((status = gradsync_comm_reduce(c, buf, out, total, GRADSYNC_BF16, GRADSYNC_SUM, 0)) != GRADSYNC_OK)
    return fail(c, "reduce", status);
  t = now() - t;
  if (rank == 0) {
    for (i = 0; i < total; ++i)
      wrong += out[i] != bf16_of((unsigned)((i % 61) * (size_t)size + (size_t)(size * (size - 1) / 2)));
    printf("reduce         %zu bf16 elements to rank 0: %.2f s\n", total, t);
  }
  /* alltoall: part p of every rank goes to rank p; element i of rank r's buffer is (i % 47) + r */
  const size_t piece = total / (size_t)size;
  for (i = 0; i < piece * (size_t)size; ++i) buf[i] = bf16_of((unsigned)(i % 47 + (size_t)rank));
  t = now();
  if ((status = gradsync_comm_alltoall(c, buf, out, piece * (size_t)size, GRADSYNC_BF16)) != GRADSYNC_OK)
    return fail(c, "alltoall", status);
  t = now() - t;
  for (int32_t r = 0; r < size; ++r)
    for (i = 0; i < piece; ++i)
      wrong += out[(size_t)r * piece + i] != bf16_of((unsigned)(((size_t)rank * piece + i) % 47 + (size_t)r));
  printf("rank %d: alltoall %zu bf16 elements: %.2f s; %llu wrong elements in all\n", rank, piece * (size_t)size, t,
         (unsigned long long)wrong);
  free(out);
  free(buf);
  gradsync_comm_free(c);
  return wrong != 0;
}
