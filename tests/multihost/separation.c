// SPDX-License-Identifier: Apache-2.0
/* The harness's hosts are separate the way real machines are, and the library's shared-memory
 * probe cannot be fooled into bridging them. Run under mpirun across the hosts (hosts.py):
 *
 *   separation LAYOUT          LAYOUT as given to the harness (e.g. 1,2)
 *
 * Ranks are placed host by host, so LAYOUT says which host each rank is on. From facts a rank can
 * read, the program checks for every pair of ranks that their hostnames, IPC namespaces
 * (/proc/self/ns/ipc), network namespaces and mount namespaces are equal exactly when they are on
 * one host; that a POSIX shared-memory segment one rank makes is opened and shared by the ranks of
 * its host and by no other; and that every rank reads the same boot id (one kernel: the boot id
 * alone cannot tell these hosts apart). Then every rank creates an MPI communicator with one host
 * label for all: the identities agree across hosts, and only the probe can tell the hosts apart,
 * so gradsync_comm_topology must still report LAYOUT, and no probe file may outlive the creation.
 * (The detected topology is topology_check's, tests/mpi, run across the hosts too.) Rank 0 prints
 * every rank's facts and the reported topology; every failed check prints a line; the exit status
 * is non-zero if any check failed on any rank. */
#define _GNU_SOURCE
#include <mpi.h>

#include <dirent.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gradsync/gradsync.h"

enum { kMaxRanks = 64, kText = 64 };

struct facts {
  char hostname[kText];
  char ipc[kText];
  char net[kText];
  char mnt[kText];
  char boot_id[kText];
};

static int failures = 0;
static int my_rank = 0;

#define CHECK(cond, ...)                           \
  do {                                             \
    if (!(cond)) {                                 \
      ++failures;                                  \
      fprintf(stderr, "rank %d: FAIL: ", my_rank); \
      fprintf(stderr, __VA_ARGS__);                \
      fputc('\n', stderr);                         \
    }                                              \
  } while (0)

static void read_link(const char* path, char* out) {
  ssize_t n = readlink(path, out, kText - 1);
  out[n > 0 ? n : 0] = '\0';
  CHECK(n > 0, "readlink %s: %s", path, strerror(errno));
}

static void read_line(const char* path, char* out) {
  FILE* f = fopen(path, "r");
  out[0] = '\0';
  CHECK(f && fgets(out, kText, f), "read %s: %s", path, strerror(errno));
  if (f) fclose(f);
  out[strcspn(out, "\n")] = '\0';
}

static void segment_name(char* out, const char* tag, int rank) { snprintf(out, 2 * kText, "/%s-rank%d", tag, rank); }

/* gradsync_comm_topology of a new MPI communicator with host label `label` on every rank, against
 * the layout; rank 0 prints what it reported. */
static void check_topology(const char* label, const int* host_of, int size) {
  gradsync_comm_options o;
  gradsync_comm_options_init(&o, sizeof o);
  o.transport = GRADSYNC_TRANSPORT_MPI;
  o.mpi_fcomm = (int64_t)MPI_Comm_c2f(MPI_COMM_WORLD);
  o.timeout_ms = 60000;
  snprintf(o.host, sizeof o.host, "%s", label);
  const char* how = "one host label on every rank";
  gradsync_comm* c = NULL;
  int st = gradsync_comm_create(&c, &o);
  CHECK(st == GRADSYNC_OK, "gradsync_comm_create (%s): %s", how, gradsync_last_error_message());
  int32_t mine[3] = {-1, -1, -1}, num_hosts = -1, rank_hosts[kMaxRanks], all[3 * kMaxRanks];
  if (c) {
    st = gradsync_comm_topology(c, &mine[0], &mine[1], &mine[2], &num_hosts, rank_hosts, kMaxRanks);
    CHECK(st == GRADSYNC_OK, "gradsync_comm_topology (%s): %s", how, gradsync_last_error_message());
  }
  int local_rank = 0, local_size = 0;
  for (int r = 0; r < size; ++r) {
    if (host_of[r] != host_of[my_rank]) continue;
    local_size += 1;
    if (r < my_rank) local_rank += 1;
  }
  CHECK(mine[0] == host_of[my_rank] && mine[1] == local_rank && mine[2] == local_size,
        "topology (%s): host %d, local rank %d of %d; expected host %d, local rank %d of %d", how, mine[0], mine[1],
        mine[2], host_of[my_rank], local_rank, local_size);
  CHECK(num_hosts == host_of[size - 1] + 1, "topology (%s): %d hosts, expected %d", how, num_hosts,
        host_of[size - 1] + 1);
  for (int r = 0; c && r < size; ++r)
    CHECK(rank_hosts[r] == host_of[r], "topology (%s): rank %d on host %d, expected %d", how, r, rank_hosts[r],
          host_of[r]);
  /* Every rank's creation has returned: the probe's files must be gone from this host's /dev/shm. */
  MPI_Barrier(MPI_COMM_WORLD);
  DIR* shm = opendir("/dev/shm");
  for (struct dirent* e = shm ? readdir(shm) : NULL; e; e = readdir(shm))
    CHECK(strncmp(e->d_name, "gradsync-probe.", 15) != 0, "a probe file outlived creation: /dev/shm/%s", e->d_name);
  if (shm) closedir(shm);
  gradsync_comm_free(c);
  MPI_Gather(mine, 3, MPI_INT32_T, all, 3, MPI_INT32_T, 0, MPI_COMM_WORLD);
  if (my_rank == 0) {
    printf("gradsync_comm_topology (%s): %d hosts\n%6s %6s %11s %10s\n", how, num_hosts, "rank", "host", "local_rank",
           "local_size");
    for (int r = 0; r < size; ++r) printf("%6d %6d %11d %10d\n", r, all[3 * r], all[3 * r + 1], all[3 * r + 2]);
  }
}

int main(int argc, char** argv) {
  int size = 0, host_of[kMaxRanks], ranks = 0, host = 0, provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &my_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2 || size > kMaxRanks) {
    fprintf(stderr, "usage: mpirun ... %s LAYOUT (at most %d ranks)\n", argv[0], kMaxRanks);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  for (const char* p = argv[1]; *p; ++host) {
    char* end = NULL;
    const long n = strtol(p, &end, 10);
    if (end == p || n < 1 || (*end != ',' && *end != '\0')) {
      ranks = -1;
      break;
    }
    for (long i = 0; i < n && ranks < kMaxRanks; ++i) host_of[ranks++] = host;
    p = *end == ',' ? end + 1 : end;
  }
  if (ranks != size) {
    fprintf(stderr, "layout %s has %d ranks, the job %d\n", argv[1], ranks, size);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  /* Segment names unique to the job (rank 0's pid and clock), so that parallel runs cannot meet. */
  char tag[kText];
  if (my_rank == 0) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    snprintf(tag, kText, "gradsync-separation-%ld-%ld", (long)getpid(), (long)now.tv_nsec);
  }
  MPI_Bcast(tag, kText, MPI_CHAR, 0, MPI_COMM_WORLD);

  struct facts mine, all[kMaxRanks];
  memset(&mine, 0, sizeof mine);
  CHECK(gethostname(mine.hostname, kText - 1) == 0, "gethostname: %s", strerror(errno));
  read_link("/proc/self/ns/ipc", mine.ipc);
  read_link("/proc/self/ns/net", mine.net);
  read_link("/proc/self/ns/mnt", mine.mnt);
  read_line("/proc/sys/kernel/random/boot_id", mine.boot_id);
  MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, MPI_COMM_WORLD);

  char expected[kText];
  snprintf(expected, kText, "h%d", host_of[my_rank]);
  CHECK(strcmp(mine.hostname, expected) == 0, "hostname %s, expected %s (ranks are placed host by host)", mine.hostname,
        expected);
  for (int r = 0; r < size; ++r) {
    const int same = host_of[r] == host_of[my_rank];
    const char* verb = same ? "differs from" : "equals";
    CHECK((strcmp(all[r].hostname, mine.hostname) == 0) == same, "hostname %s %s rank %d's", mine.hostname, verb, r);
    CHECK((strcmp(all[r].ipc, mine.ipc) == 0) == same, "IPC namespace %s %s rank %d's", mine.ipc, verb, r);
    CHECK((strcmp(all[r].net, mine.net) == 0) == same, "network namespace %s %s rank %d's", mine.net, verb, r);
    CHECK((strcmp(all[r].mnt, mine.mnt) == 0) == same, "mount namespace %s %s rank %d's", mine.mnt, verb, r);
    CHECK(strcmp(all[r].boot_id, mine.boot_id) == 0, "boot id %s differs from rank %d's", mine.boot_id, r);
  }

  /* Each rank makes a segment holding its rank; after a barrier every rank tries every segment. */
  char name[2 * kText];
  segment_name(name, tag, my_rank);
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0, "shm_open(%s, O_CREAT | O_EXCL): %s", name, strerror(errno));
  int* mapped = MAP_FAILED;
  if (fd >= 0) {
    CHECK(ftruncate(fd, sizeof(int)) == 0, "ftruncate: %s", strerror(errno));
    mapped = mmap(NULL, sizeof(int), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(mapped != MAP_FAILED, "mmap: %s", strerror(errno));
    if (mapped != MAP_FAILED) *mapped = 1000 + my_rank;
    close(fd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (int r = 0; r < size; ++r) {
    char other[2 * kText];
    segment_name(other, tag, r);
    const int same = host_of[r] == host_of[my_rank];
    int ofd = shm_open(other, O_RDWR, 0);
    if (!same) {
      CHECK(ofd < 0 && errno == ENOENT, "rank %d's segment %s (another host) is visible here", r, other);
    } else if (ofd < 0) {
      CHECK(0, "rank %d's segment %s (this host) cannot be opened: %s", r, other, strerror(errno));
    } else {
      int* p = mmap(NULL, sizeof(int), PROT_READ | PROT_WRITE, MAP_SHARED, ofd, 0);
      CHECK(p != MAP_FAILED && *p == 1000 + r, "rank %d's segment does not hold what it wrote", r);
      if (p != MAP_FAILED) munmap(p, sizeof(int));
    }
    if (ofd >= 0) close(ofd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (mapped != MAP_FAILED) munmap(mapped, sizeof(int));
  shm_unlink(name);

  if (my_rank == 0) {
    printf("%4s %4s %-8s %-18s %-18s %-18s %s\n", "rank", "host", "hostname", "ipc", "net", "mnt", "boot_id");
    for (int r = 0; r < size; ++r)
      printf("%4d %4d %-8s %-18s %-18s %-18s %s\n", r, host_of[r], all[r].hostname, all[r].ipc, all[r].net, all[r].mnt,
             all[r].boot_id);
  }
  if (my_rank == 0) printf("\n");
  check_topology("one-label", host_of, size);

  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (my_rank == 0) printf("%s: %d failed checks\n", total ? "FAIL" : "ok", total);
  MPI_Finalize();
  return total ? 1 : 0;
}
