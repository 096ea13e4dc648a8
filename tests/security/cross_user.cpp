// SPDX-License-Identifier: Apache-2.0
// Attacks by another local user, played by a real second user: run as root, the test forks and
// drops the child to `nobody` (setresuid), which plays the attacker against the parent's groups.
// Each attack must end in a clear error on the victim's side, with nothing of the victim's readable.
// Uses only the public C API, plus the system calls an attacker would use.
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/accumulator.h"
#include "gradsync/comm.h"
#include "gradsync/errors.h"
#include "gradsync/table.h"

namespace {

int failures = 0;
uid_t attacker_uid = 0;
gid_t attacker_gid = 0;

#define EXPECT(cond, ...)                                                  \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                   \
      std::fprintf(stderr, "\n");                                          \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

// Runs fn as the attacker in a child process; returns its exit status.
int as_attacker(const std::function<int()>& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setresgid(attacker_gid, attacker_gid, attacker_gid) != 0 ||
        setresuid(attacker_uid, attacker_uid, attacker_uid) != 0) {
      std::perror("dropping to the attacker user");
      _exit(100);
    }
    _exit(fn());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string segment_of(const std::string& group) { return "gradsync." + group; }

gradsync_comm* join(const std::string& group, int rank, int size, int* status) {
  gradsync_comm_options o;
  gradsync_comm_options_init(&o, sizeof o);
  o.transport = GRADSYNC_TRANSPORT_SHM;
  o.rank = rank;
  o.size = size;
  std::snprintf(o.name, sizeof o.name, "%s", group.c_str());
  o.timeout_ms = 5000;
  gradsync_comm* c = nullptr;
  *status = gradsync_comm_create(&c, &o);
  return c;
}

// The attacker creates the victim's segment first, with `mode`.
void squat(const std::string& group, mode_t mode) {
  const int rc = as_attacker([&] {
    const int fd = shm_open(segment_of(group).c_str(), O_CREAT | O_EXCL | O_RDWR, mode);
    if (fd < 0) return 1;
    if (fchmod(fd, mode) != 0 || ftruncate(fd, 1 << 20) != 0) return 2;
    return 0;
  });
  EXPECT(rc == 0, "the attacker could not create its segment (%d)", rc);
}

void test_squatted_segment(mode_t mode) {
  const std::string group = "xuser-squat-" + std::to_string(mode) + "-" + std::to_string(getpid());
  squat(group, mode);
  int st = 0;
  gradsync_comm* c = join(group, 0, 1, &st);
  const std::string msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_PERMISSION && c == nullptr, "joining a segment squatted with mode %04o gave %d: %s", mode, st,
         msg.c_str());
  EXPECT(msg.find("belongs to uid " + std::to_string(attacker_uid)) != std::string::npos, "message: %s", msg.c_str());
  struct stat sb {};
  EXPECT(stat(("/dev/shm/" + segment_of(group)).c_str(), &sb) == 0 && sb.st_size == (1 << 20),
         "the victim changed the attacker's segment");
  shm_unlink(segment_of(group).c_str());
  std::printf("ok   a segment squatted by uid %u with mode %04o is refused: %s\n", attacker_uid, mode, msg.c_str());
}

void test_own_segment_open_to_others() {
  const std::string group = "xuser-open-" + std::to_string(getpid());
  const int fd = shm_open(segment_of(group).c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  EXPECT(fd >= 0 && fchmod(fd, 0644) == 0, "creating the victim's own 0644 segment");
  close(fd);
  int st = 0;
  gradsync_comm* c = join(group, 0, 1, &st);
  const std::string msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_PERMISSION && c == nullptr, "joining an own segment of mode 0644 gave %d: %s", st,
         msg.c_str());
  EXPECT(msg.find("mode 0644") != std::string::npos, "message: %s", msg.c_str());
  shm_unlink(segment_of(group).c_str());
  std::printf("ok   an own segment that others may open is refused: %s\n", msg.c_str());
}

void test_running_group_is_private() {
  const std::string group = "xuser-running-" + std::to_string(getpid());
  int st = 0;
  gradsync_comm* c = join(group, 0, 1, &st);
  EXPECT(st == GRADSYNC_OK, "forming a group of one: %s", gradsync_last_error_message());
  struct stat sb {};
  EXPECT(stat(("/dev/shm/" + segment_of(group)).c_str(), &sb) == 0, "the running group's segment exists");
  EXPECT((sb.st_mode & 077) == 0 && sb.st_uid == geteuid(), "segment mode %04o uid %u", sb.st_mode & 07777, sb.st_uid);
  const int rc = as_attacker([&] {
    int fd = shm_open(segment_of(group).c_str(), O_RDONLY, 0);
    if (fd >= 0) return 1;  // it could read the victim's control words and gradients
    if (errno != EACCES) return 2;
    fd = shm_open(segment_of(group).c_str(), O_RDWR, 0);
    if (fd >= 0) return 3;  // it could inject an abort or forged offsets
    if (errno != EACCES) return 4;
    return 0;
  });
  EXPECT(rc == 0, "the attacker opened the running group's segment (%d)", rc);
  // The victim's segment is untouched: its group still answers.
  float x[2] = {1.0f, 2.0f};
  EXPECT(gradsync_comm_allreduce(c, x, x, 2, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && x[1] == 2.0f,
         "the running group after the attack: %s", gradsync_last_error_message());
  gradsync_comm_free(c);
  std::printf("ok   a running group's segment is 0600: another user can neither read nor inject\n");
}

// A directory both users may write, as /tmp is (sticky, so only owners delete their files).
std::string shared_dir() {
  static const std::string dir = [] {
    std::string d = "/tmp/gradsync-xuser-" + std::to_string(getpid());
    mkdir(d.c_str(), 01777);
    chmod(d.c_str(), 01777);
    return d;
  }();
  return dir;
}

int open_table(const std::string& path, int mode, int allow_other_owner, gradsync_table** out) {
  gradsync_table_options o;
  gradsync_table_options_init(&o, sizeof o);
  o.mode = mode;
  o.rows = 4;
  o.dim = 2;
  o.allow_other_owner = allow_other_owner;
  *out = nullptr;
  return gradsync_table_open(out, path.c_str(), &o);
}

void test_squatted_table() {
  const std::string path = shared_dir() + "/squatted.table";
  // The attacker plants a valid table where the victim will open one.
  const int rc = as_attacker([&] {
    gradsync_table* t = nullptr;
    if (open_table(path, GRADSYNC_TABLE_CREATE, 0, &t) != GRADSYNC_OK) return 1;
    gradsync_table_free(t);
    return chmod(path.c_str(), 0666) == 0 ? 0 : 2;
  });
  EXPECT(rc == 0, "the attacker could not plant its table (%d)", rc);
  gradsync_table* t = nullptr;
  const int st = open_table(path, GRADSYNC_TABLE_CREATE_OR_OPEN, 0, &t);
  const std::string msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_PERMISSION && t == nullptr, "opening another user's table gave %d: %s", st, msg.c_str());
  EXPECT(msg.find("belongs to uid " + std::to_string(attacker_uid)) != std::string::npos, "message: %s", msg.c_str());
  // Trusting it is the caller's explicit choice.
  EXPECT(open_table(path, GRADSYNC_TABLE_OPEN, 1, &t) == GRADSYNC_OK, "allow_other_owner: %s",
         gradsync_last_error_message());
  gradsync_table_free(t);
  unlink(path.c_str());
  std::printf("ok   a table planted by another user is refused unless allow_other_owner: %s\n", msg.c_str());
}

void test_table_is_private() {
  const std::string path = shared_dir() + "/private.table";
  gradsync_table* t = nullptr;
  EXPECT(open_table(path, GRADSYNC_TABLE_CREATE, 0, &t) == GRADSYNC_OK, "creating: %s", gradsync_last_error_message());
  struct stat sb {};
  EXPECT(stat(path.c_str(), &sb) == 0 && (sb.st_mode & 07777) == 0600, "a new table has mode %04o", sb.st_mode & 07777);
  const int rc = as_attacker([&] { return ::open(path.c_str(), O_RDONLY) < 0 && errno == EACCES ? 0 : 1; });
  EXPECT(rc == 0, "the attacker could read the victim's table");
  gradsync_table_free(t);
  unlink(path.c_str());
  std::printf("ok   a new table is 0600: another user cannot read it\n");
}

int open_accum(const std::string& path, int mode, int allow_other_owner, gradsync_accum** out) {
  gradsync_accum_options o;
  gradsync_accum_options_init(&o, sizeof o);
  o.mode = mode;
  o.rows = 4;
  o.dim = 2;
  o.allow_other_owner = allow_other_owner;
  *out = nullptr;
  return gradsync_accum_open(out, path.c_str(), &o);
}

void test_squatted_gradient_file() {
  const std::string path = shared_dir() + "/squatted.grad";
  // The attacker plants a gradient file, open to all, where the victim's processes will meet.
  const int rc = as_attacker([&] {
    gradsync_accum* a = nullptr;
    if (open_accum(path, GRADSYNC_TABLE_CREATE, 0, &a) != GRADSYNC_OK) return 1;
    gradsync_accum_free(a);
    return chmod(path.c_str(), 0666) == 0 ? 0 : 2;
  });
  EXPECT(rc == 0, "the attacker could not plant its gradient file (%d)", rc);
  gradsync_accum* a = nullptr;
  const int st = open_accum(path, GRADSYNC_TABLE_CREATE_OR_OPEN, 0, &a);
  const std::string msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_PERMISSION && a == nullptr, "opening another user's gradient file gave %d: %s", st,
         msg.c_str());
  EXPECT(msg.find("belongs to uid " + std::to_string(attacker_uid)) != std::string::npos, "message: %s", msg.c_str());
  EXPECT(open_accum(path, GRADSYNC_TABLE_OPEN, 1, &a) == GRADSYNC_OK, "allow_other_owner: %s",
         gradsync_last_error_message());
  gradsync_accum_free(a);
  unlink(path.c_str());
  std::printf("ok   a gradient file planted by another user is refused unless allow_other_owner: %s\n", msg.c_str());
}

void test_gradient_file_is_private() {
  const std::string path = shared_dir() + "/private.grad";
  gradsync_accum* a = nullptr;
  EXPECT(open_accum(path, GRADSYNC_TABLE_CREATE, 0, &a) == GRADSYNC_OK, "creating: %s", gradsync_last_error_message());
  int64_t id = 1;
  float g[2] = {0.25f, 0.5f};
  EXPECT(gradsync_accum_add_batch(a, &id, 1, g, 2) == GRADSYNC_OK, "adding: %s", gradsync_last_error_message());
  struct stat sb {};
  EXPECT(stat(path.c_str(), &sb) == 0 && (sb.st_mode & 07777) == 0600, "a new gradient file has mode %04o",
         sb.st_mode & 07777);
  const int rc = as_attacker([&] {
    if (::open(path.c_str(), O_RDONLY) >= 0 || errno != EACCES) return 1;  // the gradients, readable
    if (::open(path.c_str(), O_RDWR) >= 0 || errno != EACCES) return 2;    // a touched count to forge
    gradsync_accum* mine = nullptr;
    return open_accum(path, GRADSYNC_TABLE_OPEN, 1, &mine) == GRADSYNC_E_PERMISSION ? 0 : 3;
  });
  EXPECT(rc == 0, "the attacker could open the victim's gradient file (%d)", rc);
  float out[2] = {0, 0};
  EXPECT(gradsync_accum_get(a, 1, out, 2) == GRADSYNC_OK && out[0] == 0.25f && out[1] == 0.5f,
         "the victim's gradient after the attack: %s", gradsync_last_error_message());
  gradsync_accum_free(a);
  unlink(path.c_str());
  std::printf("ok   a new gradient file is 0600: another user can neither read nor write it\n");
}

void test_what_is_at_the_path() {
  const std::string fifo = shared_dir() + "/fifo.table";
  EXPECT(mkfifo(fifo.c_str(), 0600) == 0, "mkfifo");
  gradsync_table* t = nullptr;
  int st = open_table(fifo, GRADSYNC_TABLE_OPEN, 0, &t);  // must not block on the FIFO
  std::string msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_INVALID_ARG && msg.find("FIFO") != std::string::npos, "a FIFO gave %d: %s", st, msg.c_str());
  unlink(fifo.c_str());
  const std::string link = shared_dir() + "/dangling.table";
  EXPECT(symlink("/nonexistent/target", link.c_str()) == 0, "symlink");
  st = open_table(link, GRADSYNC_TABLE_CREATE_OR_OPEN, 0, &t);
  msg = gradsync_last_error_message();
  EXPECT(st == GRADSYNC_E_IO && msg.find("symbolic link") != std::string::npos, "a dangling link gave %d: %s", st,
         msg.c_str());
  unlink(link.c_str());
  std::printf("ok   a FIFO or a dangling symlink at a table path is named, without blocking\n");
}

}  // namespace

int main() {
  if (geteuid() != 0) {
    // Playing a second user needs root (CI runs as root); without it this suite cannot run.
    std::printf("cross-user tests need root to play a second user; run as root (CI does)\n");
    return 77;
  }
  const passwd* pw = getpwnam("nobody");
  if (pw == nullptr) {
    std::fprintf(stderr, "no user 'nobody' to play the attacker\n");
    return 1;
  }
  attacker_uid = pw->pw_uid;
  attacker_gid = pw->pw_gid;
  test_squatted_segment(0666);
  test_squatted_segment(0600);
  test_own_segment_open_to_others();
  test_running_group_is_private();
  test_squatted_table();
  test_table_is_private();
  test_squatted_gradient_file();
  test_gradient_file_is_private();
  test_what_is_at_the_path();
  rmdir(shared_dir().c_str());
  std::printf("cross_user: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
