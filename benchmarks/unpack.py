"""Layer unpack, tar+zstd vs tar+gzip, on real-shaped layers, with file creation split out.

Layers (built once from files installed on this machine, as deterministic tars):
- `pyenv`: a Python env: numpy and pip copied from this venv's site-packages (thousands of small
  .py files, a few large .so files);
- `repo`: a repo checkout: every file `git ls-files` lists in this repository;
- `binaries`: a few large files: the largest files of site-packages of 1-32 MiB each (shared
  libraries: torch's, numpy's, ...) up to ~100 MB, as a layer of model weights or toolchains is.

For each layer and codec (zstd level 3, gzip level 6; the codecs alternate within each repeat so
the machine's noise falls on both), the median of `--repeats` runs of:
- `decompress_s`: read the blob, sha256 it, decompress to nowhere (1 MiB blocks);
- `parse_s`: the same plus parsing the tar and reading every member's data (no files made);
- `unpack_serial_s`: `unpack_blob(..., workers=0)`: every file written by the reading thread;
- `unpack_s`: `unpack_blob` as a node runs it (a pool of writer threads).
Each also as CPU seconds of the process (`*_cpu_s`, all threads): on a busy machine the wall
times carry the wait for a core, the CPU times do not. The difference unpack - parse is what
creating the files costs; the codec only changes `decompress_s`.

    .venv/bin/python benchmarks/unpack.py                # --repeats 5 (~2 min here)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from burstrl.sandbox.extract import TAR_BUFSIZE  # noqa: E402
from burstrl.sandbox.images import (  # noqa: E402
    GZIP_LEVEL,
    LAYER_GZIP,
    LAYER_ZSTD,
    ZSTD_LEVEL,
    Descriptor,
    _HashingReader,
    compressor,
    decompressor,
    write_tree_tar,
)
from burstrl.sandbox.layercache import force_rmtree, unpack_blob  # noqa: E402

CODECS = (("zstd", LAYER_ZSTD, ZSTD_LEVEL), ("gzip", LAYER_GZIP, GZIP_LEVEL))


def pyenv_tree(dst: Path) -> Path:
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for name in ("numpy", "pip"):
        shutil.copytree(site / name, dst / "site-packages" / name, symlinks=True)
    return dst


def repo_tree(dst: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def binaries_tree(dst: Path, total: int = 100 * 10**6, largest: int = 32 << 20) -> Path:
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    files = [(p.stat().st_size, str(p)) for p in site.rglob("*") if p.is_file() and not p.is_symlink()]
    taken = 0
    for size, path in sorted((f for f in files if 1 << 20 <= f[0] <= largest), key=lambda f: (-f[0], f[1])):
        if taken + size > total:
            continue
        rel = Path(path).relative_to(site)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / rel)
        taken += size
    return dst


def compress_tree(src_dir: Path, blob: Path, kind: str, media_type: str) -> Descriptor:
    with open(blob, "wb") as fh:
        comp = compressor(kind, fh)
        write_tree_tar(src_dir, "/", comp)
        comp.close()
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    return Descriptor(media_type, f"sha256:{sha}", blob.stat().st_size)


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - start[0], time.process_time() - start[1]


def decompress(desc: Descriptor, blob: Path) -> tuple[float, float]:
    start = _clock()
    with open(blob, "rb") as fh:
        stream = decompressor(desc.media_type, _HashingReader(fh))  # type: ignore[arg-type]
        while stream.read(1 << 20):
            pass
    return _since(start)


def parse(desc: Descriptor, blob: Path) -> tuple[float, float]:
    start = _clock()
    with open(blob, "rb") as fh, tarfile.open(fileobj=decompressor(desc.media_type, _HashingReader(fh)),  # type: ignore[arg-type]
                                              mode="r|", bufsize=TAR_BUFSIZE) as tar:
        for member in tar:
            if member.isreg():
                tar.extractfile(member).read()  # type: ignore[union-attr]
    return _since(start)


def unpack(desc: Descriptor, blob: Path, work: Path, workers: int | None) -> tuple[float, float]:
    target = Path(tempfile.mkdtemp(dir=work))
    start = _clock()
    if workers is None:
        unpack_blob(desc, blob, target)
    else:
        unpack_blob(desc, blob, target, workers=workers)
    seconds = _since(start)
    force_rmtree(target)
    return seconds


def measure(src_dir: Path, work: Path, repeats: int) -> dict[str, Any]:
    """The split for one layer, both codecs, alternating within each repeat."""
    descs = {kind: compress_tree(src_dir, work / f"layer.{kind}", kind, mt) for kind, mt, _ in CODECS}
    files = sum(1 for p in src_dir.rglob("*") if p.is_file())
    times: dict[str, dict[str, list[float]]] = {k: {} for k in descs}
    for _ in range(repeats):
        for kind, desc in descs.items():
            blob = work / f"layer.{kind}"
            for key, (wall, cpu) in (("decompress", decompress(desc, blob)), ("parse", parse(desc, blob)),
                                     ("unpack_serial", unpack(desc, blob, work, 0)),
                                     ("unpack", unpack(desc, blob, work, None))):
                times[kind].setdefault(f"{key}_s", []).append(wall)
                times[kind].setdefault(f"{key}_cpu_s", []).append(cpu)
    out: dict[str, Any] = {"files": files, "tar_bytes": sum(p.stat().st_size for p in src_dir.rglob("*")
                                                            if p.is_file())}
    for kind, desc in descs.items():
        out[kind] = {"bytes": desc.size, **{k: round(statistics.median(v), 4) for k, v in times[kind].items()},
                     "unpack_s_all": [round(x, 4) for x in times[kind]["unpack_s"]]}
    for key in times["zstd"]:
        out[f"zstd_vs_gzip_{key[:-2]}"] = round(out["zstd"][key] / out["gzip"][key], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", default="pyenv,repo,binaries", help="Comma-separated: pyenv, repo, binaries.")
    args = p.parse_args()
    makers = {"pyenv": pyenv_tree, "repo": repo_tree, "binaries": binaries_tree}
    names = [x.strip() for x in args.layers.split(",") if x.strip()]
    if not names or any(x not in makers for x in names):
        p.error(f"--layers {args.layers!r}: choose from {', '.join(makers)}")
    with tempfile.TemporaryDirectory(prefix="unpack-bench-") as tmp:
        root = Path(tmp)
        result = {}
        for name in names:
            src = makers[name](root / name)
            work = root / f"{name}-work"
            work.mkdir()
            result[name] = measure(src, work, args.repeats)
            print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
