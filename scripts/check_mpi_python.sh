#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The MPI transport through its plugin, from an installed Python package, under a real mpirun:
# two ranks sum, from outside any checkout, with nothing of the build in the environment.
#   scripts/check_mpi_python.sh PYTHON [PYTHONPATH]
set -euo pipefail
python="$1"
cd /
env -u GRADSYNC_LIBRARY -u LD_LIBRARY_PATH -u GRADSYNC_MPI_PLUGIN PYTHONPATH="${2:-}" \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 "$python" -c '
import numpy as np, gradsync as gs
with gs.Communicator(transport="mpi", timeout_ms=30000) as c:
    x = np.full(3, c.rank + 1, np.float32)
    c.allreduce(x, op="sum")
    assert x.tolist() == [3.0] * 3, x
    print(f"python over MPI through the plugin: rank {c.rank} of {c.size} sums {x.tolist()}", flush=True)
'
