"""The RLAX dashboard app (plugins/rlax_dashboard) on fake run roots, local and gs://."""

from __future__ import annotations

import json
import os
import time

import pytest
from fastapi.testclient import TestClient

from rlax_tasks import storage
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
        }
        for s in range(1, steps + 1)
    ]
    body = "".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 99, "reward_me'  # torn
    storage.write_bytes(storage.join(d, "metrics.jsonl"), body.encode())
    results = {"models": [{"name": "m", "overall": {"prompts": 10, "pass@1": 0.4, "pass@8": 0.7}}]}
    storage.write_bytes(storage.join(d, "eval", "v2", "results.json"), json.dumps(results).encode())
    for name, data in (files or {}).items():
        storage.write_bytes(storage.join(d, name), data)
    return d


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
