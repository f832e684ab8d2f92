"""The demo models' tokenizer: byte-level BPE trained offline on text shipped with
Python itself (no network in tests or CI), with ChatML's special tokens at fixed ids.

tokenizers is imported inside the functions that need it: resolving `--model demo` must
stay cheap to import.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

# Special tokens come first so that their ids are fixed (0, 1, 2) whatever the vocab size.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
# Generation stops on either: plain completions end with <|endoftext|>, chat turns with
# <|im_end|> (the Qwen convention).
EOS_TOKEN_IDS: tuple[int, ...] = (ENDOFTEXT_ID, IM_END_ID)

# The smallest vocab worth having: 256 byte symbols + 3 specials + a few dozen merges.
MIN_VOCAB_SIZE = 300

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pure-Python standard-library modules whose source is the tokenizer's training corpus
# (about 1.6 MB). Reading files needs no network and no import of the modules themselves.
# The source differs a little between Python versions, so the learned merges (and token
# ids) are only identical for one Python version: never compare ids across versions.
_CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "dataclasses",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "http.client",
    "inspect",
    "json.decoder",
    "logging",
    "pathlib",
    "pickle",
    "pprint",
    "random",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "textwrap",
    "typing",
    "unittest.case",
    "urllib.parse",
    "zipfile",
)

# Python source is almost all ASCII; without this, multi-byte characters would never get
# merged tokens and every non-ASCII test would exercise only the single-byte fallback.
_MULTILINGUAL_TEXT: tuple[str, ...] = (
    "Héllo wörld, ça va? Ünïcödé façade naïve café résumé déjà vu — “quotes” … ✓ ✗ → ←",
    "Straße, Größe, Ærø, Øresund, Łódź, Český Krumlov, Ñandú, São Paulo, İstanbul, Āhua",
    "日本語のテキストです。東京は大きな都市です。こんにちは世界。今日は良い天気ですね。",
    "中文文本：你好，世界！我们今天学习分词。这是一个小模型。",
    "Русский текст: привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ελληνικά: Γειά σου κόσμε. Українська: Привіт, світе! Български: Здравей, свят!",
    "العربية: مرحبا بالعالم. עברית: שלום עולם. فارسی: سلام دنیا.",
    "한국어: 안녕하세요 세계. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก",
    "Emoji: 😀 😂 🚀 🎉 👍 ❤️ 🔥 ✨ 🐍 — math: ∑ ∫ √ ∞ ≤ ≥ ≠ ± × ÷ π λ μ °C €£¥",
)
# Repeat the multilingual block so its byte pairs are frequent enough to be merged early.
_MULTILINGUAL_REPEAT = 200


def _corpus() -> list[str]:
    """The training text: stdlib sources plus a repeated multilingual block."""
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        # Skip anything not shipped as a .py file (frozen, built-in, stripped installs):
        # the corpus only has to be big, not complete.
        if origin is None or not origin.endswith(".py") or not os.path.isfile(origin):
            continue
        texts.append(pathlib.Path(origin).read_text(encoding="utf-8"))
    texts.extend(list(_MULTILINGUAL_TEXT) * _MULTILINGUAL_REPEAT)
    return texts


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per vocab size; cached as JSON so every caller gets its own copy."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a symbol even if the corpus never shows it: nothing is unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is larger than the built-in corpus supports "
            f"(training stopped at {got} tokens)"
        )
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int = 1024) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens, trained offline.

    Special tokens: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2. No
    post-processor, so encoding never adds tokens. Deterministic for a given Python version
    (the corpus is the standard library's source); training runs once per vocab size per
    process (well under a second) and each call returns a fresh, independent object.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int; got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}; got {vocab_size}")
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
