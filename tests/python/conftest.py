# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the Python tests; import them with `from conftest import run_ranks`."""
import itertools
import threading

_group_numbers = itertools.count()


def fresh_group_name(prefix="pytest"):
    """A communicator group name no other test in this process has used."""
    return f"{prefix}-{next(_group_numbers)}"


def run_ranks(size, body, timeout_ms=20000):
    """Run body(comm, rank) on `size` threads forming one fresh group; return results by rank or raise the first error."""
    import gradsync as gs  # late: test modules that never need it must not load the library here

    name = fresh_group_name()
    results, errors = [None] * size, [None] * size

    def worker(rank):
        try:
            with gs.Communicator(name, rank, size, timeout_ms=timeout_ms) as comm:
                results[rank] = body(comm, rank)
        except BaseException as exc:  # reported on the main thread
            errors[rank] = exc

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank did not finish"
    for e in errors:
        if e is not None:
            raise e
    return results
