"""`rlax import gguf`: a GGUF file (llama.cpp's format) to a Hugging Face directory this project
loads: config.json, model.safetensors, the tokenizer with its chat template, and a
generation_config.json listing every end-of-turn id. Reading and dequantizing go through
transformers' own GGUF reader (the ``gguf`` extra: ``gguf`` and CPU torch)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from rlax_tasks.models.config import SUPPORTED_DTYPES, SUPPORTED_MODEL_TYPES
from rlax_tasks.models.hf_io import GENERATION_CONFIG, SINGLE_FILE

log = logging.getLogger(__name__)

INSTALL_HINT = "install the gguf extra: pip install -e '.[gguf]' -c constraints.txt"
# special tokens that end an assistant turn in the chat templates of the supported families
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


class GGUFImportError(ValueError):
    """A GGUF file this project cannot import: unreadable, truncated, an unsupported architecture
    or quantization type, or missing dependencies."""


@dataclasses.dataclass(frozen=True)
class ImportSummary:
    """What `rlax import gguf` wrote."""

    out_dir: str
    model_type: str
    num_params: int
    quantization: tuple[str, ...]  # the GGUF tensor types read (dequantized)
    eos_token_ids: tuple[int, ...]
    chat_template: bool


def import_gguf(
    gguf_file: str, out_dir: str, dtype: str = "float32", overwrite: bool = False
) -> ImportSummary:
    """Converts ``gguf_file`` into an HF directory at ``out_dir`` (written to a temporary sibling
    and renamed, so an interrupted import leaves no half directory)."""
    if dtype not in SUPPORTED_DTYPES:
        raise GGUFImportError(f"--dtype {dtype!r}: choose one of {', '.join(SUPPORTED_DTYPES)}")
    if not os.path.isfile(gguf_file):
        raise GGUFImportError(f"{gguf_file!r} is not a file")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise GGUFImportError(f"{out_dir!r} exists and is not empty (pass --overwrite to replace)")
    torch, transformers, gguf_utils = _dependencies()
    architecture, tensor_types = _inspect(gguf_file)
    readable = sorted(set(SUPPORTED_MODEL_TYPES) & set(gguf_utils.GGUF_SUPPORTED_ARCHITECTURES))
    unsupported = f"GGUF architecture {architecture!r} is not supported; supported: {readable}"
    if architecture not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(unsupported)
    folder, name = os.path.split(os.path.abspath(gguf_file))
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model_type = config.model_type  # transformers' reading (a llama file named mistral: mistral)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise GGUFImportError(unsupported)
    config.architectures = [SUPPORTED_MODEL_TYPES[model_type]]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with torch.device("meta"):  # names and shapes only: no memory for the weights
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    log.info("reading %s (%s, %s)", gguf_file, architecture, "/".join(tensor_types))
    try:
        parsed = gguf_utils.load_gguf_checkpoint(
            os.path.abspath(gguf_file),
            return_tensors=True,
            model_to_load=skeleton,
            torch_dtype=torch_dtype,
        )
    except NotImplementedError as e:  # gguf's dequantize: a quantization type it cannot read
        raise GGUFImportError(f"{gguf_file}: unsupported quantization ({e})") from e
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
    _check_complete(gguf_file, skeleton, tensors, config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    eos_ids = _end_of_turn_ids(config, tokenizer)

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".import-", dir=parent)
    try:
        config.dtype = dtype
        config.eos_token_id = eos_ids[0] if eos_ids else config.eos_token_id
        config.save_pretrained(tmp)
        from safetensors.torch import save_file  # lazy: torch, inside the gguf extra

        save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(eos_ids),
            "pad_token_id": tokenizer.pad_token_id,
        }
        with open(os.path.join(tmp, GENERATION_CONFIG), "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = ImportSummary(
        out_dir=out_dir,
        model_type=model_type,
        num_params=sum(t.numel() for t in tensors.values()),
        quantization=tensor_types,
        eos_token_ids=eos_ids,
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    log.info(
        "wrote %s: %s, %.1fM parameters (%s), end-of-turn ids %s%s",
        out_dir,
        model_type,
        summary.num_params / 1e6,
        dtype,
        list(eos_ids),
        ", with its chat template" if summary.chat_template else ", no chat template",
    )
    return summary


def _dependencies() -> tuple[Any, Any, Any]:
    """torch, transformers and transformers' GGUF reader, or an error saying what to install."""
    try:
        import gguf  # noqa: F401  (lazy: the optional gguf extra)
        import torch  # lazy: the optional gguf extra (CPU torch)
        import transformers
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError as e:
        hint = f"reading GGUF needs gguf and torch ({e}); {INSTALL_HINT}"
        raise GGUFImportError(hint) from None
    return torch, transformers, gguf_utils


def _inspect(gguf_file: str) -> tuple[str, tuple[str, ...]]:
    """The file's architecture and tensor types, or an error for a file that is not whole GGUF."""
    from gguf import GGUFReader  # lazy: the optional gguf extra

    try:
        reader = GGUFReader(gguf_file)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    except KeyError as e:
        raise GGUFImportError(f"{gguf_file}: no general.architecture in its metadata") from e
    except Exception as e:  # noqa: BLE001 - numpy/struct errors of a truncated or foreign file
        raise GGUFImportError(
            f"{gguf_file} is not a readable GGUF file (truncated or corrupt?): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not types:
        raise GGUFImportError(f"{gguf_file}: the file holds no tensors")
    return architecture, types


def _check_complete(gguf_file: str, skeleton: Any, tensors: dict[str, Any], config: Any) -> None:
    """Every weight of the model came out of the file (a tied lm_head shares the embedding)."""
    shapes = skeleton.state_dict()
    wanted = set(shapes)
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    missing = sorted(wanted - set(tensors))
    if missing:
        raise GGUFImportError(
            f"{gguf_file}: {len(missing)} weight(s) missing, e.g. {missing[:3]}; "
            "the file does not match its architecture's layout"
        )
    for name in sorted(set(tensors) - wanted):
        del tensors[name]
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(shapes[name].shape):
            raise GGUFImportError(
                f"{gguf_file}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(shapes[name].shape)} from its metadata"
            )


def _end_of_turn_ids(config: Any, tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end of sequence first, then the config's, then every end-of-turn special
    token the vocabulary has: generation stops at any of them."""
    ids: list[int] = []
    vocab = tokenizer.get_vocab()
    candidates = [tokenizer.eos_token_id, config.eos_token_id]
    candidates += [vocab.get(token) for token in END_OF_TURN_TOKENS]
    for value in candidates:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
