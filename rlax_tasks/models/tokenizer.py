"""A character-level HF tokenizer built locally (no hub download) for tiny synthetic-task models."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DIGITS_AND_SYMBOLS = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"


def char_tokenizer(alphabet: str = DIGITS_AND_SYMBOLS) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus <pad>/<bos>/<eos> (ids 0, 1, 2)."""
    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
