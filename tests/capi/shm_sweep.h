/* SPDX-License-Identifier: Apache-2.0 */
/* The segments a test's process groups leave behind. The library removes a group's segment when
 * its last live member leaves; a test that kills members checks that, and removes what a failing
 * run left so that it never outlives the run. Tests name their groups "<stem><pid>-...". */
#ifndef GRADSYNC_TESTS_CAPI_SHM_SWEEP_H
#define GRADSYNC_TESTS_CAPI_SHM_SWEEP_H

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* Removes /dev/shm/gradsync.<prefix>*, naming each on stderr. With stale set, prefix is a stem
 * and only names "<stem><pid>-..." whose pid no longer runs are removed (an earlier, killed run).
 * Returns how many were removed. */
static inline int shm_sweep(const char* prefix, int stale) {
  char full[128], path[512];
  size_t len;
  int removed = 0;
  struct dirent* e;
  DIR* d = opendir("/dev/shm");
  if (d == NULL) return 0;
  snprintf(full, sizeof full, "gradsync.%s", prefix);
  len = strlen(full);
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, full, len) != 0) continue;
    if (stale) {
      char* end;
      long pid;
      errno = 0;
      pid = strtol(e->d_name + len, &end, 10);
      if (errno != 0 || end == e->d_name + len || *end != '-' || pid <= 0) continue;
      if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
    }
    snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
    if (unlink(path) == 0) {
      fprintf(stderr, "removed %s\n", path);
      removed++;
    }
  }
  closedir(d);
  return removed;
}

#endif
