"""The tokenizer of an HF directory as ``AutoTokenizer`` loads it, without AutoTokenizer's imports
(its configuration code and torch, in every process that loads a policy). The class it picks is
remembered in ``tokenizer-classes.json`` beside the model cache, keyed by the directory's config
and tokenizer files and the transformers version; a later load imports that class alone. A miss,
remote code or any failure goes through AutoTokenizer."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from rlax_tasks.models.model_cache import cache_root
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)

# the files AutoTokenizer's choice depends on (its model type, tokenizer class, auto_map, and
# whether tokenizer.json is byte-level)
KEY_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
CLASSES_FILE = "tokenizer-classes.json"


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` for a local HF directory, importing only the class
    it picks once that choice is remembered."""
    import transformers  # lazy: heavy, and loaded only by processes that tokenize

    if _word_level(path):
        # a word-level tokenizer built from a tokenizers object (our tiny models'): AutoTokenizer
        # would pick the model type's BPE class, whose pre-tokenizer drops spaces and newlines
        return transformers.TokenizersBackend.from_pretrained(path)
    key = _key(path)
    name = _classes().get(key)
    cls = getattr(transformers, name, None) if name else None
    if isinstance(cls, type):
        try:
            return cls.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - AutoTokenizer decides (and raises) below
            log.debug("remembered tokenizer class %s failed on %s (%s)", name, path, e)
    from transformers import AutoTokenizer  # lazy: the imports this module exists to avoid

    tokenizer = AutoTokenizer.from_pretrained(path)
    kind = type(tokenizer)
    if getattr(transformers, kind.__name__, None) is kind:  # importable by name: remember it
        _remember(key, kind.__name__)
    return tokenizer


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _word_level(path: str) -> bool:
    """Whether ``path`` holds a generic (tokenizers-built) tokenizer with a word-level model."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            if json.load(f).get("tokenizer_class") not in GENERIC_CLASSES:
                return False
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            return json.load(f).get("model", {}).get("type") == "WordLevel"
    except (OSError, ValueError, AttributeError):
        return False


def classes_path() -> str:
    """Where the choices are remembered: beside the model cache."""
    return os.path.join(os.path.dirname(cache_root().rstrip(os.sep)), CLASSES_FILE)


def _key(path: str) -> str:
    import transformers  # lazy: heavy, and loaded only by processes that tokenize

    digest = hashlib.sha256(transformers.__version__.encode())
    for name in KEY_FILES:
        digest.update(f"\0{name}\0".encode())
        try:
            with open(os.path.join(path, name), "rb") as f:
                digest.update(f.read())
        except OSError:
            digest.update(b"\0missing")
    return digest.hexdigest()


def _classes() -> dict[str, str]:
    try:
        with open(classes_path(), encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _remember(key: str, name: str) -> None:
    """Adds ``key -> name`` (``storage.write_bytes``: temp file and rename, so concurrent
    processes each write a whole file)."""
    path = classes_path()
    table = _classes()
    if table.get(key) == name:
        return
    table[key] = name
    try:
        storage.write_bytes(path, json.dumps(table, indent=0, sort_keys=True).encode())
    except OSError as e:  # a read-only home: every load goes through AutoTokenizer
        log.debug("tokenizer class not remembered in %s (%s)", path, e)
