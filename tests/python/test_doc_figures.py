# SPDX-License-Identifier: Apache-2.0
"""The tuning figures in docs/api.md are the code's: each row of its table is tied to the constants
it states, read from the sources, so that changing one without the other fails here. A new row
needs an entry in FIGURES."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _constant(path, name):
    """The value of `name` as the source defines it: `name = <expr>;`, `name{<expr>}` or
    `name(<expr>)` (a chrono duration's count), with C++ literal suffixes and size_t{} casts folded."""
    text = (ROOT / path).read_text()
    m = re.search(r"\b%s\s*(?:=\s*([^;]+);|\{([^}]*)\})" % re.escape(name), text)
    assert m, f"{path}: no definition of {name}"
    expr = (m.group(1) or m.group(2)).strip()
    expr = re.sub(r"std::chrono::\w+\s*[({]([^)}]*)[)}]", r"\1", expr)
    expr = re.sub(r"\b(?:size_t|uint64_t|int64_t|uint32_t)\{([^}]*)\}", r"(\1)", expr)
    expr = re.sub(r"(\d+)(?:u|ull|ul|ll)\b", r"\1", expr)
    assert re.fullmatch(r"[\d\s*+<()]+", expr), f"{path}: {name} = {expr!r} is not a plain number"
    return eval(expr)  # digits and operators only, checked above


def _bytes(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _ms(n):
    return f"{n} ms"


def _s(n):
    return f"{n} s"


# A phrase of the row's first cell -> [(file, constant, how the docs write it)], in the order the
# row's value states them.
FIGURES = {
    "payloads sent inline with the round": [("src/comm/engine/control.hpp", "kInlineBytes", _bytes)],
    "reduced in place from its buffers": [("src/comm/algorithms/shared_memory.cpp", "kInPlaceFromBytes", _bytes)],
    "pipeline chunk of the staged (copy) path": [("src/comm/engine/control.hpp", "kChunkBytes", _bytes)],
    "a dead peer is noticed while waiting": [("src/comm/engine/round_engine.hpp", "kLivenessInterval", _ms)],
    "MPI: an allreduce carried in the call's exchange": [
        ("src/comm/transport/mpi/mpi_communicator.cpp", "kPackBytes", _bytes),
        ("src/comm/transport/mpi/mpi_communicator.cpp", "kPackBudget", _bytes)],
    "allreduce_many's staging buffer": [("src/comm/transport/mpi/mpi_collectives.cpp", "kStagingBytes", _bytes)],
    "liveness check of peers on this host": [("src/comm/transport/mpi/mpi_communicator.cpp", "kLivenessPeriod", _ms)],
    "block of dst guarded by one spin lock": [("src/atomics/atomic_add.hpp", "kStripeBytes", _bytes)],
    "a wait is logged at warning level": [("src/common/wait.hpp", "kStragglerReportAfter", _s),
                                          ("src/common/wait.hpp", "kStragglerReportEvery", _s)],
    "an open waits for another opener's exclusive lock": [("src/table/table.hpp", "open_lock_timeout",
                                                           lambda ms: _s(ms // 1000))],
    "an add waits for a row lock": [("src/accumulator/accumulator.hpp", "kRowLockTimeout", _s)],
}


def _rows():
    text = (ROOT / "docs" / "api.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] not in ("what", "---"):
            rows.append(cells)
    return rows


def test_every_figure_in_the_docs_is_the_codes():
    rows = _rows()
    assert len(rows) >= len(FIGURES), "the figures table of docs/api.md was not found"
    for what, value in rows:
        keys = [k for k in FIGURES if k in what]
        assert len(keys) == 1, f"docs/api.md row {what!r}: tie it to its constants in FIGURES (found {keys})"
        at = 0
        for path, name, render in FIGURES[keys[0]]:
            shown = render(_constant(path, name))
            found = value.find(shown, at)
            assert found >= 0, f"docs/api.md says {value!r} for {what!r}, but {path} has {name} = {shown}"
            at = found + len(shown)


def test_the_reader_reads_what_it_should():
    # The folding above, on the forms the sources use.
    assert _bytes(16 * 1024) == "16 KiB" and _bytes(512) == "512 bytes" and _bytes(8 << 20) == "8 MiB"
    assert _constant("src/comm/engine/control.hpp", "kChunkBytes") == 256 * 1024
    assert _constant("src/common/wait.hpp", "kStragglerReportEvery") == 10
