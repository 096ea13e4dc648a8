/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers of the tests that fork a process holding communicators (tests/capi/fork.c,
 * tests/mpi/capi_mpi.c). Include in a file that defines _POSIX_C_SOURCE. */
#ifndef GRADSYNC_TESTS_CAPI_FORK_HELPERS_H
#define GRADSYNC_TESTS_CAPI_FORK_HELPERS_H

#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Whether a line of /proc/self/maps contains text (a path, or with "\n" a whole path's end). */
static inline int mapped(const char* text) {
  char line[512];
  int found = 0;
  FILE* maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) return -1;
  while (!found && fgets(line, sizeof line, maps) != NULL) found = strstr(line, text) != NULL;
  fclose(maps);
  return found;
}

/* Returns once every thread of this process but the calling one (the main thread) is asleep
 * (state S in /proc), twice in a row: the other threads then wait in a collective, not inside
 * malloc. A sanitizer's allocator has no fork handler, so a fork while another thread holds its lock
 * would leave the child's copy locked, and the child's first allocation would wait for ever. */
static inline void wait_until_others_sleep(void) {
  int calm = 0;
  while (calm < 2) {
    DIR* tasks = opendir("/proc/self/task");
    struct dirent* e;
    int all_asleep = 1;
    if (tasks == NULL) return;
    while ((e = readdir(tasks)) != NULL) {
      char path[300], stat[256], *end;
      FILE* f;
      if (e->d_name[0] == '.' || atoi(e->d_name) == (int)getpid()) continue;
      snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
      f = fopen(path, "r");
      if (f == NULL) continue; /* the thread has exited */
      if (fgets(stat, sizeof stat, f) != NULL && (end = strrchr(stat, ')')) != NULL && end[1] == ' ' && end[2] != 'S')
        all_asleep = 0;
      fclose(f);
    }
    closedir(tasks);
    calm = all_asleep ? calm + 1 : 0;
    sched_yield();
  }
}

#endif
