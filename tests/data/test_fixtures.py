"""The dataset-layout fixtures and the tiny chat checkpoint themselves (no reader involved)."""

import json
import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlax_tasks.data.code_tests import CodeTests
from tests.data import layouts

PUBLIC_COLUMNS = {
    "write_gsm8k": {"question", "answer"},
    "write_math": {"problem", "level", "type", "solution", "answer", "subject", "unique_id"},
    "write_dapo": {"data_source", "prompt", "ability", "reward_model", "extra_info"},
    "write_messages": {"messages", "answer"},
    "write_code_apps": {
        "problem_id", "question", "solutions", "input_output", "difficulty", "url",
        "starter_code", "time_limit", "memory_limit",
    },
    "write_code_livecodebench": {
        "question_title", "question_content", "platform", "question_id", "contest_date",
        "starter_code", "difficulty", "public_test_cases", "private_test_cases", "metadata",
    },
    "write_code_contests": {
        "name", "description", "public_tests", "private_tests", "generated_tests", "source",
        "difficulty", "time_limit", "memory_limit_bytes",
    },
}


def _read(path: str) -> pd.DataFrame:
    if path.endswith(".parquet"):
        return pd.read_parquet(path)
    return pd.read_json(path, lines=True, dtype=False)


@pytest.mark.parametrize("writer", layouts.WRITERS, ids=lambda w: w.__name__)
def test_writer_file_reads_back_with_public_columns(writer, tmp_path):
    fixture = writer(str(tmp_path))
    frame = _read(fixture.path)
    assert os.path.dirname(fixture.path) == str(tmp_path)
    assert len(frame) == len(fixture.rows) >= 3
    assert PUBLIC_COLUMNS[writer.__name__] <= set(frame.columns)
    assert fixture.format in {"gsm8k", "math", "dapo", "messages", "code"}
    assert any(r["bad"] is None for r in fixture.rows)
    assert any(r["bad"] is not None for r in fixture.rows)


@pytest.mark.parametrize("writer", layouts.WRITERS, ids=lambda w: w.__name__)
def test_expected_rows_are_canonical(writer, tmp_path):
    fixture = writer(str(tmp_path))
    columns = set(_read(fixture.path).columns)
    for row in fixture.rows:
        assert set(row) == {"prompt", "answer", "tests", "bad"}
        if row["bad"] is not None:
            assert row["bad"] in columns
            assert row["prompt"] is row["answer"] is row["tests"] is None
            continue
        assert row["prompt"]
        assert (row["answer"] is None) == (fixture.format == "code")
        if row["tests"] is not None:
            assert CodeTests.from_value(row["tests"]).to_dict() == row["tests"]


def test_expected_answers_come_from_the_raw_columns(tmp_path):
    gsm8k = layouts.write_gsm8k(str(tmp_path))
    for raw, row in zip(_read(gsm8k.path).to_dict("records"), gsm8k.rows, strict=True):
        if row["bad"] is None:
            final = raw["answer"].rsplit("#### ", 1)[1]
            assert final.replace(",", "") == row["answer"] and row["prompt"] in raw["question"]
    math = layouts.write_math(str(tmp_path))
    records = _read(math.path).to_dict("records")
    for raw, row in zip(records, math.rows, strict=True):
        if row["bad"] is None:
            assert raw["solution"].endswith("\\boxed{" + row["answer"] + "}$.")
    math500 = records[-1]
    assert isinstance(math500["level"], int) and math500["answer"] == math.rows[-1]["answer"]
    dapo = layouts.write_dapo(str(tmp_path))
    truths = [r["ground_truth"] for r in pq.read_table(dapo.path)["reward_model"].to_pylist()]
    assert truths == ["34", "12", ""] and [r["answer"] for r in dapo.rows] == ["34", "12", None]
    assert [m["role"] for m in dapo.rows[1]["prompt"]] == ["system", "user"]


def test_parquet_columns_are_nested(tmp_path):
    dapo = pq.read_schema(layouts.write_dapo(str(tmp_path)).path)
    assert pa.types.is_list(dapo.field("prompt").type)
    message = dapo.field("prompt").type.value_type
    assert pa.types.is_struct(message) and {f.name for f in message} == {"content", "role"}
    assert {f.name for f in dapo.field("reward_model").type} == {"ground_truth", "style"}
    assert {f.name for f in dapo.field("extra_info").type} == {"index"}

    contests = pq.read_schema(layouts.write_code_contests(str(tmp_path)).path)
    for group in ("public_tests", "private_tests", "generated_tests"):
        kind = contests.field(group).type
        assert pa.types.is_struct(kind) and pa.types.is_list(kind.field("input").type)
    assert {f.name for f in contests.field("time_limit").type} == {"seconds", "nanos"}
    assert pa.types.is_integer(contests.field("source").type)
    assert pa.types.is_integer(contests.field("memory_limit_bytes").type)


def test_code_limits_and_case_order(tmp_path):
    apps, contests = layouts.write_code_apps(str(tmp_path)), layouts.write_code_contests(
        str(tmp_path)
    )
    taco = apps.rows[2]["tests"]
    assert (taco["time_limit_s"], taco["memory_mb"]) == (2.0, 128)
    assert apps.rows[1]["tests"]["fn_name"] == "add"
    assert apps.rows[1]["prompt"].endswith("\n\n```python\ndef add(a, b):\n```")
    first = contests.rows[0]["tests"]
    assert (first["time_limit_s"], first["memory_mb"]) == (2.5, 256)
    assert [c["public"] for c in first["cases"]] == [True, False, False, False]
    assert [c["output"] for c in first["cases"]] == ["3\n", "11\n", "0\n", "0\n"]


# ------------------------------------------------------------------------- chat model
def test_chat_model_renders_one_bos(chat_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    bos = tokenizer.bos_token_id
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(bos) == 1 and ids[0] == bos
    assert tokenizer(text)["input_ids"][:2] == [bos, bos]  # the double-BOS trap is real
    assert tokenizer("1 + 1")["input_ids"][0] == bos  # plain text gets BOS, like Llama
    assert 400 <= len(tokenizer) <= 600


def test_chat_model_files(chat_model_dir):
    from transformers import AutoTokenizer

    from rlax_tasks.models import load_pretrained

    assert not os.path.exists(os.path.join(chat_model_dir, "chat_template.jinja"))
    with open(os.path.join(chat_model_dir, "tokenizer_config.json")) as f:
        assert f.read().count("{{ bos_token }}") == 1
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    with open(os.path.join(chat_model_dir, "generation_config.json")) as f:
        generation = json.load(f)
    assert generation["eos_token_id"] == [im_end, endoftext]
    assert im_end == tokenizer.eos_token_id
    assert generation["bos_token_id"] == tokenizer.bos_token_id
    policy = load_pretrained(chat_model_dir)
    assert policy.config.vocab_size == len(policy.tokenizer) == len(tokenizer)
    assert policy.config.model_type == "qwen2" and policy.config.eos_token_id == im_end
    assert policy.tokenizer.chat_template.startswith("{{ bos_token }}")
