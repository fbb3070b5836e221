"""The tiny Qwen3: a real Hugging Face model directory small enough for CPU tests.

Why: every role (engine, trainer, router tests, the quickstart) needs a model that loads through
the same `from_pretrained` path as a real Qwen3 checkpoint, yet builds offline in seconds. So this
writes config.json, model.safetensors (random init, ~1M parameters), generation_config.json and a
byte-level BPE tokenizer with Qwen's special tokens and ChatML template, trained here on a corpus
built locally (a few standard-library sources plus generated words, letters and arithmetic).

The directory appears atomically (built in a temp dir beside it, then renamed), so a crash never
leaves half a model where a cache expects a whole one. Same arguments, same Python: same bytes.
The recipe a cache is checked against holds the chat template's digest, so editing the template
(package data, not an argument) rebuilds caches made with the old one.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
import sys
import sysconfig
import time
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from burstrl.atomic import build_dir, check_target

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
RECIPE_FILE = "burstrl_tiny.json"
RECIPE_VERSION = 1  # bump when the files written for the same arguments change
CORPUS_SEED = 1234  # the tokenizer does not depend on the model seed: all seeds share one
MAX_POSITIONS = 4096

# Qwen2/3's pre-tokenizer split: letters runs, single digits, punctuation runs, whitespace.
# Single digits keep arithmetic learnable for a tiny model.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
STDLIB_FILES = (
    "textwrap.py", "string.py", "shutil.py", "argparse.py", "difflib.py", "tempfile.py",
    "functools.py", "subprocess.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
    "unittest/case.py", "collections/__init__.py",
)
WORDS = """
the a an and or but not if then else when while for with without to from of in on at by as is
are was were be been has have had do does did can could will would should may might must it this
that these those there here what which who how why one two three four five six seven eight nine
ten zero first last next each every some any all none more less most many few big small long short
new old good bad same other copy repeat letter word number digit sum add subtract multiply divide
equal answer question task step turn reply user assistant system tool call result value error
file line test tests patch diff fix bug code function class method return print read write run
command shell output input list dict string int float true false none path directory repository
commit branch merge review change update remove create open close start stop wait time day water
fire earth air tree house road river city world people person child friend work play learn think
know see look find give take make say tell ask help want need like keep move turn show try use
""".split()
ROLES = ("system", "user", "assistant", "tool")


def make_tiny_model(
    out: str | Path,
    *,
    layers: int = 4,
    hidden: int = 128,
    vocab: int = 2048,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write the tiny model directory at `out` atomically; refuse a non-empty `out` unless force."""
    out = Path(out).absolute()
    check_target(out, force)
    if hidden % 8 or hidden <= 0:
        raise ValueError(f"hidden must be a positive multiple of 8 (4 heads, even head_dim), got {hidden}")
    recipe = _recipe(layers, hidden, vocab, seed)
    start = time.perf_counter()

    def build(tmp: Path) -> None:
        tokenizer = train_tokenizer(vocab)
        _log(f"tokenizer: {len(tokenizer)} tokens ({time.perf_counter() - start:.1f}s)")
        tokenizer.save_pretrained(tmp)
        n_params = _write_weights(tmp, tokenizer, layers=layers, hidden=hidden, seed=seed)
        _log(f"model: {n_params / 1e6:.2f}M parameters ({time.perf_counter() - start:.1f}s)")
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")

    build_dir(out, build, force=force)
    _log(f"wrote {out} ({time.perf_counter() - start:.1f}s)")
    return out


def ensure_tiny_model(
    out: str | Path, *, layers: int = 4, hidden: int = 128, vocab: int = 2048, seed: int = 0
) -> Path:
    """Make the tiny model at `out` unless a complete one with the same recipe is already there.

    For caches shared by several processes (test sessions): whoever finishes first wins the
    rename, the others find the finished directory and use it. A cache written by an older
    recipe is replaced; a directory that is not a tiny model is never touched.
    """
    out = Path(out).absolute()
    want = _recipe(layers, hidden, vocab, seed)
    if _read_recipe(out) == want:
        return out
    stale = _read_recipe(out) is not None
    try:
        return make_tiny_model(out, layers=layers, hidden=hidden, vocab=vocab, seed=seed, force=stale)
    except FileExistsError:
        if _read_recipe(out) == want:
            return out
        raise


def train_tokenizer(vocab: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text round-trips) with Qwen's special tokens and ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"corpus too small for a {vocab}-token vocabulary (got {tok.get_vocab_size()})")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template(),
    )


def chat_template() -> str:
    """Qwen-style ChatML without thinking blocks (shipped as package data)."""
    return resources.files("burstrl.model").joinpath("chat_template.jinja").read_text()


def tiny_config(vocab: int, layers: int, hidden: int, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Qwen3 shape scaled down: 4 query heads, 2 kv heads (GQA), 3x MLP, tied embeddings."""
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=endoftext,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=endoftext,
        dtype="float32",
    )


def build_corpus() -> list[str]:
    """Deterministic training text: some stdlib sources (code, English docstrings) + generated."""
    rng = random.Random(CORPUS_SEED)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(stdlib / name).read_text() for name in STDLIB_FILES if (stdlib / name).is_file()]
    docs += [_sentence(rng) for _ in range(4000)]
    docs += [_arithmetic(rng) for _ in range(3000)]
    docs += [_letters(rng) for _ in range(1500)]
    docs += [_dialogue(rng) for _ in range(800)]
    return docs


def _sentence(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(3, 12))
    return " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 99)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return rng.choice(["{} {} {} = {}", "What is {} {} {}? {}", "{}{}{}={}"]).format(a, op, b, result)


def _letters(rng: random.Random) -> str:
    letters = rng.choices(string.ascii_letters + string.digits, k=rng.randint(1, 8))
    joined = rng.choice([" ", "", ", "]).join(letters)
    return rng.choice(["Repeat the letter: {0}\n{0}", "Copy: {0} -> {0}", "{0}"]).format(joined)


def _dialogue(rng: random.Random) -> str:
    turns = [f"{role}\n{_sentence(rng)}\n" for role in rng.choices(ROLES, k=rng.randint(2, 5))]
    return "".join(turns)


def _write_weights(out: Path, tokenizer: PreTrainedTokenizerFast, *, layers: int, hidden: int, seed: int) -> int:
    """Random-init Qwen3ForCausalLM saved with save_pretrained; the caller's RNG is left untouched."""
    config = tiny_config(len(tokenizer), layers, hidden, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    endoftext = config.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=[config.eos_token_id, endoftext],
        pad_token_id=endoftext,
    )
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _recipe(layers: int, hidden: int, vocab: int, seed: int) -> dict:
    template = hashlib.sha256(chat_template().encode()).hexdigest()[:16]
    return {"recipe": RECIPE_VERSION, "layers": layers, "hidden": hidden, "vocab": vocab, "seed": seed,
            "chat_template": template}


def _read_recipe(out: Path) -> dict | None:
    path = out / RECIPE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _log(msg: str) -> None:
    print(f"[make-tiny] {msg}", file=sys.stderr, flush=True)
