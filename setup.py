# SPDX-License-Identifier: Apache-2.0
"""Builds libgradsync with CMake and ships it inside the Python package (pip install ., pip wheel .).

Offline (no package index), use the build tools Debian ships: pip install --no-build-isolation .
"""
import os
import pathlib
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
SONAME = "libgradsync.so.0"
MPI_PLUGIN = "libgradsync-mpi.so.0"  # built when CMake finds Open MPI; loaded from beside SONAME


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        build = pathlib.Path(self.build_lib).resolve().parent / "cmake-gradsync"
        # A plugin left by an earlier build whose configure found MPI must not ship with a library
        # configured without it: the build below makes it again when MPI is still there.
        for stale in build.glob(MPI_PLUGIN.replace(".so.0", ".so*")):
            stale.unlink()
        (pathlib.Path(self.build_lib) / "gradsync" / MPI_PLUGIN).unlink(missing_ok=True)
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                               "-DGRADSYNC_BUILD_TESTS=OFF", "-DGRADSYNC_BUILD_BENCH=OFF"])
        subprocess.check_call(["cmake", "--build", str(build), "--target", "gradsync", "-j", str(os.cpu_count() or 1)])
        for name in (SONAME, MPI_PLUGIN):
            if name == MPI_PLUGIN and not (build / name).exists():
                continue
            target = pathlib.Path(self.build_lib) / "gradsync" / name
            shutil.copyfile((build / name).resolve(), target)
            os.chmod(target, 0o755)


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library, so it is specific to this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
