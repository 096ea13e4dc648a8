#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package the normal way, offline: pip installs this checkout into a virtual environment,
# and builds the wheel from it with Debian's setuptools (the library and its MPI plugin compiled by
# CMake inside it) that a second, fresh virtual environment installs; `import gradsync` works from
# any directory with nothing else set, and the MPI transport works through the plugin.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# pip install ./ into a virtual environment, as the README says; then the wheel into a second one.
/usr/bin/python3 -m venv --system-site-packages "$work/direct"
"$work/direct/bin/pip" install -q --no-build-isolation --no-index --no-deps "$root"
(cd / && env -u GRADSYNC_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH "$work/direct/bin/python" -c '
import os, gradsync as gs
where = os.path.dirname(gs.__file__)
assert "site-packages" in where and gs.has_feature(gs.FEATURE_MPI_TRANSPORT), where
print("pip install ./: gradsync", gs.version(), "from", where)')
/usr/bin/python3 -m pip wheel --no-build-isolation --no-deps -q -w "$work/dist" "$root"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q --no-index --no-deps "$work"/dist/gradsync-*.whl
cd /
env -u GRADSYNC_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH "$work/venv/bin/python" - <<'PY'
import os, threading
import numpy as np
import gradsync as gs
where = os.path.dirname(gs.__file__)
assert "site-packages" in where and os.path.exists(os.path.join(where, "libgradsync.so.0")), where
assert os.path.exists(os.path.join(where, "libgradsync-mpi.so.0")), "the wheel lacks the MPI plugin"
assert gs.has_feature(gs.FEATURE_MPI_TRANSPORT), "the wheel's MPI plugin does not load"
out = [None, None]
def worker(rank):
    with gs.Communicator("wheel", rank, 2) as comm:
        out[rank] = comm.allreduce(np.full(4, rank + 1, np.float32), op="sum")
threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
for t in threads: t.start()
for t in threads: t.join()
assert all((o == 3).all() for o in out), out
print("wheel: gradsync", gs.version(), "from", where, "- a 2-thread allreduce gives", out[0])
PY
# The MPI transport from the wheel, through its plugin, under a real mpirun.
"$root/scripts/check_mpi_python.sh" "$work/venv/bin/python"
