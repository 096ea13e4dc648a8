# SPDX-License-Identifier: Apache-2.0
"""Watching a run: Communicator.stats() counts calls and bytes per collective and names the rank
that keeps the others waiting, the same on every rank; GRADSYNC_TIMELINE makes every rank of real
processes write Chrome-trace JSON with each call and its two phases."""
import json
import os
import time

import numpy as np
import pytest

import gradsync as gs
from conftest import run_ranks
from test_shm import _group, _run


def test_stats_count_calls_and_name_the_straggler_alike_on_every_rank():
    def body(comm, rank):
        for _ in range(3):
            if rank == 2:
                time.sleep(0.03)  # rank 2 comes late to every allreduce
            comm.allreduce(np.ones(1000, np.float32))
        comm.broadcast(np.zeros(10, np.float64), root=0)
        with pytest.raises(gs.GradsyncError):  # a mismatch: counted as failed on every rank
            comm.allreduce(np.ones(4 + rank, np.float32))
        comm.barrier()
        return comm.stats()

    stats = run_ranks(3, body)
    for s in stats:
        assert s["straggler"] == 2 and s["size"] == 3 and s["rounds"] >= 3
        c = s["collectives"]
        assert c["allreduce"]["calls"] == 3 and c["allreduce"]["failed"] == 1
        assert c["allreduce"]["bytes"] == 3 * 4000 + 4 * (4 + s["rank"])
        assert c["broadcast"] == {**c["broadcast"], "calls": 1, "failed": 0, "bytes": 80}
        assert c["barrier"]["calls"] == 1 and "alltoall" not in c
        assert s["peers"][2]["late_ns"] >= 3 * 20_000_000 and s["peers"][2]["last"] >= 3
    # Every rank saw the same arrivals, so every rank has the same lateness figures.
    assert stats[0]["peers"] == stats[1]["peers"] == stats[2]["peers"]
    # The ranks that waited for rank 2 spent that time waiting, not moving data.
    assert stats[0]["collectives"]["allreduce"]["wait_ns"] >= 3 * 20_000_000


def _timeline_rank(rank, size, queue, group, prefix):
    os.environ["GRADSYNC_TIMELINE"] = prefix
    with gs.Communicator(group, rank, size, transport="shm", timeout_ms=30000) as comm:
        comm.allreduce(np.ones(1 << 16, np.float32))
        comm.allgather(np.zeros(1000, np.float64))
        comm.iallreduce(np.ones(8, np.float32)).wait()
    queue.put((rank, "ok"))


def test_timeline_of_two_processes_is_chrome_trace_json(tmp_path):
    prefix = str(tmp_path / "trace.json")
    results, codes = _run(_timeline_rank, 2, _group("timeline"), prefix)
    assert codes == [0, 0] and results == {0: "ok", 1: "ok"}
    for rank in range(2):
        doc = json.loads((tmp_path / f"trace.json.{rank}").read_text())
        events = doc["traceEvents"]
        calls = [e for e in events if e.get("cat") == "collective"]
        assert [e["name"] for e in calls] == ["allreduce", "allgather", "allreduce"]
        assert [e["args"]["bytes"] for e in calls] == [4 << 16, 8000, 32]
        assert all(e["ph"] == "X" and e["pid"] == rank and e["args"]["status"] == "ok" for e in calls)
        for call in calls:
            phases = [e for e in events if e.get("cat") == "phase" and e["args"]["call"] == call["args"]["call"]]
            assert sorted(p["name"] for p in phases) == ["data movement", "wait for peers"]
            for p in phases:  # inside the call
                assert call["ts"] - 1e-3 <= p["ts"] and p["ts"] + p["dur"] <= call["ts"] + call["dur"] + 1e-3


def test_timeline_by_call_and_a_clear_error_for_a_path_that_cannot_be_written(tmp_path):
    def body(comm, rank):
        with pytest.raises(gs.GradsyncError) as err:
            comm.timeline(str(tmp_path / "missing-dir" / "t.json"))
        assert err.value.status == gs.E_IO and "missing-dir" in err.value.message
        comm.timeline(str(tmp_path / f"t.{rank}"))
        comm.barrier()
        comm.timeline(None)  # completes the file
        return json.loads((tmp_path / f"t.{rank}").read_text())

    for doc in run_ranks(2, body):
        assert [e["name"] for e in doc["traceEvents"] if e.get("cat") == "collective"] == ["barrier"]
