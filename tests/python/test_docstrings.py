# SPDX-License-Identifier: Apache-2.0
"""Every public definition of the Python package has a docstring, so that help(gradsync.X) reads
like the C header's contract: each public module's classes, functions, methods and properties
(names without a leading underscore, defined in the package itself), subpackages included."""
import importlib
import inspect
import pkgutil

import gradsync


def _function_of(value):
    if isinstance(value, property):
        return value.fget
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if inspect.isfunction(value) or inspect.isclass(value):
        return value
    return None


def _public_definitions():
    seen = {}

    def walk(namespace, prefix):
        for name, value in vars(namespace).items():
            f = _function_of(value)
            if name.startswith("_") or f is None:
                continue
            if not getattr(f, "__module__", "").startswith("gradsync"):
                continue  # imported from numpy, ctypes, torch...
            key = prefix + name
            if key in seen:
                continue
            seen[key] = f
            if inspect.isclass(f):
                walk(f, key + ".")

    # Subpackages too (gradsync.torch.elastic); a package that cannot be imported (gradsync.torch
    # without torch) is skipped with everything in it.
    for info in pkgutil.walk_packages(gradsync.__path__, "gradsync.", onerror=lambda name: None):
        short = info.name[len("gradsync."):]
        if any(part.startswith("_") for part in short.split(".")):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        walk(module, short + ".")
    return seen


def test_every_public_definition_has_a_docstring():
    definitions = _public_definitions()
    assert len(definitions) > 150, "the walk found too few definitions to be walking the package"
    missing = sorted(k for k, f in definitions.items() if not (f.__doc__ or "").strip())
    assert not missing, f"public definitions without a docstring: {missing}"


def test_the_nonblocking_forms_name_their_blocking_form():
    comm = importlib.import_module("gradsync.comm")
    for name, f in vars(comm.Communicator).items():
        if name.startswith("i") and callable(f) and hasattr(comm.Communicator, name[1:]):
            assert f"{name[1:]}()" in f.__doc__, f"Communicator.{name}'s docstring should name {name[1:]}()"
