"""A tiny chat checkpoint shaped like the real ones: Qwen2 weights, a byte-level BPE tokenizer
whose post-processor adds BOS (as Llama's does), a chat template that writes ``{{ bos_token }}``
itself, kept in tokenizer_config.json, and two EOS ids in generation_config.json.

Rendering with ``tokenize=False`` and then encoding with special tokens gives a double BOS: the
trap a prompt renderer must avoid (encode rendered chat text with ``add_special_tokens=False``).
"""

from __future__ import annotations

import json
import os

PAD, IM_START, IM_END, BOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bos|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "So $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$ and $\\sin 60^\\circ = \\dfrac{\\sqrt{3}}{2}$.",
    "0 1 2 3 4 5 6 7 8 9 10 25 100 1,000 -5 0.75 3.14",
    "def add(a, b):\n    return a + b\n",
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "class Solution:\n    def maxSum(self, nums: List[int], k: int) -> int:\n        return 0\n",
    "You are a helpful assistant. What is 2 + 2? The answer is 4.",
]


def _tokenizer():  # noqa: ANN202 - transformers' fast tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[PAD, IM_START, IM_END, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 10, trainer)
    bos = core.token_to_id(BOS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=IM_END, pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def _template_into_config(directory: str) -> None:
    """transformers 5 saves the template to chat_template.jinja; checkpoints on the hub mostly
    carry it as tokenizer_config.json's "chat_template", so put it there."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if not os.path.exists(jinja):
        return  # already in tokenizer_config.json (transformers 4)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    with open(jinja, encoding="utf-8") as f:
        config["chat_template"] = f.read()
    os.remove(jinja)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def build_chat_model(directory: str) -> str:
    """Writes the checkpoint (config.json, safetensors, tokenizer, generation_config.json)."""
    from rlax_tasks.models import Policy
    from tests.tiny_model import tiny_model_config

    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD, IM_END, BOS)}
    config = tiny_model_config(
        "one_layer", vocab_size=len(tokenizer), max_position_embeddings=512,
        bos_token_id=ids[BOS], eos_token_id=ids[IM_END], pad_token_id=ids[PAD],
    )  # fmt: skip
    Policy.init(config, seed=0, tokenizer=tokenizer).save_pretrained(directory)
    _template_into_config(directory)
    generation = {
        "bos_token_id": ids[BOS], "eos_token_id": [ids[IM_END], ids[PAD]],
        "pad_token_id": ids[PAD],
    }
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
    return directory
