"""A character-level HF tokenizer built locally (no hub download) for tiny synthetic-task models."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DIGITS_AND_SYMBOLS = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"


def char_tokenizer(
    alphabet: str = DIGITS_AND_SYMBOLS, unk_token: str | None = None
) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus <pad>/<bos>/<eos> (ids 0, 1, 2); with
    ``unk_token`` (the last id), a character outside the alphabet encodes to it instead of
    failing."""
    chars = list(dict.fromkeys(alphabet))
    extra = [unk_token] if unk_token else []
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars, *extra])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        **({"unk_token": unk_token} if unk_token else {}),
    )


# ChatML's turn markers (special) and the Hermes tool-call tags
CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
# every printable ASCII character: tool outputs and error messages quote what they like
CHAT_ALPHABET = DIGITS_AND_SYMBOLS + "".join(
    c for c in string.printable if c not in DIGITS_AND_SYMBOLS and c not in "\r\x0b\x0c"
)
# ChatML, compact: a tiny model's prompts stay short. Tools are listed by name in the system
# turn; a tool's result comes back as a "tool" turn (docs/design.md §15).
COMPACT_CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' + (tools | map(attribute='function') | "
    "map(attribute='name') | join(', ')) + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_char_tokenizer(alphabet: str = CHAT_ALPHABET) -> PreTrainedTokenizerFast:
    """``char_tokenizer`` with ChatML's turn markers (special) and Hermes tool-call tags as
    single tokens and a compact ChatML template (tiny models' multi-turn episodes);
    ``<|im_end|>`` ends a turn (its eos); any other character (a tool's non-ASCII output)
    is ``<unk>``."""
    tok = char_tokenizer(alphabet, unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS[:2])})
    # the tool-call tags are single tokens but not special (as Qwen2.5's): a turn decoded
    # without special tokens keeps its calls
    tok.add_tokens(list(CHAT_SPECIAL_TOKENS[2:]))
    tok.eos_token = "<|im_end|>"
    tok.chat_template = COMPACT_CHATML_TEMPLATE
    return tok
