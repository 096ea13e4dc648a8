/* SPDX-License-Identifier: Apache-2.0 */
/* Who holds a shm group's locks, as /proc/locks shows them: byte 0 of the segment's file is its
 * set-up lock (held while a rank claims its place), byte 1 + r rank r's lock (held while rank r is
 * in the group). A test that kills a process at a chosen point of a group's forming waits for it
 * here: a process killed before it holds its rank lock is invisible to its peers. */
#ifndef GRADSYNC_TESTS_CAPI_SHM_LOCKS_H
#define GRADSYNC_TESTS_CAPI_SHM_LOCKS_H

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* Bit i set: lock byte i (i < count <= 31) of the segment of group `name` is held. -1 when the
 * segment does not exist or /proc/locks cannot be read. */
static inline int shm_locks_held(const char* name, int count) {
  char path[128], line[256];
  struct stat st;
  FILE* f;
  int held = 0;
  snprintf(path, sizeof path, "/dev/shm/gradsync.%s", name);
  if (stat(path, &st) != 0 || (f = fopen("/proc/locks", "r")) == NULL) return -1;
  while (fgets(line, sizeof line, f) != NULL) {
    char kind[16];
    unsigned long inode = 0;
    long start = -1;
    if (strstr(line, "->") == NULL &&
        sscanf(line, "%*[^:]: %15s %*s %*s %*s %*x:%*x:%lu %ld", kind, &inode, &start) == 3 &&
        strcmp(kind, "OFDLCK") == 0 && inode == (unsigned long)st.st_ino && start >= 0 && start < count)
      held |= 1 << start;
  }
  fclose(f);
  return held;
}

#endif
