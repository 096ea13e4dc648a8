#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""gradsync.torch.elastic across hosts: a ZeroRedundancyOptimizer(replicas=1) on the hierarchical
transport, started by mpirun (every rank `Communicator.from_env()` with GRADSYNC_TRANSPORT=hier).
Once every rank is past step KILL_AT - 1, the ranks of one host (MPI_COMM_WORLD ranks 2 and 3:
shrink_hosts.py --what host --mode torch puts exactly them on the lost host) SIGKILL themselves
before their step; the harness then kills their host. The others, inside the step, see them gone
(liveness links), and elastic.run recovers: shrink, reshard Adam's slices from their replicas
(the replica ring put them on other hosts), go on from the last commit. Every weight must then
equal, bit for bit, a one-rank run's: every rank's gradient is the same exact value (multiples of
1/256), so its mean is the same on any number of ranks, and Adam is elementwise.

With the argument `grow` (grow_hosts.py --mode torch) only rank 3 SIGKILLs itself (its host and
Open MPI daemon live on); after the recovery, at step GROW_AT, the members grow back to 4 ranks
(state.grow: MPI spawns this program again, with GRADSYNC_JOIN set, and it joins with
elastic.join): the joiner takes the parameters by broadcast and its Adam slices by reshard, and
every rank, the joiner too, must end bitwise at the one-rank run's weights.

It prints what shrink_hosts.py checks, in the words of tests/mpi/shrink_program.c: "rank R: call
<status>: ..." (the error the recovery began with), "rank R: shrunk failed [..] size N attempts
A", "rank R: verified W on N ranks" and "rank R: done", R being the MPI_COMM_WORLD rank (the
joiner's lines begin "joiner 0:").
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gradsync as gs  # noqa: E402
from gradsync.torch import ZeroRedundancyOptimizer, elastic  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from elastic_model import exact_grad, net  # noqa: E402

STEPS = 12
KILL_AT = 6
GROW_AT = 9
GROW = sys.argv[1:] == ["grow"]
VICTIMS = (3,) if GROW else (2, 3)  # MPI_COMM_WORLD ranks: the lost host's, or one rank of it
JOIN = os.environ.get("GRADSYNC_JOIN")  # set in the process that the members' grow started


def say(line):
    # One write per line, newline included: mpirun passes on each process's output as it reads it,
    # and a line written in two pieces can end up with another rank's line in between.
    sys.stdout.flush()
    os.write(1, f"{WHO}: {line}\n".encode())


WORLD = int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
WHO = f"joiner {WORLD}" if JOIN else f"rank {WORLD}"


def train(comm, victims=(), grow_to=0):
    """STEPS steps of ZeRO-1 Adam under the elastic helper; the victims SIGKILL themselves before
    step KILL_AT, once every rank is past the step before it (a barrier: a death inside MPI's
    blocking transfer would end the job instead, by design). grow_to: the members grow back to that
    many ranks at step GROW_AT; comm None: this process joins (JOIN)."""
    model = net()

    def build(c, joining=False):
        return model, ZeroRedundancyOptimizer(model.parameters(), c, optimizer="adam", lr=0.01, replicas=1,
                                              joining=joining)

    if comm is None:
        state = elastic.join(JOIN, build)  # the transport from GRADSYNC_TRANSPORT, as from_env takes it
    else:
        state = elastic.State(comm, *build(comm))

    @elastic.run
    def loop(state):
        while state.step < STEPS:
            if victims and state.step == KILL_AT and not state.recoveries and not JOIN:
                state.comm.barrier()
                say("looping")
                if WORLD in victims:
                    say("dies")
                    os.kill(os.getpid(), signal.SIGKILL)
            if state.step == GROW_AT and state.comm.size < grow_to:
                state.grow("torch-elastic-grow", grow_to - state.comm.size)
            for i, p in enumerate(model.parameters()):
                p.grad = exact_grad(state.step, p.shape, i)
            state.optimizer.step()
            state.step += 1
            state.commit()

    loop(state)
    return [p.detach().numpy().copy() for p in model.parameters()], state


def main():
    torch.set_num_threads(1)
    if JOIN:
        weights, state = train(None)
    else:
        comm = gs.Communicator.from_env(timeout_ms=int(os.environ.get("SHRINK_TIMEOUT_MS", "120000")))
        weights, state = train(comm, VICTIMS, grow_to=comm.size if GROW else 0)
    for rec in state.recoveries:
        status = re.match(r"\s*(GRADSYNC_E_\w+)", rec["error"] or "")
        say(f"call {status.group(1) if status else 'unknown'}: {rec['error']}")
        lost = [r for failed in rec["failed"] for r in failed]
        say(f"shrunk failed [{','.join(map(str, lost))}] size {rec['size']} attempts {rec['attempts']} "
            f"shrink_s {rec['shrink_s']:.3f} reshard_s {rec['reshard_s']:.3f} total_s {rec['total_s']:.3f}")
    with gs.Communicator("torch-elastic-reference", 0, 1, transport="threads") as one:
        reference, _ = train(one)
    differ = sum(int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))) for a, b in zip(weights, reference))
    total = sum(a.size for a in weights)
    for rec in state.grows:
        say(f"grew to {rec['size']} first_member_id {rec['first_member_id']} grow_s {rec['grow_s']:.3f} "
            f"admit_s {rec['admit_s']:.3f}")
    recoveries, grows = (0, 0) if JOIN else (1, 1 if GROW else 0)
    if differ or len(state.recoveries) != recoveries or len(state.grows) != grows:
        say(f"WRONG weights after the loss: {differ} of {total} differ, {len(state.recoveries)} recoveries, "
            f"{len(state.grows)} grows")
        sys.exit(1)
    say(f"verified {total} on {state.comm.size} ranks")
    say("done")
    # At exit the library ends the job with MPI_Abort: the lost ranks' requests stay abandoned.


if __name__ == "__main__":
    main()
