# SPDX-License-Identifier: Apache-2.0
"""What the Python bindings copy by hand from the C headers must match them: status codes, the ABI
version, and every options struct the bindings pass, field for field. Parses the headers, so a
change on one side without the other fails here."""
import ctypes
import pathlib
import re

import pytest

import gradsync as gs
from gradsync import _lib, comm, embedding, shard, table

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADERS = ROOT / "include" / "gradsync"

C_TYPES = {"uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64,
           "int64_t": ctypes.c_int64, "double": ctypes.c_double}


def header(name):
    return (HEADERS / name).read_text()


def c_struct_fields(text, struct):
    """[(name, ctypes type or ('char', n))] of `typedef struct <struct> { ... }`."""
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"char (\w+)\[(\w+)\]", decl)
        if m:
            fields.append((m.group(1), ("char", m.group(2))))
            continue
        ctype, name = decl.rsplit(" ", 1)
        fields.append((name, C_TYPES[ctype]))
    return fields


def test_status_codes_match_errors_h():
    codes = dict(re.findall(r"GRADSYNC_(E_\w+|OK) = (-?\d+)", header("errors.h")))
    assert codes, "no status codes parsed from errors.h"
    for name, value in codes.items():
        assert getattr(gs, name) == int(value), name
        text = _lib.lib.gradsync_status_string(int(value)).decode()
        assert text.startswith(f"GRADSYNC_{name}"), (name, text)
    python_side = {n for n in dir(_lib) if re.fullmatch(r"E_\w+|OK", n)}
    assert python_side == set(codes), python_side ^ set(codes)


def test_abi_version_is_one_number():
    cmake = re.search(r"set\(GRADSYNC_ABI_VERSION (\d+)\)", (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert _lib.ABI_VERSION == int(cmake) == _lib.lib.gradsync_abi_version()
    assert _lib.SONAME == f"libgradsync.so.{cmake}"


@pytest.mark.parametrize("hdr, struct, mirror", [
    ("comm.h", "gradsync_comm_options", comm.CommOptions),
    ("comm.h", "gradsync_shrink_result", comm.ShrinkResult),
    ("comm.h", "gradsync_grow_result", comm.GrowResult),
    ("shard.h", "gradsync_shard_options", shard.ShardOptions),
    ("table.h", "gradsync_table_options", table._TableOptions),
    ("accumulator.h", "gradsync_accum_options", table._AccumOptions),
    ("accumulator.h", "gradsync_optimizer", table._Optimizer),
    ("embedding.h", "gradsync_embedding_options", embedding.EmbeddingOptions),
])
def test_options_structs_are_mirrored_field_for_field(hdr, struct, mirror):
    expected = c_struct_fields(header(hdr), struct)
    got = list(mirror._fields_)
    assert [n for n, _ in got] == [n for n, _ in expected], f"{struct}: fields differ"
    for (name, ptype), (_, ctype) in zip(got, expected):
        if isinstance(ctype, tuple):
            assert issubclass(ptype, ctypes.Array) and ptype._type_ is ctypes.c_char, name
        else:
            assert ptype is ctype, f"{struct}.{name}: {ptype} for {ctype}"


def test_collective_indexes_match_comm_h():
    values = {int(v): n.lower() for n, v in re.findall(r"GRADSYNC_COLLECTIVE_(\w+) = (\d+)", header("comm.h"))}
    assert values and comm.COLLECTIVES == values
    slots = int(re.search(r"#define GRADSYNC_COLLECTIVE_SLOTS (\d+)", header("comm.h")).group(1))
    assert len(comm._Statistics._fields_[-1][1]()) == slots
