#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Separate hosts on this one machine, and MPI programs run across them.

    hosts.py --layout 2,2 [--timeout S] [--mpirun PATH] [--mca NAME VALUE]... -- PROGRAM ARGS...

makes one host per layout entry (h0, h1, ...), starts PROGRAM under mpirun with that many ranks on
each host (ranks numbered host by host), and exits with mpirun's status: 124 if the job outlived
--timeout, 128+N if mpirun died of signal N. Everything it made is removed on every way out
(success, failure, timeout, SIGINT/SIGTERM/SIGHUP), and leftovers of runs whose process is gone
are swept at the start.

A host is what a rank can tell apart from facts, as on separate machines:
- a network namespace joined to the others by a veth pair on a bridge, with an address of a /28
  subnet of 10.250.0.0/16 chosen for this run (the bridge holds the first address, for mpirun's own
  connections); no namespace has a route anywhere else, and IPv6 is off on every link made here;
- its own IPC, mount and UTS namespaces: a private tmpfs on /dev/shm and on the directory of Open
  MPI's session files (so nothing a host writes there can outlive it), and its own hostname,
  "h<index>".
All hosts share the kernel, hence /proc/sys/kernel/random/boot_id. mpirun reaches a host through a
launch agent that enters its namespaces instead of ssh; Open MPI is held to TCP on the run's subnet
(shared memory only among the ranks of one host). The harness sets no variable of its own in the
ranks' environment: they see the caller's, plus what Open MPI itself sets.

From Python (tests and benchmarks):

    import hosts
    result = hosts.run([2, 2], ["prog", "arg"], timeout=60)   # -> Result(status, output, seconds)
    with hosts.Hosts([2, 2]) as h:                            # several jobs on the same hosts
        job = h.start(["prog"]); ...; result = job.wait(60)
        h.exec(0, ["cmd"])                                    # a plain process in h0's network
"""
import argparse
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

PREFIX = "gsmh"  # every namespace and link made here: gsmh<pid>n<seq>[h<i>|v<i>]
POOL = ipaddress.ip_network("10.250.0.0/16")
SUBNET_PREFIX = 28
MAX_HOSTS = 2 ** (32 - SUBNET_PREFIX) - 3  # minus network, broadcast and the bridge's address
LOCK = "/run/lock/gradsync-multihost.lock"
RUNDIR = "/run/gradsync-multihost"  # the runs' launch agents
NAME_RE = re.compile(rf"^{PREFIX}(\d+)n(\d+)")
EXIT_TIMEOUT = 124

_seq = 0
_seq_lock = threading.Lock()


class HarnessError(RuntimeError):
    """The hosts could not be made (not root, no namespaces, no free subnet, ...)."""


class Interrupted(BaseException):
    """A termination signal arrived; raised so that every `finally` (the clean-up) runs."""

    def __init__(self, signum):
        super().__init__(f"signal {signum}")
        self.signum = signum


@dataclass
class Result:
    status: int       # mpirun's exit status; EXIT_TIMEOUT if it was killed at the deadline
    output: str       # stdout and stderr of the whole job, interleaved
    seconds: float
    timed_out: bool


def _ip(*args, check=True):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(ns):
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _runs(pid, program):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return program.encode() in f.read()
    except OSError:
        return False


def _ns_inode(pid, kind):
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _our_netns():
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
            if NAME_RE.match(line.split()[0] if line.split() else "")]


def _our_links():
    out = _ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if NAME_RE.match(n)]


def _kill_netns(ns, deadline=10.0):
    """SIGKILLs every process in the network namespace until none is left (bounded)."""
    end = time.monotonic() + deadline
    while True:
        pids = _netns_pids(ns)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def _remove(netns, links):
    for ns in netns:
        _kill_netns(ns)
        _ip("netns", "delete", ns, check=False)
    for link in links:
        _ip("link", "delete", link, check=False)


def sweep_stale():
    """Removes what runs whose process has died (e.g. SIGKILLed by ctest) left behind."""
    def stale(name):
        return not _alive(int(NAME_RE.match(name).group(1)))
    _remove([ns for ns in _our_netns() if stale(ns)], [link for link in _our_links() if stale(link)])
    if os.path.isdir(RUNDIR):
        for entry in os.listdir(RUNDIR):
            if NAME_RE.match(entry) and stale(entry):
                shutil.rmtree(os.path.join(RUNDIR, entry), ignore_errors=True)


def _disable_ipv6(path):
    try:
        with open(path, "w") as f:
            f.write("1")
    except OSError:
        pass  # a kernel without IPv6 sends none


AGENT = r"""#!/bin/sh
# Launch agent for mpirun (in place of ssh): AGENT [options] HOST COMMAND... runs COMMAND, joined
# into one shell command line as ssh would, inside HOST's namespaces.
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
[ $# -gt 0 ] || { echo "launch agent: no host given" >&2; exit 2; }
host="$1"; shift
case "$host" in
@CASES@
  *) echo "launch agent: $host is not a host of this run" >&2; exit 2 ;;
esac
exec ip netns exec "$ns" unshare --ipc --mount --uts @PID@--propagation private sh -c '
  mount -t tmpfs -o mode=1777 tmpfs /dev/shm && mount -t tmpfs -o mode=1777 tmpfs @SESSIONS@ && hostname "$0" ||
    exit 1
  @EXEC@sh -c "$*"@REAP@' "$name" "$@"@DETACH@
"""


class Job:
    """One mpirun across the hosts; its output is collected (and echoed if asked) as it comes."""

    def __init__(self, argv, env, echo):
        self.start_time = time.monotonic()
        # A session of its own: the clean-up can kill mpirun and whatever it forked in one go,
        # and a terminal's Ctrl-C reaches the harness, which decides.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, text=True, errors="replace", bufsize=1)
        self.lines = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(echo,), daemon=True)
        self._reader.start()

    def _read(self, echo):
        for line in self.proc.stdout:
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def output(self):
        with self._cond:
            return "".join(self.lines)

    def wait_for(self, pattern, count=1, timeout=30.0):
        """Waits until `count` output lines match `pattern`; False at the timeout or job end."""
        regex = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cond:
            while sum(1 for line in self.lines if regex.search(line)) < count:
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def wait(self, timeout):
        """Waits up to `timeout` more seconds for mpirun to exit, else kills it (EXIT_TIMEOUT)."""
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        seconds = time.monotonic() - self.start_time
        self._reader.join(5)
        status = EXIT_TIMEOUT if timed_out else self.proc.returncode
        if status < 0:
            status = 128 - status
        return Result(status, self.output(), seconds, timed_out)


class Hosts:
    """Makes the hosts on entry and removes them, and every process in them, on exit."""

    def __init__(self, layout, mpirun="mpirun", mca=(), echo=False, pid_namespaces=False):
        # pid_namespaces: each host's processes in a PID namespace of their own too, so that no
        # rank sees another host's processes (their deaths) by PID, as on separate machines.
        self.pid_namespaces = pid_namespaces
        self.layout = [int(n) for n in layout]
        if not self.layout or any(n < 1 for n in self.layout) or len(self.layout) > MAX_HOSTS:
            raise HarnessError(f"a layout is 1 to {MAX_HOSTS} hosts of at least 1 rank each, not {layout}")
        self.mpirun = shutil.which(mpirun) or mpirun
        self.extra_mca = list(mca)
        self.echo = echo
        global _seq
        with _seq_lock:
            self.tag = f"{PREFIX}{os.getpid()}n{_seq}"
            _seq += 1
        self.bridge = self.tag
        self.netns = [f"{self.tag}h{i}" for i in range(len(self.layout))]
        self.veths = [f"{self.tag}v{i}" for i in range(len(self.layout))]
        self.names = [f"h{i}" for i in range(len(self.layout))]
        self.subnet = None
        self.addresses = []
        self.netns_inodes = []
        self.stragglers = []  # processes close() found in the namespaces after killing them
        self.jobs = []
        self.tmpdir = None

    # ------------------------------------------------------------------ making and removing

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check_privileges(self):
        if os.geteuid() != 0:
            raise HarnessError("making network, IPC, mount and UTS namespaces needs root")
        for tool in ("ip", "unshare", "mount", "hostname"):
            if not shutil.which(tool):
                raise HarnessError(f"{tool} not found (scripts/setup.sh installs iproute2 and util-linux)")

    def _choose_subnet(self):
        """A /28 of POOL that no interface of this machine uses, and no route outside our runs covers."""
        used = []
        for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
            m = re.search(r"inet (\S+)", line)
            if m:
                used.append(ipaddress.ip_interface(m.group(1)).network)
        for line in _ip("-4", "route", "show").stdout.splitlines():
            fields = line.split()
            dev = fields[fields.index("dev") + 1] if "dev" in fields else ""
            if fields[0] == "default" or NAME_RE.match(dev):
                continue
            if ipaddress.ip_network(fields[0], strict=False).overlaps(POOL):
                raise HarnessError(f"route {line.strip()} overlaps {POOL}, the hosts' address pool")
        blocks = list(POOL.subnets(new_prefix=SUBNET_PREFIX))
        start = os.getpid() % len(blocks)
        for k in range(len(blocks)):
            block = blocks[(start + k) % len(blocks)]
            if not any(block.overlaps(u) for u in used):
                return block
        raise HarnessError(f"no free /{SUBNET_PREFIX} left in {POOL}")

    def _make(self):
        self._check_privileges()
        sweep_stale()
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the subnet is taken when the bridge holds its address
            self.subnet = self._choose_subnet()
            first, *rest = list(self.subnet.hosts())
            _ip("link", "add", self.bridge, "type", "bridge")
            _disable_ipv6(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6")
            _ip("addr", "add", f"{first}/{SUBNET_PREFIX}", "dev", self.bridge)
        self.bridge_address = str(first)
        self.addresses = [str(a) for a in rest[:len(self.layout)]]
        for ns, veth, addr in zip(self.netns, self.veths, self.addresses):
            _ip("netns", "add", ns)
            self.netns_inodes.append(os.stat(f"/run/netns/{ns}").st_ino)
            # IPv6 off before any link is up: no router solicitations or DAD on the bridge.
            subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                            "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 > $f; done"],
                           capture_output=True)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _disable_ipv6(f"/proc/sys/net/ipv6/conf/{veth}/disable_ipv6")
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{SUBNET_PREFIX}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", self.bridge, "up")
        # Outside every directory a host covers with its own tmpfs: the daemons run the agent too.
        os.makedirs(RUNDIR, exist_ok=True)
        self.tmpdir = tempfile.mkdtemp(prefix=f"{self.tag}-", dir=RUNDIR)
        cases = "\n".join(f"  {addr}) ns={ns}; name={name} ;;"
                          for addr, ns, name in zip(self.addresses, self.netns, self.names))
        self.agent = os.path.join(self.tmpdir, "agent")
        # Open MPI's session files go here (orte_tmpdir_base), which each host covers with a tmpfs
        # of its own: nothing a host writes there outlives it, and /tmp, where a program may live,
        # is left as it is.
        self.sessions = os.path.join(self.tmpdir, "sessions")
        os.makedirs(self.sessions, exist_ok=True)
        with open(self.agent, "w") as f:
            f.write(AGENT.replace("@CASES@", cases).replace("@SESSIONS@", self.sessions)
                    .replace("@PID@", "--pid --fork --mount-proc " if self.pid_namespaces else "")
                    # The shell stays the namespace's init, and lives while anything else in it
                    # does: the daemon (orted --daemonize) leaves the command, and the init's end
                    # would kill it.
                    .replace("@EXEC@", "" if self.pid_namespaces else "exec ")
                    .replace("@REAP@", "; while kill -0 -1 2>/dev/null; do sleep 0.2; done" if self.pid_namespaces
                             else "")
                    # and the agent returns at once, as ssh does once the daemon is up: mpirun
                    # takes a launch agent's death (in a host's loss) for a failed launch.
                    .replace("@DETACH@", " </dev/null >/dev/null 2>&1 &" if self.pid_namespaces else "")
                    .replace("exec ip netns", "ip netns" if self.pid_namespaces else "exec ip netns"))
        os.chmod(self.agent, 0o755)

    def close(self):
        """Removes everything this run made; safe to call again and after a partial _make."""
        for job in self.jobs:
            job.kill()
        existing = [ns for ns in self.netns if os.path.exists(f"/run/netns/{ns}")]
        # The namespaces stay pinned (open) until the processes left in them are looked for: a
        # namespace freed gives its inode number to the next one made (a run beside this one), whose
        # processes would then pass for ours.
        pins = []
        for ns in existing:
            try:
                pins.append(os.open(f"/run/netns/{ns}", os.O_RDONLY))
            except OSError:
                pass
        try:
            _remove(existing, [])
            if pins:
                inodes = set(self.netns_inodes)
                self.stragglers = [pid for pid in filter(str.isdigit, os.listdir("/proc"))
                                   if _ns_inode(pid, "net") in inodes]
        finally:
            for fd in pins:
                os.close(fd)
        _remove([], [link for link in self.veths + [self.bridge] if link in _our_links()])
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def leftovers(self):
        """What of this run is still there: namespaces, links, files, processes in its namespaces
        (as close() found them, while the namespaces were still its own)."""
        left = [f"netns {ns}" for ns in self.netns if ns in _our_netns()]
        left += [f"link {link}" for link in _our_links() if link.startswith(self.tag)]
        if self.tmpdir and os.path.exists(self.tmpdir):
            left.append(f"directory {self.tmpdir}")
        left += [f"process {pid} in a host's network namespace" for pid in self.stragglers]
        return left

    # ------------------------------------------------------------------ running

    def mpirun_argv(self, argv, mca=()):
        hosts = ",".join(f"{addr}:{n}" for addr, n in zip(self.addresses, self.layout))
        params = [("plm_rsh_agent", self.agent),
                  ("plm_rsh_no_tree_spawn", "1"),  # every daemon from mpirun, through the agent
                  ("oob_tcp_if_include", str(self.subnet)),
                  ("btl_tcp_if_include", str(self.subnet)),
                  ("btl", "self,vader,tcp"),
                  ("orte_tmpdir_base", self.sessions),
                  # Ranks outnumber cores: without it flat MPI_Allreduce of 1K floats over 2 hosts
                  # x 2 ranks takes milliseconds instead of tens of microseconds.
                  ("mpi_yield_when_idle", "1")]
        params += list(self.extra_mca) + list(mca)
        cmd = [self.mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
        for name, value in params:
            cmd += ["--mca", name, str(value)]
        return cmd + ["-H", hosts, "-np", str(sum(self.layout)), *argv]

    def start(self, argv, mca=(), mpirun_args=(), env=None):
        """Starts argv under mpirun across the hosts; returns the Job."""
        cmd = self.mpirun_argv(argv, mca)
        cmd[1:1] = list(mpirun_args)
        full_env = dict(os.environ if env is None else env)
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        job = Job(cmd, full_env, self.echo)
        self.jobs.append(job)
        return job

    def run(self, argv, timeout, **kw):
        return self.start(argv, **kw).wait(timeout)

    def pids(self, host):
        """Every process in host's network namespace (its daemon and ranks)."""
        return _netns_pids(self.netns[host])

    def running(self, program):
        """The processes on any host whose command line holds `program` (a job's ranks, say)."""
        return [p for i in range(len(self.layout)) for p in self.pids(i) if _runs(p, program)]

    def wait_ended(self, program, timeout=30.0):
        """Waits until no process of `program` is left on any host; returns those left. mpirun under
        --enable-recovery across hosts may stay after every rank has ended (Open MPI 4.1, after a
        lost rank): a job's end is its ranks' end."""
        end = time.monotonic() + timeout
        while True:
            left = self.running(program)
            if not left or time.monotonic() >= end:
                return left
            time.sleep(0.1)

    def host_namespaces(self, host):
        """The (ipc, mnt, uts) namespace inodes of host's ranks' processes, as seen now."""
        return {(_ns_inode(p, "ipc"), _ns_inode(p, "mnt"), _ns_inode(p, "uts")) for p in self.pids(host)}

    def kill_host(self, host, only=None):
        """SIGKILLs host's processes (those whose command line contains `only`, if given)."""
        killed = []
        for pid in self.pids(host):
            if only is not None:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if only.encode() not in f.read():
                            continue
                except OSError:
                    continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def exec(self, host, argv, **popen_kw):
        """Starts a plain process in host's network namespace (not inside a job's IPC namespace)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns[host], *argv], **popen_kw)


class Local:
    """Hosts' interface on this machine alone: one plain mpirun, no namespaces. For the tests that
    also run in the sanitizer builds, whose stages leave out the namespace hosts. A job's processes
    are those of its session (mpirun starts it; on one host its ranks and spawned ones are its own)."""

    def __init__(self, ranks, mpirun="mpirun"):
        self.layout = [ranks]
        self.mpirun = mpirun
        self.jobs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for job in self.jobs:
            job.kill()

    def start(self, argv, mca=(), mpirun_args=(), env=None):
        cmd = [self.mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", *mpirun_args]
        for name, value in mca:
            cmd += ["--mca", name, str(value)]
        cmd += ["-np", str(self.layout[0]), *argv]
        full_env = dict(os.environ if env is None else env)
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        job = Job(cmd, full_env, False)
        self.jobs.append(job)
        return job

    def running(self, program):
        sessions = {job.proc.pid for job in self.jobs}
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    session = int(f.read().rsplit(")", 1)[1].split()[4])
            except (OSError, ValueError, IndexError):
                continue
            if session in sessions and _runs(int(entry), program):
                left.append(int(entry))
        return left

    wait_ended = Hosts.wait_ended


# ---------------------------------------------------------------------- signals and the CLI

class signals_raise:
    """While active (main thread only), SIGINT/SIGTERM/SIGHUP raise Interrupted, so clean-up runs."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.saved[s] = signal.signal(s, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Interrupted(signum)

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)
        return False


def run(layout, argv, timeout, **kw):
    """Makes the hosts, runs argv across them, removes everything; returns a Result."""
    with signals_raise():
        with Hosts(layout, **{k: kw.pop(k) for k in ("mpirun", "mca", "echo") if k in kw}) as h:
            return h.run(argv, timeout, **kw)


def parse_layout(text):
    try:
        layout = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is ranks per host, comma-separated (2,2 or 1,2), not {text!r}")
    if not layout or any(n < 1 for n in layout):
        raise argparse.ArgumentTypeError(f"every host needs at least one rank: {text!r}")
    return layout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s --layout 2,2 [--timeout S] [--mca NAME VALUE]... -- PROGRAM ARGS...")
    ap.add_argument("--layout", type=parse_layout, required=True, help="ranks per host, e.g. 2,2 or 1,2")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds before the job is killed (exit status 124); default 120")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--mca", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="another Open MPI parameter")
    ap.add_argument("program", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        ap.error("no program given (after --)")
    try:
        with signals_raise():
            with Hosts(args.layout, mpirun=args.mpirun, mca=args.mca, echo=True) as h:
                print(f"hosts: {' '.join(f'{n}={a} ({r} ranks)' for n, a, r in zip(h.names, h.addresses, h.layout))}"
                      f" on {h.subnet}", flush=True)
                result = h.run(program, args.timeout)
            left = h.leftovers()
    except HarnessError as e:
        print(f"hosts: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"hosts: interrupted by signal {e.signum}; cleaned up", file=sys.stderr)
        return 128 + e.signum
    if result.timed_out:
        print(f"hosts: the job did not end within {args.timeout:g} s and was killed", file=sys.stderr)
    if left:
        print(f"hosts: left behind: {', '.join(left)}", file=sys.stderr)
        return result.status or 1
    return result.status


if __name__ == "__main__":
    sys.exit(main())
