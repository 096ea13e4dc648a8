# SPDX-License-Identifier: Apache-2.0
"""The PEP 517 build backend of the gradsync Python package (pyproject.toml names it).

It needs nothing beyond the Python standard library, CMake and a C++ compiler, so `pip install .`
works offline with any CPython >= 3.9: pip has no build requirement to download. CMake builds
libgradsync (and its MPI plugin when Open MPI is found) and the wheel carries them inside the
package beside the ctypes bindings of scripts/gradsync.

The CMake build lives in build/python of the source tree unless the config setting `build-dir`
names another (`pip install . --config-settings build-dir=build`): an already configured build is
only brought up to date, with the options it was configured with.
"""
import base64
import csv
import hashlib
import io
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "gradsync"
SOURCE = ROOT / "scripts" / PACKAGE
# Written by CMakeLists.txt into its build directory: one line per library the package carries.
MANIFEST = "gradsync-python-libraries.txt"
# The wheel's files get this time (2020-01-01), so that a wheel of the same build is the same bytes.
EPOCH = (2020, 1, 1, 0, 0, 0)


def _project():
    """pyproject.toml's [project] table: name, version (from CMakeLists.txt, the one place it is
    written), and the fields METADATA needs. tomllib where there is one (3.11+); before, the few
    forms the table uses (strings, lists of strings, inline tables of strings)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
        project = tomllib.loads(text)["project"]
    except ImportError:
        project = _read_project_table(text)
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    project["version"] = re.search(r"project\(gradsync VERSION ([0-9.]+)", cmake).group(1)
    return project


def _read_project_table(text):
    table = re.search(r"^\[project\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M).group(1)
    string = r'"((?:[^"\\]|\\.)*)"'
    project = {}
    for key, value in re.findall(r"^([\w-]+)\s*=\s*(.+?)\s*$", table, re.M):
        if value.startswith('"'):
            project[key] = re.fullmatch(string, value).group(1)
        elif value.startswith("["):
            project[key] = re.findall(string, value)
        elif value.startswith("{"):
            project[key] = dict(re.findall(r"([\w-]+)\s*=\s*" + string, value))
        else:
            raise ValueError(f"pyproject.toml: [project] {key} = {value}: a form this backend does not read")
    return project


def _dist_name(project):
    return re.sub(r"[-_.]+", "_", project["name"]).lower()


def _metadata(project):
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}",
             f"Summary: {project['description']}", f"License: {project['license']['text']}",
             f"Requires-Python: {project['requires-python']}"]
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    readme = ROOT / project["readme"]
    lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + readme.read_text(encoding="utf-8")


def _tag():
    # The bindings are ctypes over a C library: any CPython 3 of this platform, no Python ABI.
    return "py3-none-" + re.sub(r"[-.]", "_", sysconfig.get_platform())


def _run(command):
    print("gradsync build:", " ".join(map(str, command)), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in command], check=True, stdout=sys.stderr)


def _build_libraries(config_settings):
    """Configures (once) and builds libgradsync; returns [(path, name in the package)]."""
    setting = (config_settings or {}).get("build-dir")
    build = pathlib.Path(setting).resolve() if setting else ROOT / "build" / "python"
    if not (build / "CMakeCache.txt").exists():
        _run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
              "-DGRADSYNC_BUILD_TESTS=OFF", "-DGRADSYNC_BUILD_BENCH=OFF"])
    _run(["cmake", "--build", build, "--target", "gradsync", "-j", str(os.cpu_count() or 1)])
    manifest = build / MANIFEST
    if not manifest.exists():
        raise RuntimeError(f"{build} holds no {MANIFEST}: not a CMake build of {ROOT}")
    libraries = []
    for line in manifest.read_text(encoding="utf-8").splitlines():
        path, name = line.split("\t")
        libraries.append((pathlib.Path(path), name))
    return libraries


def _package_files():
    for path in sorted(SOURCE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path, f"{PACKAGE}/{path.relative_to(SOURCE).as_posix()}"


class _Wheel:
    """A zip whose RECORD lists every file with its sha256 and size (the wheel format, PEP 427)."""

    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, name, data, executable=False):
        info = zipfile.ZipInfo(name, EPOCH)
        info.external_attr = (0o755 if executable else 0o644) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append((name, f"sha256={digest}", str(len(data))))

    def close(self, record_name):
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerows(self.record + [(record_name, "", "")])
        info = zipfile.ZipInfo(record_name, EPOCH)
        info.external_attr = 0o644 << 16
        self.zip.writestr(info, out.getvalue(), zipfile.ZIP_DEFLATED)
        self.zip.close()


def _dist_info(project, tag):
    name = f"{_dist_name(project)}-{project['version']}.dist-info"
    wheel = f"Wheel-Version: 1.0\nGenerator: gradsync_backend\nRoot-Is-Purelib: false\nTag: {tag}\n"
    return name, {"METADATA": _metadata(project), "WHEEL": wheel, "top_level.txt": PACKAGE + "\n"}


# ---- PEP 517 hooks ----

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project = _project()
    name, files = _dist_info(project, _tag())
    target = pathlib.Path(metadata_directory) / name
    target.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        (target / file).write_text(text, encoding="utf-8")
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    tag = _tag()
    libraries = _build_libraries(config_settings)
    filename = f"{_dist_name(project)}-{project['version']}-{tag}.whl"
    wheel = _Wheel(pathlib.Path(wheel_directory) / filename)
    for path, name in _package_files():
        wheel.add(name, path.read_bytes())
    for path, name in libraries:
        wheel.add(f"{PACKAGE}/{name}", path.read_bytes(), executable=True)
    dist_info, files = _dist_info(project, tag)
    files["LICENSE"] = (ROOT / "LICENSE").read_text(encoding="utf-8")
    for file, text in files.items():
        wheel.add(f"{dist_info}/{file}", text.encode("utf-8"))
    wheel.close(f"{dist_info}/RECORD")
    return filename


def build_sdist(sdist_directory, config_settings=None):
    """The source tree as scripts/dist.sh packs it, plus PKG-INFO: the tracked files when this is a
    git checkout, otherwise every file but build trees and caches."""
    project = _project()
    base = f"{_dist_name(project)}-{project['version']}"
    try:
        listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True, capture_output=True).stdout
        files = [ROOT / f for f in listed.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = re.compile(r"^(build[^/]*|dist|rust/target|\.git)(/|$)|(^|/)__pycache__(/|$)")
        files = sorted(p for p in ROOT.rglob("*") if p.is_file() and not skip.search(p.relative_to(ROOT).as_posix()))
    filename = f"{base}.tar.gz"
    with tarfile.open(pathlib.Path(sdist_directory) / filename, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            if path.is_file():
                tar.add(path, f"{base}/{path.relative_to(ROOT).as_posix()}", recursive=False)
        data = _metadata(project).encode("utf-8")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size, info.mtime, info.mode = len(data), time.time(), 0o644
        tar.addfile(info, io.BytesIO(data))
    return filename
