"""The evaluator on a synthetic arithmetic dataset with scripted and real models."""

import json

import numpy as np
import pytest

from rlax_tasks.cli import main
from rlax_tasks.data import load_dataset
from rlax_tasks.evaluation import (
    EvalConfig,
    evaluate,
    load_model,
    pass_at_k,
    write_eval_outputs,
)
from tests.evaluation.helpers import arithmetic_rows, tiny_policy, write_jsonl


def scripted(plan):
    """GenerateFn: plan[prompt] = list of final answers (None = no answer) of the n samples."""

    def generate(prompts, n):
        out = []
        for p in prompts:
            answers = plan[p]
            assert len(answers) == n
            out.append(["I think." if a is None else f"So \\boxed{{{a}}}" for a in answers])
        return out

    return generate


@pytest.fixture()
def dataset(tmp_path):
    rows = arithmetic_rows(4)
    rows[3]["metadata"]["difficulty"] = "hard"
    return write_jsonl(tmp_path / "eval.jsonl", rows), rows


def test_metrics_overall_and_per_group(dataset):
    path, rows = dataset
    frame = load_dataset(path).frame
    a = [r["answer"] for r in rows]
    plan = {
        frame["prompt"][0]: [a[0], a[0], a[0], a[0]],  # 4 correct
        frame["prompt"][1]: ["-1", a[1], "-1", None],  # 1 correct, wrong majority
        frame["prompt"][2]: [None, None, None, None],  # no answer at all
        frame["prompt"][3]: [a[3], "-7", a[3], "-7"],  # 2 correct, tie won by the right one
    }
    result = evaluate(frame, scripted(plan), EvalConfig(n=4, ks=(1, 2, 4)), "m")
    correct = [4, 1, 0, 2]
    assert [r["correct"] for r in result.rows] == correct
    for k in (1, 2, 4):
        expected = np.mean([pass_at_k(4, c, k) for c in correct])
        assert result.overall[f"pass@{k}"] == pytest.approx(expected)
    assert result.overall["maj@1"] == pytest.approx((1 + 0 + 0 + 1) / 4)
    assert result.overall["maj@4"] == pytest.approx((1 + 0 + 0 + 1) / 4)
    assert result.overall["maj@2"] == pytest.approx((1 + 0 + 0 + 1) / 4)
    assert result.overall["mean_reward"] == pytest.approx(7 / 16)
    # rows alternate sources arith-0 / arith-1
    assert result.by_source["arith-0"]["pass@1"] == pytest.approx((1 + 0) / 2)
    assert result.by_source["arith-1"]["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert set(result.by_difficulty) == {"hard", "unknown"}
    assert result.by_difficulty["hard"]["prompts"] == 1


def test_outputs_and_side_by_side_comparison(dataset, tmp_path):
    path, rows = dataset
    frame = load_dataset(path).frame
    good = {p: [r["answer"]] * 2 for p, r in zip(frame["prompt"], rows, strict=True)}
    bad = {p: ["-99999", None] for p in frame["prompt"]}
    config = EvalConfig(n=2, ks=(1, 2))
    results = [
        evaluate(frame, scripted(bad), config, "base"),
        evaluate(frame, scripted(good), config, "tuned"),
    ]
    out = tmp_path / "out"
    data = write_eval_outputs(results, path, str(out))
    assert data["delta"]["pass@1"] == pytest.approx(1.0)
    on_disk = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in on_disk["models"]] == ["base", "tuned"]
    assert on_disk["models"][1]["overall"]["maj@2"] == 1.0
    md = (out / "summary.md").read_text()
    assert "| pass@1 | 0.000 | 1.000 | +1.000 |" in md
    assert "## By source" in md and "arith-0" in md
    for png in ("pass_at_k.png", "by_source.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 8 and json.loads(samples[0])["model"] == "base"


def test_dataset_errors_name_the_row(tmp_path):
    rows = arithmetic_rows(3)
    rows[1]["date"] = "someday"
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    loaded = load_dataset(path)  # the bad row is left out and listed, the others evaluate
    assert len(loaded.frame) == 2 and [r.row for r in loaded.rejected] == [2]
    assert loaded.rejected[0].reason.startswith("date: not an ISO date")
    for r in rows:
        r["date"] = "someday"
    write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"no usable rows; first: .*bad.jsonl row 1: date"):
        load_dataset(path)
    with pytest.raises(ValueError, match="k must lie"):
        EvalConfig(n=4, ks=(1, 8))


def _write_mirror(run_root, version, policy):
    """A parameter-server mirror of `policy`'s weights, blocked as the server blocks them."""
    from rlax_tasks.paramserver import mirror
    from rlax_tasks.paramserver.store import Block, WeightVersion
    from rlax_tasks.paramserver.wire import (
        ArraySpec,
        BlockHeader,
        Manifest,
        crc32c,
        split_blocks,
        version_digest,
    )

    specs, blocks = [], []
    for i, (name, value) in enumerate(policy.named_params()):
        arr = np.asarray(value)
        specs.append(ArraySpec(name, str(arr.dtype), tuple(arr.shape)))
        for lo, hi in split_blocks(arr.shape, arr.itemsize, 1024):  # several blocks per array
            part = np.ascontiguousarray(
                arr[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
            )
            data = part.reshape(-1).view(np.uint8).copy()
            header = BlockHeader(i, lo, hi, data.nbytes, crc32c(data))
            blocks.append(Block(header, data))
    manifest = Manifest(version, tuple(specs), len(blocks))
    weights = WeightVersion(manifest, blocks, version_digest(manifest, [b.header for b in blocks]))
    mirror.write_version(run_root, weights)


@pytest.mark.slow
def test_eval_cli_compare_and_mirror_weights(tmp_path, capsys):
    base, other = tiny_policy(seed=0), tiny_policy(seed=1)
    base.save_pretrained(str(tmp_path / "base"))
    other.save_pretrained(str(tmp_path / "other"))
    run_root = str(tmp_path / "run")
    _write_mirror(run_root, 3, other)

    loaded = load_model(str(tmp_path / "base"), run_root)  # newest committed version
    want = dict(other.named_params())
    for name, value in loaded.named_params():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]))
    with pytest.raises(FileNotFoundError, match="no committed weight version 9"):
        load_model(str(tmp_path / "base"), f"{run_root}@9")

    data = write_jsonl(tmp_path / "d.jsonl", arithmetic_rows(3))
    out = tmp_path / "eval"
    args = [
        "eval",
        "--model-dir",
        str(tmp_path / "base"),
        "--dataset",
        data,
        "--n",
        "2",
        "--k",
        "1,2",
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
        "--max-len",
        "96",
        "--max-slots",
        "8",
    ]
    code = main(
        [*args, "--compare", str(tmp_path / "base"), "--compare-weights-from", f"{run_root}@3"]
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in results["models"]]
    assert names[0] == "base" and names[1].endswith("@3")
    assert all(m["overall"]["prompts"] == 3 for m in results["models"])
    assert "pass@2" in results["delta"]
    printed = capsys.readouterr().out
    assert "pass@1=" in printed

    code = main([*args, "--k", "1,4"])
    err = capsys.readouterr().err
    assert code == 2 and "k must lie in [1, n=2]" in err
    code = main([*args[:2], str(tmp_path / "missing"), *args[3:]])
    assert code == 2 and "missing" in capsys.readouterr().err


def test_curated_parquet_is_an_eval_dataset_with_pass_rate_difficulty(tmp_path):
    from rlax_tasks.curation import CurationConfig, run_curation, write_outputs

    rows = arithmetic_rows(4)
    plan = {r["prompt"]: (r["answer"], c) for r, c in zip(rows, [1, 3, 2, 1], strict=True)}

    def generate(prompts, n):
        return [
            [f"\\boxed{{{plan[p][0]}}}" if j < plan[p][1] else "\\boxed{-99999}" for j in range(n)]
            for p in prompts
        ]

    config = CurationConfig(inputs=(write_jsonl(tmp_path / "in.jsonl", rows),), pass_rate_k=4)
    write_outputs(run_curation(config, generate), config, str(tmp_path / "cur"))
    frame = load_dataset(str(tmp_path / "cur" / "train.parquet")).frame
    assert len(frame) == 4 and frame["answer"].tolist() == [r["answer"] for r in rows]
    result = evaluate(frame, generate, EvalConfig(n=4, ks=(1,)), "m")
    assert result.overall["pass@1"] == pytest.approx((1 + 3 + 2 + 1) / 16)
    assert set(result.by_difficulty) == {
        "pass_rate [0.25, 0.50)",
        "pass_rate [0.50, 0.75)",
        "pass_rate [0.75, 1.00]",
    }
    # the input's metadata id wins over the curated id column (kept in metadata otherwise)
    assert result.rows[0]["id"] == "arithmetic-0-0"


def test_run_checkpoints_need_a_registered_loader(tmp_path):
    from rlax_tasks.evaluation import register_loader, unregister_loader

    step = tmp_path / "checkpoints" / "100"
    (step / "state").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(ValueError, match="Orbax run checkpoint.*register_loader"):
        load_model(str(step))
    policy = tiny_policy()
    register_loader("orbax-test", lambda path: policy if path == str(step) else None)
    try:
        assert load_model(str(step)) is policy
    finally:
        unregister_loader("orbax-test")
    with pytest.raises(ValueError, match="Orbax"):
        load_model(str(step))
