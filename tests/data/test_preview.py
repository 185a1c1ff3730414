"""`rlax data preview`: a new dataset checked in seconds — prompts exactly as the sampler sees
them, token counts, parsed references, and the rows that cannot be used."""

from __future__ import annotations

import textwrap

import yaml

from rlax_tasks.cli import main
from rlax_tasks.data import PromptRenderer, PromptSettings, load_dataset
from tests.data.layouts import write_code_apps, write_gsm8k

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _indented(text: str) -> str:
    return textwrap.indent(text, "    ", lambda _: True)


def test_preview_prints_prompts_as_the_sampler_sees_them(tmp_path, chat_model_dir, capsys):
    fx = write_gsm8k(str(tmp_path))
    args = ["data", "preview", fx.path, "--format", "gsm8k", "--model-dir", chat_model_dir]
    flags = ["--template", "chat", "--instruction", INSTRUCTION, "-n", "2"]
    assert main([*args, *flags]) == 0
    out = capsys.readouterr().out
    renderer = PromptRenderer.for_model(
        PromptSettings(template="chat", instruction=INSTRUCTION), chat_model_dir
    )
    rows = load_dataset(fx.path, "gsm8k")
    usable, rejected = len(rows.frame), len(rows.rejected)
    assert f"{len(fx.rows)} rows read, {usable} usable, {rejected} rejected" in out
    for i in range(2):
        prompt = rows.frame["prompt"].iat[i]
        count = len(renderer.encode(prompt))
        assert f"prompt ({count} tokens, template chat):\n{_indented(renderer.text(prompt))}" in out
        assert f"answer: {rows.frame['answer'].iat[i]}" in out
    assert "answer: 72" in out and "answer: 1000" in out  # "#### 1,000" parsed
    bad = [i + 1 for i, r in enumerate(fx.rows) if r["bad"]]
    for row, column in zip(bad, [r["bad"] for r in fx.rows if r["bad"]], strict=True):
        assert f"row {row}: {column}:" in out

    # the same rendering from a run's config.yaml (its prompt section)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"prompt": {"template": "chat", "instruction": INSTRUCTION}}))
    assert main([*args, "--prompt-config", str(config), "-n", "2"]) == 0
    assert capsys.readouterr().out == out


def test_preview_of_code_rows_and_raw_text_without_a_model(tmp_path, capsys):
    fx = write_code_apps(str(tmp_path))
    assert main(["data", "preview", fx.path, "--format", "code", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "(format code, verifier code)" in out
    assert "prompt (template raw; give --model-dir for its tokens):" in out
    assert "tests: 2 call-based add() cases (2 public)" in out
    assert "time_limit_s 2.0, memory_mb 128" in out
    assert "input_output: not valid JSON" in out


def test_preview_mistakes_are_one_line_errors(tmp_path, chat_model_dir, capsys):
    fx = write_gsm8k(str(tmp_path))
    assert main(["data", "preview", fx.path, "--format", "gsm8k", "--template", "chat"]) == 2
    assert "give --model-dir" in capsys.readouterr().err
    config = tmp_path / "run.yaml"
    config.write_text("prompt: {template: chat}\n")
    code = main(["data", "preview", fx.path, "--format", "gsm8k", "--model-dir", chat_model_dir,
                 "--prompt-config", str(config), "--system", "x"])  # fmt: skip
    assert code == 2 and "drop --system" in capsys.readouterr().err
    config.write_text("prompt: {template: jinja}\n")
    code = main(["data", "preview", fx.path, "--prompt-config", str(config)])
    assert code == 2 and "prompt.template: must be one of" in capsys.readouterr().err
    code = main(["data", "preview", fx.path, "--format", "columns"])
    assert code == 2 and "columns" in capsys.readouterr().err
