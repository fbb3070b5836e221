"""LoRA adapters for the engine: read PEFT files, apply many versions in one batch.

Why not PEFT at inference: PEFT rewrites the model's modules to add an adapter, and its mixed
batches loop over adapters inside every module. The engine instead keeps the base model untouched
and holds each version's A/B matrices itself (as vLLM and SGLang do), so loading `policy-v7`
while `policy-v6` sessions are decoding never touches a module the decode loop is using. The files
are PEFT's own (adapter_config.json + adapter_model.safetensors), written by the trainer with PEFT,
so vLLM/SGLang can load the same directories.

Math per target linear (PEFT's LoRA): y = W x + (B (A x)) * scale, scale = alpha / r
(alpha / sqrt(r) with rsLoRA).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_PROJ + MLP_PROJ
_UIDS = itertools.count(1)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter files are missing, malformed, or use a LoRA variant the engine cannot apply."""


@dataclass
class LoraAdapter:
    """One adapter version: per (layer, module) the A [r, in] and B [out, r] matrices and scale."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    # KV namespace: unique per loaded object (the base model is 0), so caches computed under one
    # load of a name are never reused under another load of the same name
    uid: int = field(default_factory=lambda: next(_UIDS))


Shapes = dict[tuple[int, str], tuple[int, int]]  # (layer, module) -> (in_features, out_features)
MAX_RANK = 4096


def module_shapes(layers: list[nn.Module]) -> Shapes:
    """(in, out) features of every LoRA target in HF decoder `layers` (the engine's runner.layers).

    Why from the modules: an adapter whose A or B does not fit its projection loads fine and then
    raises inside the engine thread on first use, stopping every request; comparing against the
    base model's own shapes refuses it at load time instead. The runner's fused q/k/v and gate/up
    weights are views, but each nn.Linear keeps its in_features/out_features.
    """
    shapes: Shapes = {}
    for i, layer in enumerate(layers):
        for parent, names in ((layer.self_attn, ATTN_PROJ), (layer.mlp, MLP_PROJ)):
            for name in names:
                linear = getattr(parent, name)
                shapes[(i, name)] = (int(linear.in_features), int(linear.out_features))
    return shapes


def load_adapter(name: str, path: str | Path, num_layers: int, dtype: torch.dtype,
                 device: torch.device, shapes: Shapes | None = None) -> LoraAdapter:
    """Read a PEFT LoRA directory; refuse anything the engine could not apply safely.

    Every check runs before the adapter is returned, so nothing wrong (a malformed config, a
    corrupt file, a wrong shape, NaN/inf) ever reaches the engine thread: the caller gets an
    `AdapterError` naming the file and the problem. `shapes` (from `module_shapes`) enables the
    per-module shape check; without it only ranks and layer indices are checked.
    """
    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{path}: expected adapter_config.json and adapter_model.safetensors")
    try:
        cfg_text = cfg_file.read_bytes()
    except OSError as exc:
        raise AdapterError(f"{cfg_file}: unreadable ({exc})") from None
    rank, scale = _read_config(cfg_file, cfg_text)
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise AdapterError(f"{weights_file}: cannot be read as safetensors ({exc})") from None
    return _build(name, str(path), weights_file, rank, scale, tensors, num_layers, dtype, device, shapes)


def load_adapter_bytes(name: str, label: str, config: bytes, tensors: dict[str, torch.Tensor], num_layers: int,
                       dtype: torch.dtype, device: torch.device, shapes: Shapes | None = None) -> LoraAdapter:
    """`load_adapter` from the config's bytes and the weights already read (a pushed version, never
    written to disk; `inference.adapters` reads the safetensors bytes in place).

    The same checks as `load_adapter`; `label` stands for the path in errors and in `adapter.path`.
    """
    where = Path(label)
    rank, scale = _read_config(where / "adapter_config.json", config)
    return _build(name, label, where / "adapter_model.safetensors", rank, scale, tensors, num_layers, dtype,
                  device, shapes)


def _build(name: str, path: str, weights_file: Path, rank: int, scale: float, tensors: dict[str, torch.Tensor],
           num_layers: int, dtype: torch.dtype, device: torch.device, shapes: Shapes | None) -> LoraAdapter:
    pairs = _read_pairs(weights_file, tensors, num_layers, shapes)
    weights = {}
    for where, ab in pairs.items():
        # a copy even when device and dtype match: the source may be a view of a received buffer
        a, b = ab["A"].to(device, dtype, copy=True), ab["B"].to(device, dtype, copy=True)
        _check_pair(weights_file, where, a, b, rank, shapes)
        weights[where] = (a, b, scale)
    if not weights:
        raise AdapterError(f"{weights_file}: no LoRA weights")
    return LoraAdapter(name=name, path=path, rank=rank, weights=weights)


def _read_config(cfg_file: Path, text: bytes) -> tuple[int, float]:
    """The adapter's rank and scale, from a config that must be a JSON object with sane values."""
    try:
        cfg = json.loads(text)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AdapterError(f"{cfg_file}: unreadable or not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file}: must be a JSON object, not {type(cfg).__name__}")
    _check_config(cfg_file, cfg)
    rank, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    if type(rank) is not int or not 1 <= rank <= MAX_RANK:  # type(): True is an int, not a rank
        raise AdapterError(f"{cfg_file}: r must be an integer in [1, {MAX_RANK}], got {rank!r:.40}")
    if type(alpha) not in (int, float) or not _finite_positive(alpha):
        raise AdapterError(f"{cfg_file}: lora_alpha must be a finite number > 0, got {alpha!r:.40}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _finite_positive(x: float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:  # an int too large for a float
        return False


def _read_pairs(weights_file: Path, tensors: dict[str, torch.Tensor], num_layers: int,
                shapes: Shapes | None) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The file's tensors grouped by (layer, module) into {"A": ..., "B": ...}, both present."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        where = (int(m.group(1)), m.group(2)) if m else None
        if (where is None or where[1] not in TARGETS or where[0] >= num_layers
                or (shapes is not None and where not in shapes)):
            raise AdapterError(f"{weights_file}: unsupported adapter tensor {key!r}")
        if not tensor.is_floating_point():
            raise AdapterError(f"{weights_file}: tensor {key!r} is {tensor.dtype}, not floating point")
        pairs.setdefault(where, {})[m.group(3)] = tensor
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
    return pairs


def _check_pair(weights_file: Path, where: tuple[int, str], a: torch.Tensor, b: torch.Tensor,
                rank: int, shapes: Shapes | None) -> None:
    """A [r, in] and B [out, r] of the base module, every value finite in the serving dtype.

    Finiteness is checked after the cast, so a float32 value that overflows to inf in fp16 is
    refused as well.
    """
    layer, module = where
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"{weights_file}: layer {layer} {module} rank differs from r={rank} "
                           f"(lora_A {list(a.shape)}, lora_B {list(b.shape)})")
    in_f, out_f = shapes[where] if shapes is not None else (a.shape[1], b.shape[0])
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise AdapterError(f"{weights_file}: layer {layer} {module} expects lora_A [{rank}, {in_f}] and "
                           f"lora_B [{out_f}, {rank}], got {list(a.shape)} and {list(b.shape)}")
    for label, t in (("lora_A", a), ("lora_B", b)):
        # a NaN or inf anywhere makes the sum NaN or inf, so a finite sum proves every value finite
        # (one fast pass; `isfinite(t).all()` on bf16 cost ~17x more); a sum that overflowed from
        # finite values falls back to the exact check
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{weights_file}: layer {layer} {module} {label} holds NaN or inf "
                               f"(in {t.dtype})")


def _check_config(path: Path, cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if "r" not in cfg:
        raise AdapterError(f"{path}: adapter_config.json has no 'r'")
    for key in ("use_dora", "lora_bias", "alora_invocation_tokens", "layer_replication", "target_parameters"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported by the torch engine")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported by the torch engine")


Span = tuple[int, int, float]  # an adapter's columns [start, stop) in a concatenation, and its scale


@dataclass
class Concat:
    """One target's A and B of several adapters side by side: A^T [in, R], B^T [R, out], R = sum of ranks."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    spans: dict[int, Span]  # adapter uid -> its columns; an adapter without this target has none


class LoraStacks:
    """Concatenations of the adapters a mixed batch uses, kept for the next batches of the same mix.

    Why keep them: the engine rebuilds its batch's LoraBatch whenever a row joins or leaves, often
    every few decode steps, and concatenating every target of every adapter each time would copy
    them all again. The last `size` mixes are kept (keyed by the adapters' uids), so memory is at
    most `size` copies of the mixes' weights; a mix no longer used goes when newer ones push it out.
    Used from the engine's thread only.
    """

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.mixes: dict[tuple[int, ...], dict[tuple[int, str], Concat]] = {}

    def get(self, adapters: list[LoraAdapter]) -> dict[tuple[int, str], Concat]:
        """The concatenation of this set of adapters (in uid order, whatever order they come in)."""
        adapters = sorted(adapters, key=lambda a: a.uid)
        key = tuple(a.uid for a in adapters)
        found = self.mixes.pop(key, None)
        if found is None:
            found = concatenate(adapters)
        self.mixes[key] = found  # most recent last
        while len(self.mixes) > self.size:
            self.mixes.pop(next(iter(self.mixes)))
        return found


def concatenate(adapters: list[LoraAdapter]) -> dict[tuple[int, str], Concat]:
    """Per target, the adapters' A and B side by side (in `adapters` order)."""
    out: dict[tuple[int, str], Concat] = {}
    for key in sorted(set().union(*(a.weights.keys() for a in adapters))):
        parts = [(a.uid, a.weights[key]) for a in adapters if key in a.weights]
        spans, start = {}, 0
        for uid, (a, _, scale) in parts:
            spans[uid] = (start, start + a.shape[0], scale)
            start += a.shape[0]
        a_t = torch.cat([a for _, (a, _, _) in parts]).T.contiguous()
        b_t = torch.cat([b for _, (_, b, _) in parts], dim=1).T.contiguous()
        out[key] = Concat(a_t, b_t, spans)
    return out


class LoraBatch:
    """Which adapter each row of a batch uses; adds each row's LoRA delta to a projection output.

    One adapter: one matmul pair per projection over its rows (rows on the base model do none).
    Several: one matmul pair per projection for all of them, over the adapters' concatenated A and
    B, with a mask that keeps each row's own adapter's columns (and zeroes every column of a row on
    the base model): y += ((x A_cat^T) * mask) B_cat^T. Why not a matmul pair per adapter: on a
    small model the per-call overhead is the cost, and a decode step mixing three versions took
    1.4x one with a single version (tiny model, 12 rows); the concatenation does G times the LoRA
    A/B flops, which are r/d of the base projection's. A masked column adds exact zeros. A row is
    a batch row ([B, T, ...] inputs), or with `per_token` a position of the flattened [B * T]
    tokens (a packed prefill of several requests in one sequence).
    """

    def __init__(self, adapters: list[LoraAdapter | None], per_token: bool = False,
                 stacks: LoraStacks | None = None) -> None:
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        n = len(adapters)
        self.per_token = per_token
        self.groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        for adapter, rows in groups.values():
            device = next(iter(adapter.weights.values()))[0].device
            index = slice(None) if len(rows) == n else torch.tensor(rows, device=device)
            self.groups.append((adapter, index))
        self.concat: dict[tuple[int, str], Concat] | None = None
        self.masks: dict[tuple, tuple[torch.Tensor, float]] = {}  # by spans: (mask [n, R], alpha)
        if len(self.groups) > 1:
            mix = [adapter for adapter, _ in self.groups]
            self.concat = (stacks or LoraStacks()).get(mix)
            self.rows = [None if a is None else a.uid for a in adapters]

    @property
    def empty(self) -> bool:
        return not self.groups

    def add_(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """x: [B, T, in], y: [B, T, out] base output (may be a view) -> each row's delta added in place."""
        if self.per_token:
            x, y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.concat is not None:
            cat = self.concat.get((layer, name))
            if cat is not None:
                mask, alpha = self._mask(cat)
                y.add_(((x @ cat.a_t) * (mask if self.per_token else mask[:, None, :])) @ cat.b_t, alpha=alpha)
            return
        for adapter, index in self.groups:
            w = adapter.weights.get((layer, name))
            if w is None:
                continue
            a, b, scale = w
            if isinstance(index, slice):
                y.add_((x @ a.T) @ b.T, alpha=scale)
            else:
                y.index_add_(0, index, (x[index] @ a.T) @ b.T, alpha=scale)

    def _mask(self, cat: Concat) -> tuple[torch.Tensor, float]:
        """[rows, R]: 1 (or the adapter's scale, when the mix's scales differ) on each row's own
        columns, 0 elsewhere; and the alpha the product is added with. One per spans layout."""
        key = tuple(sorted(cat.spans.items()))
        if key not in self.masks:
            scales = {scale for _, _, scale in cat.spans.values()}
            same = len(scales) == 1
            mask = torch.zeros(len(self.rows), cat.a_t.shape[1], dtype=cat.a_t.dtype)
            for row, uid in enumerate(self.rows):
                span = cat.spans.get(uid) if uid is not None else None
                if span is not None:
                    mask[row, span[0]:span[1]] = 1.0 if same else span[2]
            self.masks[key] = (mask.to(cat.a_t.device), scales.pop() if same else 1.0)
        return self.masks[key]
