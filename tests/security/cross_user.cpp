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

#include "gradsync/comm.h"
#include "gradsync/errors.h"

namespace {

int failures = 0;
uid_t attacker_uid = 0;
gid_t attacker_gid = 0;

#define EXPECT(cond, ...)                                          \
  do {                                                             \
    if (!(cond)) {                                                 \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                           \
      std::fprintf(stderr, "\n");                                  \
      ++failures;                                                  \
    }                                                              \
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
    const int fd = shm_open(segment_of(group).c_str(), O_RDONLY, 0);
    if (fd >= 0) return 1;             // it could read the victim's control words and gradients
    return errno == EACCES ? 0 : 2;
  });
  EXPECT(rc == 0, "the attacker opened the running group's segment (%d)", rc);
  gradsync_comm_free(c);
  std::printf("ok   a running group's segment is 0600 and closed to another user\n");
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
  std::printf("cross_user: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
