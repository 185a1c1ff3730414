"""Datasets (docs/design.md §11): readers (JSONL, Parquet, CSV; local or gs://), the row schema,
format adapters for public layouts, prompt rendering and the prompt source (a dataset file as
prompts); curation, evaluation, the preflight and the controller use it. Names load lazily, so the
light modules (``answers``, ``code_tests``, ``prompts``) import without pandas: verifier worker
processes read answers through them."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CodeCase": ".code_tests",
        "CodeTests": ".code_tests",
        "DataFormat": ".formats",
        "DatasetError": ".prompt_source",
        "DatasetRows": ".dataset",
        "FORMAT_NAMES": ".formats",
        "FieldError": ".errors",
        "FilePrompts": ".prompt_source",
        "PromptRenderer": ".prompts",
        "PromptSettings": ".prompts",
        "PromptSettingsError": ".prompts",
        "RawTable": ".readers",
        "Rejected": ".readers",
        "expand_inputs": ".files",
        "get_format": ".formats",
        "gsm8k_answer": ".answers",
        "last_boxed": ".answers",
        "load_dataset": ".dataset",
        "open_dataset": ".prompt_source",
        "prompt_text": ".schema",
        "read_dataset": ".dataset",
        "read_inputs": ".readers",
    },
)
