"""A base image with Python + pytest + git, built offline from this host's own files.

Why: the default sandbox runs on the host's system dirs, whose python3 has no pytest, while the
default SWE `test_cmd` runs pytest; and SWE-bench's own images come from Docker Hub, which many
training machines cannot reach. So `burstrl image base --out DIR` copies, from the host:
the Debian `python3` and its standard library (minus tests, tkinter, idlelib and the static
library), the shell, coreutils, grep/sed/find/diff/patch, git (its network helpers left out), every
shared library they link (found with `ldd`), the C.UTF-8 locale, a fresh ld.so cache, and pytest
with its pure-Python requirements from the interpreter running this code (no network). The image
keeps the host's merged-/usr symlinks (/bin -> usr/bin ...). One layer, tar+zstd, deterministic:
the same host files give the same digest.

A task image goes on top with `burstrl image build REPO --base DIR --dest /work`; a sandbox whose
image has /usr/bin/python3 runs on the image's root instead of the host's dirs.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from burstrl.sandbox.archive import LayoutWriter, Progress
from burstrl.sandbox.images import ImageError, ImageRef, _machine_arch

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROGRAMS = ("python3", "sh", "dash", "bash", "env", "ls", "cat", "cp", "mv", "rm", "mkdir", "rmdir",
            "touch", "chmod", "ln", "echo", "true", "false", "test", "[", "head", "tail", "wc", "sort",
            "uniq", "cut", "tr", "tee", "sed", "grep", "find", "xargs", "diff", "cmp", "patch", "git",
            "timeout", "sleep", "date", "dirname", "basename", "readlink", "realpath", "pwd", "id",
            "uname", "stat", "mktemp", "which", "tar", "gzip", "expr", "printf", "seq", "nproc", "kill",
            "du", "df", "md5sum", "sha256sum", "yes", "tty", "whoami")
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo"}
GIT_SKIP = re.compile(r"git-(remote-https?|remote-ftps?|http-.*|imap-send|daemon|credential-.*|instaweb)$")
TREES = ("/usr/lib/git-core", "/usr/share/git-core/templates", "/usr/lib/locale/C.utf8")


class RootBuilder:
    """Copies host paths into `root` at the same place, keeping symlinks (and symlinked parent
    dirs) as symlinks, and every shared library an ELF file needs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: set[str] = set()
        self.missing: list[str] = []

    def dest(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def _parents(self, path: str) -> None:
        parent = "/"
        for part in Path(path).parent.parts[1:]:
            parent = os.path.join(parent, part)
            if os.path.islink(parent):
                self.add(parent)
            elif not self.dest(parent).is_dir():
                self.dest(parent).mkdir(parents=True, exist_ok=True)
                os.chmod(self.dest(parent), 0o755)

    def add(self, path: str) -> None:
        """One host file or symlink (and, for a symlink, what it points to; for ELF, its libs)."""
        path = os.path.normpath(path)
        if path in self.done:
            return
        self.done.add(path)
        if not os.path.lexists(path):
            self.missing.append(path)
            return
        self._parents(path)
        dest = self.dest(path)
        if os.path.islink(path):
            target = os.readlink(path)
            if not os.path.lexists(dest):
                os.symlink(target, dest)
            self.add(os.path.join(os.path.dirname(path), target))
        elif os.path.isdir(path):
            dest.mkdir(exist_ok=True)
        else:
            shutil.copy2(path, dest)
            self.libs_of(path)

    def tree(self, top: str, skip: set[str] | None = None, skip_re: re.Pattern[str] | None = None) -> None:
        """A host directory tree; `skip` names paths relative to `top`, `skip_re` file names."""
        if not os.path.isdir(top):
            self.missing.append(top)
            return
        self.add(top)
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, top)
            dirnames[:] = sorted(d for d in dirnames if os.path.normpath(os.path.join(rel, d)) not in (skip or ()))
            for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                if skip_re is None or not skip_re.match(name):
                    self.add(os.path.join(dirpath, name))
            for d in dirnames:
                self.add(os.path.join(dirpath, d))

    def libs_of(self, path: str) -> None:
        """The shared libraries (and the loader) an ELF file links, via ldd; a script has none."""
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                return
        r = subprocess.run(["ldd", path], capture_output=True, text=True, check=False)
        for line in r.stdout.splitlines():
            m = re.search(r"=>\s*(/\S+)", line) or re.match(r"\s*(/\S+)", line)
            if m:
                self.add(m.group(1))


def _requirements(dist: md.Distribution, python: str) -> list[str]:
    """Names of `dist`'s requirements for CPython `python` on Linux, extras left out."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "extra": ""}
    out = []
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req.name)
    return out


def copy_python_packages(names: list[str], site: Path, python: str) -> list[str]:
    """Copy installed distributions `names` and their requirements (from this interpreter's
    environment, files listed in their RECORD) into `site`; return 'name version' of each."""
    todo, seen, copied = list(names), set(), []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise ImageError(f"{name} is not installed where burstrl runs; install it (pip install {name}) "
                             "to put it in the base image") from exc
        base = Path(str(dist.locate_file("")))
        for f in dist.files or []:
            src = (base / f).resolve()
            rel = Path(os.path.normpath(f))
            if rel.parts[0] == ".." or "__pycache__" in rel.parts or not src.is_file():
                continue  # console scripts outside site-packages; bytecode of another Python
            if src.suffix in (".so", ".pyd"):
                raise ImageError(f"{name} has compiled extensions ({f}); only pure-Python packages are copied")
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, site / rel)
        copied.append(f"{dist.metadata['Name']} {dist.version}")
        _console_scripts(dist, site.parents[2] / "bin", python)
        todo.extend(_requirements(dist, python))
    return sorted(copied)


def _console_scripts(dist: md.Distribution, bin_dir: Path, python: str) -> None:
    """The scripts pip would write for `dist`'s console entry points (`pytest`), for the image's Python."""
    for ep in dist.entry_points:
        if ep.group != "console_scripts":
            continue
        module, _, attr = ep.value.partition(":")
        bin_dir.mkdir(parents=True, exist_ok=True)
        script = bin_dir / ep.name
        script.write_text(f"#!/usr/bin/python{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                          f"sys.exit({attr.strip()}())\n")
        script.chmod(0o755)


def _host_python() -> tuple[str, str]:
    """(path of the host's /usr/bin/python3 target, its X.Y version): the image's interpreter."""
    exe = "/usr/bin/python3"
    if not os.path.exists(exe):
        raise ImageError("this host has no /usr/bin/python3 to build a base image from")
    r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                       text=True, check=True)
    return exe, r.stdout.strip()


def fill_root(root: Path, packages: tuple[str, ...] = ("pytest",)) -> dict[str, object]:
    """Fill `root` with the base image's tree; return what went in (for the image's labels)."""
    exe, version = _host_python()
    b = RootBuilder(root)
    for name in ("bin", "lib", "lib64", "sbin"):  # merged /usr: the host's top-level symlinks
        if os.path.islink(f"/{name}"):
            b.add(f"/{name}")
    b.add(exe)
    b.add(f"/usr/bin/python{version}")
    for prog in PROGRAMS:
        found = shutil.which(prog, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if found:
            b.add(found)
    b.tree(f"/usr/lib/python{version}", STDLIB_SKIP | {f"config-{version}-x86_64-linux-gnu",
                                                       f"config-{version}-aarch64-linux-gnu"})
    b.tree("/usr/lib/git-core", skip_re=GIT_SKIP)
    for top in TREES[1:]:
        b.tree(top)
    site = root / f"usr/local/lib/python{version}/dist-packages"
    site.mkdir(parents=True)
    copied = copy_python_packages(list(packages), site, version)
    _write_etc(root)
    if shutil.which("ldconfig"):  # ld.so's cache for the image's own libraries
        subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, check=False)
    return {"python": version, "packages": copied,
            "missing": [m for m in b.missing if not m.startswith("/usr/lib/locale")]}


def _write_etc(root: Path) -> None:
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (etc / "ld.so.conf.d").mkdir(exist_ok=True)
    multiarch = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}.get(_machine_arch(), "")
    (etc / "ld.so.conf.d" / "multiarch.conf").write_text(f"/usr/lib/{multiarch}\n/usr/local/lib\n")
    for d in ("work", "tmp", "root"):
        (root / d).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)


def build_base_image(out_dir: Path, packages: tuple[str, ...] = ("pytest",), force: bool = False,
                     progress: Progress | None = None) -> ImageRef:
    """Write the base image (see the module docstring) as an OCI layout at `out_dir`, tag latest.

    Env: PATH and LANG=C.UTF-8; WorkingDir /work. Labels say which Python and packages went in."""
    with tempfile.TemporaryDirectory(prefix="burstrl-base-") as tmp, \
            LayoutWriter(out_dir, force, progress) as writer:
        root = Path(tmp) / "root"
        root.mkdir()
        os.chmod(root, 0o755)
        info = fill_root(root, packages)
        writer.add_tree(root, "/")
        labels = {"io.burstrl.base.python": str(info["python"]),
                  "io.burstrl.base.packages": ", ".join(info["packages"]),  # type: ignore[arg-type]
                  "io.burstrl.base.source": "host files (burstrl image base)"}
        config = {"architecture": _machine_arch(), "os": "linux",
                  "config": {"Env": [f"PATH={PATH}", "LANG=C.UTF-8"], "WorkingDir": "/work",
                             "Labels": labels},
                  "history": [{"created_by": "burstrl image base"}]}
        return writer.finish(config)
