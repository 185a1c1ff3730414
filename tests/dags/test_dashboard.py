"""The RLAX dashboard app (plugins/rlax_dashboard) on fake run roots, local and gs://."""

from __future__ import annotations

import json
import os
import time

import pytest
from fastapi.testclient import TestClient

from rlax_tasks.rundir import storage
from tests.paramserver.helpers import gcs_emulator

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root: str, run_id: str, steps: int = 4, files: dict[str, bytes] | None = None) -> str:
    """A run as the components write it: config, metrics (reward, staleness, sync time),
    lineage, and the evaluations named in the dashboard's contract."""
    d = storage.join(root, run_id)
    storage.write_bytes(storage.join(d, "config.yaml"), f"run_id: {run_id}\n".encode())
    metrics = [
        {
            "step": s,
            "loss": 0.1,
            "reward_mean": 0.2 + 0.1 * s,
            "staleness_mean": 0.5 + 0.25 * s,
            "weight_sync_s": 0.01 * (s + 1),
            "time": 1000.0 + 2.0 * s,  # wall clock when the step was applied
            "step_time_s": 2.0,
        }
        for s in range(1, steps + 1)
    ]
    body = "".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 99, "reward_me'  # torn
    storage.write_bytes(storage.join(d, "metrics.jsonl"), body.encode())
    storage.write_bytes(storage.join(d, "eval", "v2", "results.json"), results(0.4, 0.7))
    for name, data in (files or {}).items():
        storage.write_bytes(storage.join(d, name), data)
    return d


def results(pass_at_1: float, pass_at_8: float) -> bytes:
    """An `rlax eval` results.json."""
    overall = {"prompts": 10, "pass@1": pass_at_1, "pass@8": pass_at_8, "mean_reward": pass_at_1}
    return json.dumps({"dataset": "d", "models": [{"name": "m", "overall": overall}]}).encode()


@pytest.fixture
def client_for():
    from rlax_dashboard import create_app

    def make(roots, **kw):
        return TestClient(create_app(roots, **kw))

    return make


def test_runs_table_and_states(tmp_path, client_for):
    root = str(tmp_path / "runs")
    write_run(root, "alpha")
    # a finished `rlax run`: before/after pass@k in eval/report.json
    report = {"before": {"pass@1": 0.1, "version": 0}, "after": {"pass@1": 0.5}}
    write_run(root, "beta", steps=2, files={"eval/report.json": json.dumps(report).encode()})
    # a run the DAG marked failed, and one that has not stepped yet
    write_run(
        root,
        "gamma",
        files={"status.json": json.dumps({"state": "failed", "dag_run_id": "r1"}).encode()},
    )
    storage.write_bytes(storage.join(root, "delta", "config.yaml"), b"run_id: delta\n")
    os.makedirs(os.path.join(root, "base-models", "tiny"))  # not a run: no config, no metrics
    old = time.time() - 3600
    os.utime(os.path.join(root, "alpha", "metrics.jsonl"), (old, old))

    client = client_for([root], active_window_s=600)
    runs = {r["run_id"]: r for r in client.get("/api/runs").json()["runs"]}
    assert set(runs) == {"alpha", "beta", "gamma", "delta"}
    assert runs["alpha"]["state"] == "stopped"  # metrics not touched for an hour
    assert runs["alpha"]["step"] == 4 and runs["alpha"]["reward_mean"] == pytest.approx(0.6)
    assert runs["alpha"]["pass_at"] == {"pass@1": 0.4, "pass@8": 0.7}
    assert runs["beta"]["state"] == "finished"
    assert runs["beta"]["pass_at"]["pass@1"] == 0.4  # v2 (nightly) is newer than "after" at step 2
    assert runs["gamma"]["state"] == "failed" and runs["gamma"]["dag_run_id"] == "r1"
    assert runs["delta"]["state"] == "pending" and runs["delta"]["step"] is None

    # a fresh metrics file means running
    now = time.time()
    os.utime(os.path.join(root, "alpha", "metrics.jsonl"), (now, now))
    runs = {r["run_id"]: r for r in client.get("/api/runs").json()["runs"]}
    assert runs["alpha"]["state"] == "running"

    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for run_id in ("alpha", "beta", "gamma", "delta"):
        assert f"href='runs/0/{run_id}/'" in page.text
    assert "pass@8" in page.text and "base-models" not in page.text


def test_series_follow_the_metrics_contract(tmp_path, client_for):
    root = str(tmp_path)
    report = {"before": {"pass@1": 0.1, "version": 0}, "after": {"pass@1": 0.5, "version": 4}}
    write_run(root, "alpha", files={"eval/report.json": json.dumps(report).encode()})
    series = client_for([root]).get("/runs/0/alpha/series").json()
    assert [p[0] for p in series["reward"]] == [1, 2, 3, 4]  # the torn line is skipped
    assert series["reward"][-1][1] == pytest.approx(0.6)
    assert series["staleness"][0] == [1, 0.75]
    assert series["weight_sync"][-1][1] == pytest.approx(0.05)
    assert series["pass_at"]["pass@1"] == [[0, 0.1], [2, 0.4], [4, 0.5]]
    assert series["pass_at"]["pass@8"] == [[2, 0.7]]


def test_pass_at_k_during_a_run_comes_from_eval_progress(tmp_path, client_for):
    progress = "\n".join(
        json.dumps({"step": v, "version": v, "seconds": 3.0 * v, "pass@1": 0.1 * v})
        for v in (0, 2, 4)
    )
    write_run(str(tmp_path), "alpha", files={"eval/progress.jsonl": progress.encode()})
    series = client_for([str(tmp_path)]).get("/runs/0/alpha/series").json()
    assert [p[0] for p in series["pass_at"]["pass@1"]] == [0, 2, 4]
    assert series["pass_at"]["pass@1"][-1][1] == pytest.approx(0.4)


def test_series_fall_back_to_lineage_and_weight_sync_files(tmp_path, client_for):
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.yaml").write_text("run_id: old\n")
    (d / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (d / "lineage.jsonl").write_text(
        '{"step": 1, "version": 3, "rollout_versions": [2, 2, 1, 3]}\n'
    )
    (d / "weight_sync.jsonl").write_text('{"step": 1, "push_s": 0.25}\n')
    series = client_for([str(tmp_path)]).get("/runs/0/old/series").json()
    assert series["staleness"] == [[1, 1.0]]
    assert series["weight_sync"] == [[1, 0.25]]


def test_run_page_and_plots(tmp_path, client_for):
    write_run(str(tmp_path), "alpha")
    client = client_for([str(tmp_path)])
    page = client.get("/runs/0/alpha/")
    assert page.status_code == 200
    for name in ("reward", "pass_at_k", "staleness", "weight_sync"):
        assert f"src='plots/{name}.png'" in page.text
        png = client.get(f"/runs/0/alpha/plots/{name}.png")
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert png.content.startswith(PNG_MAGIC) and len(png.content) > 2000
    # an empty run still plots (labelled "no data yet")
    storage.write_bytes(str(tmp_path / "empty" / "config.yaml"), b"run_id: empty\n")
    assert client.get("/runs/0/empty/plots/reward.png").content.startswith(PNG_MAGIC)


def _bare_run(root: str, run_id: str, config: str, files: dict[str, str]) -> None:
    """A run directory holding ``config`` (config.yaml) and ``files`` only."""
    storage.write_bytes(storage.join(root, run_id, "config.yaml"), config.encode())
    for name, text in files.items():
        storage.write_bytes(storage.join(root, run_id, name), text.encode())


def test_each_empty_plot_says_why(tmp_path, client_for):
    from rlax_dashboard.plots import render_png
    from rlax_dashboard.runs import read_series

    root = str(tmp_path)
    steps = "".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2))
    lineage = json.dumps({"step": 2, "version": 2, "rollout_versions": [1, 2]}) + "\n"
    report = json.dumps({"before": {"pass@1": 0.1, "version": 0}, "after": {"pass@1": 0.3}})
    # a finished colocated run: everything but a weight sync
    colocated = "run_id: c\nplacement:\n  mode: colocated\n"
    files = {"metrics.jsonl": steps, "lineage.jsonl": lineage, "eval/report.json": report}
    _bare_run(root, "c", colocated, files)
    # a disaggregated run that ran without evaluation (stopped: no report), one evaluating
    # every 5 steps at step 2, and one not started
    sync = json.dumps({"step": 2, "push_s": 0.1}) + "\n"
    files = {"metrics.jsonl": steps, "lineage.jsonl": lineage, "weight_sync.jsonl": sync}
    _bare_run(root, "d", "run_id: d\nplacement:\n  mode: disaggregated\n", files)
    every = "run_id: e\nplacement:\n  mode: disaggregated\neval:\n  every_steps: 5\n"
    _bare_run(root, "e", every, {**files, "status.json": json.dumps({"state": "running"})})
    _bare_run(root, "p", colocated, {})
    client = client_for([root], active_window_s=0)

    empty = client.get("/runs/0/c/series").json()["empty"]
    assert list(empty) == ["weight_sync"]
    assert "colocated run" in empty["weight_sync"] and "placement.mode" in empty["weight_sync"]
    page = client.get("/runs/0/c/").text
    assert f"src='plots/weight_sync.png'><figcaption>{empty['weight_sync']}</figcaption>" in page
    assert page.count("<figcaption>") == 1
    png = client.get("/runs/0/c/plots/weight_sync.png").content  # the reason is drawn
    assert png.startswith(PNG_MAGIC)
    assert png != render_png(read_series(storage.join(root, "c")), "weight_sync")

    empty = client.get("/runs/0/d/series").json()["empty"]
    assert list(empty) == ["pass_at_k"]
    assert "eval.every_steps is 0" in empty["pass_at_k"] and "--no-eval" in empty["pass_at_k"]
    empty = client.get("/runs/0/e/series").json()["empty"]
    assert empty == {"pass_at_k": "first held-out evaluation at step 5 (eval.every_steps: 5)"}
    empty = client.get("/runs/0/p/series").json()["empty"]  # colocated: never a weight sync
    assert set(empty) == {"reward", "pass_at_k", "staleness", "weight_sync"}
    assert empty.pop("weight_sync").startswith("colocated run")
    assert all(why == "run not started: no training step yet (pending)" for why in empty.values())


def test_bad_requests_are_404(tmp_path, client_for):
    write_run(str(tmp_path), "alpha")
    client = client_for([str(tmp_path)])
    assert client.get("/runs/0/alpha/plots/loss.png").status_code == 404
    assert client.get("/runs/5/alpha/").status_code == 404
    assert client.get("/runs/0/..%2F..%2Fetc/series").status_code == 404
    assert client.get("/runs/0/.hidden/series").status_code == 404


def test_run_roots_from_env(tmp_path, client_for, monkeypatch):
    from rlax_dashboard import run_roots_from_env

    a, b = tmp_path / "a", tmp_path / "b"
    write_run(str(a), "one")
    write_run(str(b), "two")
    monkeypatch.setenv("RLAX_RUN_ROOTS", f"{a}, {b}")
    assert run_roots_from_env() == [str(a), str(b)]
    runs = client_for(None).get("/api/runs").json()["runs"]
    assert sorted((r["root_index"], r["run_id"]) for r in runs) == [(0, "one"), (1, "two")]
    monkeypatch.delenv("RLAX_RUN_ROOTS")
    assert run_roots_from_env() == ["runs"]


def test_gcs_run_root(client_for):
    with gcs_emulator("dash-test") as bucket:
        root = storage.join(bucket, "team/runs")
        write_run(root, "remote", steps=3)
        client = client_for([root])
        runs = client.get("/api/runs").json()["runs"]
        assert [(r["run_id"], r["step"], r["state"]) for r in runs] == [("remote", 3, "running")]
        assert client.get("/runs/0/remote/plots/reward.png").content.startswith(PNG_MAGIC)


def test_auth_required_when_mounted_in_airflow(tmp_path, client_for):
    client = client_for([str(tmp_path)], require_auth=True)
    assert client.get("/").status_code == 401
    assert client.get("/api/runs").status_code == 401


def test_plugin_registers_app_and_nav_view():
    import rlax_plugin
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    plugin = rlax_plugin.RlaxPlugin
    (app,) = plugin.fastapi_apps
    assert app["url_prefix"] == "/rlax" and app["name"]
    (view,) = plugin.external_views
    parsed = ExternalViewResponse.model_validate(view)
    assert parsed.url_route == "rlax" and parsed.destination == "nav"
    assert not parsed.href.startswith("/") and parsed.href.startswith("rlax")
    # the mounted app is the authenticated one
    assert TestClient(app["app"]).get("/api/runs").status_code == 401


DAG_RUN_ID = "manual__2025-01-01T00:00:00+00:00"
DAG_RUN_PATH = "dags/rlax_train/runs/manual__2025-01-01T00%3A00%3A00%2B00%3A00"


def test_run_page_shows_before_and_after_the_nightly_history_and_the_dag_run(tmp_path, client_for):
    history = [
        {"date": "2025-01-02", "version": 2, "pass@1": 0.4, "pass@8": 0.7, "mean_reward": 0.4},
        {"date": "2025-01-03", "version": 3, "pass@1": 0.45, "pass@8": 0.75},
    ]
    status = {"state": "succeeded", "dag_run_id": DAG_RUN_ID, "dag_id": "rlax_train"}
    write_run(
        str(tmp_path),
        "alpha",
        files={
            "eval/v0/results.json": results(0.1, 0.3),  # the DAG's base evaluation
            "eval/history.jsonl": "".join(json.dumps(r) + "\n" for r in history).encode(),
            "status.json": json.dumps(status).encode(),
        },
    )
    client = client_for([str(tmp_path)])
    series = client.get("/runs/0/alpha/series").json()
    assert series["pass_at"]["pass@1"] == [[0, 0.1], [2, 0.4]]  # two points: before and after
    assert series["before_after"] == {
        "before": {"version": 0, "pass@1": 0.1, "pass@8": 0.3, "mean_reward": 0.1},
        "after": {"version": 2, "pass@1": 0.4, "pass@8": 0.7, "mean_reward": 0.4},
    }
    # training time: the first step's wall clock less its duration is 0 s
    assert series["pass_at_time"]["pass@1"] == [[0.0, 0.1], [4.0, 0.4]]

    page = client.get("/runs/0/alpha/").text
    table = page.split("class='before-after'>", 1)[1].split("</table>", 1)[0]
    assert "before (v0)" in table and "after (v2)" in table
    assert "<td>pass@1</td><td>0.100</td><td>0.400</td>" in table and "+0.300" in table
    history_table = page.split("class='history'>", 1)[1].split("</table>", 1)[0]
    assert history_table.index("2025-01-03") < history_table.index("2025-01-02")  # newest first
    # the DAG run in the Airflow UI (/dags/<dag_id>/runs/<run_id>), out of the dashboard's iframe
    assert f"href='../../../../{DAG_RUN_PATH}' target='_top'" in page
    runs = client.get("/api/runs").json()["runs"]
    assert runs[0]["dag_run_path"] == DAG_RUN_PATH
    assert f"href='../{DAG_RUN_PATH}' target='_top'" in client.get("/").text
    absolute = client_for([str(tmp_path)], airflow_ui="https://airflow.example/")
    assert f"href='https://airflow.example/{DAG_RUN_PATH}'" in absolute.get("/runs/0/alpha/").text


def test_before_and_after_of_rlax_run_come_from_its_report(tmp_path, client_for):
    report = {"before": {"pass@1": 0.1, "version": 0}, "after": {"pass@1": 0.5}}
    d = str(tmp_path)
    write_run(d, "beta", steps=6, files={"eval/report.json": json.dumps(report).encode()})
    storage.delete_prefix(storage.join(d, "beta", "eval", "v2"))
    old_status = {"state": "failed", "dag_run_id": "r1"}  # before status.json named its DAG
    write_run(d, "gamma", files={"status.json": json.dumps(old_status).encode()})
    client = client_for([d])
    numbers = client.get("/runs/0/beta/series").json()["before_after"]
    assert numbers == {
        "before": {"version": 0, "pass@1": 0.1},
        "after": {"version": 6, "pass@1": 0.5},
    }
    assert "No nightly evaluation yet" in client.get("/runs/0/beta/").text
    assert "href='../../../../dags/rlax_train/runs/r1'" in client.get("/runs/0/gamma/").text
    assert "No held-out evaluation yet" not in client.get("/runs/0/gamma/").text


def write_config(root: str, run_id: str, reload_every: int, max_staleness: int) -> None:
    text = (
        f"run_id: {run_id}\nrun_root: {root}\nstaleness:\n  reload_every: {reload_every}\n"
        f"  max_staleness: {max_staleness}\nalgorithm:\n  preset: grpo\n"
        "datasets:\n- name: arith\n  source: {task: arithmetic, seed: 0}\n"
    )
    storage.write_bytes(storage.join(root, run_id, "config.yaml"), text.encode())


def test_compare_view_of_two_runs(tmp_path, client_for):
    root = str(tmp_path)
    write_run(root, "j1k2", files={"eval/v0/results.json": results(0.1, 0.3)})
    write_run(root, "j2k4", steps=6, files={"eval/v0/results.json": results(0.1, 0.3)})
    write_config(root, "j1k2", 1, 2)
    write_config(root, "j2k4", 2, 4)
    client = client_for([root])
    index = client.get("/").text
    assert "<form id='compare' action='compare' method='get'>" in index
    for run_id in ("j1k2", "j2k4"):
        assert f"name='runs' value='0/{run_id}'" in index

    # the runs table's checkboxes repeat ?runs=; a link may give them comma-separated
    data = client.get("/api/compare", params=[("runs", "0/j1k2"), ("runs", "0/j2k4")]).json()
    assert data == client.get("/api/compare?runs=j1k2,j2k4").json()
    assert data["k"] == "pass@1" and data["ks"] == ["pass@1", "pass@8"]
    assert [r["label"] for r in data["runs"]] == ["j1k2", "j2k4"]
    assert [r["step"] for r in data["runs"]] == [4, 6]
    assert data["runs"][0]["before_after"]["after"] == {
        "version": 2, "pass@1": 0.4, "pass@8": 0.7, "mean_reward": 0.4,
    }  # fmt: skip
    assert data["series"]["j2k4"]["reward"][-1][1] == pytest.approx(0.8)
    assert data["series"]["j1k2"]["pass_at_time"]["pass@1"] == [[0.0, 0.1], [4.0, 0.4]]
    # only the keys that differ (run_id aside: the runs are named)
    assert data["config_differences"] == [
        {"key": "staleness.max_staleness", "values": [2, 4]},
        {"key": "staleness.reload_every", "values": [1, 2]},
    ]

    page = client.get("/compare?runs=0/j1k2,0/j2k4&k=pass@8")
    assert page.status_code == 200
    assert "<h1>Compare 2 runs</h1>" in page.text
    differences = page.text.split("class='config-differences'>", 1)[1].split("</table>", 1)[0]
    assert "<td>staleness.reload_every</td><td>1</td><td>2</td>" in differences
    assert "algorithm.preset" not in differences and "run_id" not in differences
    assert "<th>pass@8 before</th>" in page.text and "+0.400" in page.text  # 0.3 -> 0.7
    srcs = [s.split("'", 1)[0] for s in page.text.split("src='")[1:]]
    names = ["reward", "pass_at_k", "pass_at_k_time", "staleness", "weight_sync"]
    assert [s.split("?", 1)[0] for s in srcs] == [f"compare/plots/{n}.png" for n in names]
    for src in srcs:
        png = client.get("/" + src.replace("&amp;", "&"))
        assert png.status_code == 200 and png.content.startswith(PNG_MAGIC), src
        assert len(png.content) > 2000


def test_compare_refuses_bad_selections(tmp_path, client_for):
    root = str(tmp_path)
    write_run(root, "a")
    write_run(root, "b")
    client = client_for([root])
    one = client.get("/compare?runs=0/a")
    assert one.status_code == 400 and "two or more runs" in one.text
    assert client.get("/compare?runs=0/a,0/a").status_code == 400  # the same run twice
    assert client.get("/api/compare?runs=0/a,0/nope").status_code == 404
    assert client.get("/api/compare?runs=0/a,x/b").status_code == 404
    assert client.get("/api/compare?runs=0/a,..").status_code == 404
    assert client.get("/api/compare?runs=a,b&k=loss").status_code == 404
    assert client.get("/compare/plots/loss.png?runs=a,b").status_code == 404
    many = ",".join(f"r{i}" for i in range(9))
    for i in range(9):
        write_run(root, f"r{i}", steps=1)
    assert client.get(f"/api/compare?runs={many}").status_code == 400


def test_compare_needs_airflow_auth_when_mounted(tmp_path, client_for):
    client = client_for([str(tmp_path)], require_auth=True)
    assert client.get("/compare?runs=a,b").status_code == 401
    assert client.get("/api/compare?runs=a,b").status_code == 401
