"""A real-browser test of the Airflow UI: headless Chromium (Debian's chromium + chromedriver,
driven by Selenium) opens the UI served by `airflow standalone`, triggers rlax_train through the
Params form, waits for the run, then opens the RLAX dashboard from the UI's navigation and checks
that the run is listed and that its page shows the four plots.

It then writes a second run from files beside it (other staleness settings, other numbers),
ticks both in the runs table and opens the compare view (one plot per quantity, a line per run,
the configuration keys that differ), and follows the dashboard's link to the DAG run back into
the Airflow UI.

The base model's evaluation (eval/v0, the "before") comes from the run root's cache, as for a
run repeated with the same model and settings: the test checks that rlax_train skips the
evaluate_base job then (tests/airflow_ops/test_airflow_train_cli.py runs it).

Screenshots are kept under ``RLAX_TEST_ARTIFACTS`` (default tests/artifacts/browser/): the filled
trigger form, the DAG run, the dashboard's runs table, the run page with its held-out numbers
before and after training, the compare view, the DAG run reached from the dashboard (and the
page at the moment of a failure). Needs `bash scripts/setup.sh --test` (the chromium packages
and selenium).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.parse

import pytest
import yaml

from tests.dags.conftest import REPO
from tests.dags.standalone import DAG_ID, TAG_ENV, Standalone, wait_for

RUN_ID = "browser-e2e"
OTHER_RUN_ID = "browser-compare"  # written from files: j=2, k=4 against the DAG run's j=k=1
STEPS = 2
PRESET = "tiny-arith"
PLOTS = ("reward", "pass_at_k", "staleness", "weight_sync")
COMPARE_PLOTS = ("reward", "pass_at_k", "pass_at_k_time", "staleness", "weight_sync")
RUN_TIMEOUT_S = float(os.environ.get("RLAX_BROWSER_RUN_TIMEOUT_S") or 900)
UI_TIMEOUT_S = 60
ARTIFACTS = os.environ.get("RLAX_TEST_ARTIFACTS") or os.path.join(REPO, "tests", "artifacts")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def artifacts() -> str:
    path = os.path.join(ARTIFACTS, "browser")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    """`airflow standalone` on a free port, ready with rlax_train parsed; always stopped."""
    server = Standalone(str(tmp_path_factory.mktemp("airflow-standalone")))
    server.start()
    try:
        try:
            server.wait_ready()
        except (TimeoutError, RuntimeError) as e:
            raise AssertionError(f"{e}\n--- standalone log tail:\n{server.log_tail()}") from e
        yield server
    finally:
        leftovers = server.stop()
        if leftovers:
            print("killed after the grace period:\n  " + "\n  ".join(leftovers))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A random tiny model with the character tokenizer, as the tiny-arith preset's model (its
    warm-up is tested in tests/warmup; the UI and the dashboard are what this test is about)."""
    from tests.tiny_model import save_char_model

    path = str(tmp_path_factory.mktemp("base-models") / PRESET)
    save_char_model(path)
    return path


@pytest.fixture(scope="module")
def browser(artifacts, airflow):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    assert chromium and chromedriver, (
        "the browser test needs Debian's chromium and chromium-driver packages: "
        "run `bash scripts/setup.sh --test`"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with both paths given, Selenium Manager stays idle
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-proxy-server",  # everything it opens is on 127.0.0.1
        "--window-size=1400,1800",  # tall: the whole trigger form fits in one screenshot
        f"--user-data-dir={os.path.join(airflow.root, 'chromium-profile')}",
    ):
        options.add_argument(arg)
    service = Service(
        executable_path=chromedriver,
        log_output=os.path.join(artifacts, "chromedriver.log"),
        env={**os.environ, TAG_ENV: airflow.tag},  # stopped with the standalone, if left
    )
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(UI_TIMEOUT_S)
    try:
        yield driver
    finally:
        driver.quit()


# --------------------------------------------------------------------------- browser helpers
def _wait(driver, timeout: float = UI_TIMEOUT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.25)


def _screenshot(driver, artifacts: str, name: str) -> str:
    path = os.path.join(artifacts, f"{name}.png")
    driver.save_screenshot(path)
    print(f"screenshot: {path}")
    return path


def _set_text(driver, name: str, text: str) -> None:
    """Types ``text`` into the Params form field ``name`` (replacing its value)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = _wait(driver).until(
        lambda d: d.find_element(By.CSS_SELECTOR, f"input[name='element_{name}']"),
        f"no Params field {name!r} in the trigger form",
    )
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", field)
    # The form re-renders per keystroke: on a busy machine a fast burst can lose one, so later
    # attempts type a key at a time, as slowly as a person would.
    for attempt in range(4):
        field.click()
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys(Keys.DELETE)
        if attempt == 0:
            field.send_keys(text)
        else:
            for ch in text:
                field.send_keys(ch)
                time.sleep(0.05 * attempt)
        field.send_keys(Keys.TAB)  # blur: the number inputs commit their value
        try:
            _wait(driver, 5).until(lambda d: field.get_attribute("value") == text)
            return
        except TimeoutException:
            continue
    raise AssertionError(f"field {name!r} does not take {text!r}: {field.get_attribute('value')!r}")


def _select_option(driver, name: str, option: str) -> None:
    """Picks ``option`` in the select field ``name`` (a react-select): open its menu, click."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, f"#element_{name} input[role='combobox']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", box)
    box.click()
    xpath = f"//*[@role='option' and normalize-space()='{option}']"
    _wait(driver, 10).until(
        lambda d: d.find_elements(By.XPATH, xpath), f"{name!r} offers no option {option!r}"
    )[0].click()
    hidden = driver.find_element(By.CSS_SELECTOR, f"input[type='hidden'][name='element_{name}']")
    _wait(driver, 10).until(
        lambda d: hidden.get_attribute("value") == option, f"{name!r} did not take {option!r}"
    )


def trigger_through_form(driver, airflow: Standalone, artifacts: str, model_path: str) -> str:
    """Opens rlax_train's Trigger dialog, fills the Params form and submits it; the new DAG
    run's id (from the page the UI goes to)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    driver.get(f"{airflow.base_url}/dags/{DAG_ID}")
    _wait(driver).until(
        ec.element_to_be_clickable((By.CSS_SELECTOR, "[data-testid='trigger-dag-button']")),
        f"no Trigger button on the page of {DAG_ID}",
    ).click()
    dialog = _wait(driver).until(
        ec.visibility_of_element_located(
            (By.XPATH, f"//*[@role='dialog' and .//h2[contains(., '{DAG_ID}')]]")
        ),
        "the Trigger dialog does not open",
    )
    assert dialog.find_elements(By.CSS_SELECTOR, "[data-testid='config-form']"), (
        "the trigger dialog shows no Params form"
    )
    _select_option(driver, "preset", PRESET)
    _set_text(driver, "steps", str(STEPS))
    _set_text(driver, "run_id", RUN_ID)
    # the base model (left empty, the DAG's plan task would build the preset's by its warm-up)
    _set_text(driver, "model_path", model_path)
    unpause = dialog.find_element(
        By.XPATH, ".//label[contains(normalize-space(), 'Unpause')]//input[@type='checkbox']"
    )
    assert unpause.is_selected(), "'Unpause rlax_train on trigger' should be checked by default"
    submit = dialog.find_element(By.CSS_SELECTOR, "[data-testid='trigger-dag-submit']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", submit)
    _wait(driver, 10).until(
        lambda d: submit.is_enabled(), "the form's Trigger button stays disabled (invalid Params?)"
    )
    _screenshot(driver, artifacts, "1-trigger-form")
    submit.click()
    _wait(driver).until(
        lambda d: f"/dags/{DAG_ID}/runs/" in d.current_url,
        "the UI did not go to the new DAG run's page after Trigger",
    )
    path = urllib.parse.urlparse(driver.current_url).path
    return urllib.parse.unquote(path.split("/runs/", 1)[1].split("/")[0])


def wait_for_run(airflow: Standalone, dag_run_id: str) -> str:
    """The DAG run's final state (success or failed), polled through the REST API."""

    def finished() -> str | None:
        if not airflow.alive():
            raise RuntimeError("airflow standalone exited while the DAG run was going")
        try:
            state = airflow.dag_run(dag_run_id)["state"]
        except OSError as e:  # a busy api-server (2 cores, 5 jobs): ask again
            print(f"polling {dag_run_id}: {e!r}")
            return None
        return state if state in ("success", "failed") else None

    return wait_for(f"DAG run {dag_run_id} to finish", finished, RUN_TIMEOUT_S, interval=5)


def _dashboard_frame(driver, airflow: Standalone):
    """Opens the RLAX entry of the UI's navigation and switches into the dashboard's iframe."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    driver.get(f"{airflow.base_url}/")
    _wait(driver).until(
        ec.element_to_be_clickable((By.CSS_SELECTOR, "a[aria-label='RLAX']")),
        "no RLAX entry in the UI's navigation",
    ).click()

    def dashboard_frame(d):
        for frame in d.find_elements(By.TAG_NAME, "iframe"):
            # the property: the attribute may be relative to the UI's base URL
            src = d.execute_script("return arguments[0].src", frame) or ""
            if urllib.parse.urlparse(src).path.rstrip("/").endswith("/rlax"):
                return frame
        return None

    frame = _wait(driver).until(dashboard_frame, "no iframe of the RLAX dashboard (/rlax/)")
    driver.switch_to.frame(frame)
    return frame


def _images_loaded(driver, names: tuple[str, ...], what: str) -> dict[str, str]:
    """Waits until the page's plots ``names`` (by file name) have loaded; {name: alt}."""

    def loaded() -> dict[str, str] | None:
        imgs = driver.execute_script(
            "return Array.from(document.images).map(i => "
            "[i.getAttribute('src'), i.alt, i.complete, i.naturalWidth]);"
        )
        done = {
            src.split("?", 1)[0].rsplit("/", 1)[-1].removesuffix(".png"): alt
            for src, alt, complete, width in imgs
            if complete and width > 0
        }
        return done if set(names) <= set(done) else None

    return _wait(driver, 120).until(lambda d: loaded(), f"the plots {names} do not all load {what}")


def open_dashboard_run(driver, airflow: Standalone, artifacts: str) -> dict[str, str]:
    """Opens the RLAX entry of the UI's navigation, finds the run in the dashboard (an iframe)
    and opens its page; returns {plot name: alt} of the plots that loaded, the run's state and
    its before/after table."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    frame = _dashboard_frame(driver, airflow)
    try:
        link = _wait(driver).until(
            ec.element_to_be_clickable((By.LINK_TEXT, RUN_ID)),
            f"the dashboard does not list run {RUN_ID}",
        )
        row = link.find_element(By.XPATH, "./ancestor::tr")
        state = row.find_element(By.CSS_SELECTOR, ".state").text
        driver.switch_to.default_content()
        _screenshot(driver, artifacts, "3-dashboard-runs")
        driver.switch_to.frame(frame)
        link = driver.find_element(By.LINK_TEXT, RUN_ID)
        link.click()
        _wait(driver).until(
            ec.text_to_be_present_in_element((By.TAG_NAME, "h1"), RUN_ID),
            f"the dashboard's page of {RUN_ID} does not open",
        )
        plots = _images_loaded(driver, PLOTS, "on the run page")
        before_after = driver.find_element(By.CSS_SELECTOR, "table.before-after").text
        driver.execute_script("window.scrollTo(0, 0)")
    finally:
        driver.switch_to.default_content()
    _screenshot(driver, artifacts, "4-dashboard-run")
    return {"state": state, "before_after": before_after, **plots}


# the starting weights' evaluation a previous run of the same model left in the run root
SEEDED_BEFORE = {"prompts": 200, "pass@1": 0.05, "pass@8": 0.3, "mean_reward": 0.05}


def seed_base_eval(run_root: str, model_path: str) -> str:
    """Puts the base evaluation of RUN_ID's model, data and evaluation settings in the run
    root's cache, as an earlier run would have (the real evaluation is in
    tests/airflow_ops/test_airflow_train_cli.py): rlax_train copies it into eval/v0 and skips
    evaluate_base.
    Returns the cache entry's directory."""
    from rlax_tasks.airflow import eval_planning as rc
    from rlax_tasks.config import load_config
    from rlax_tasks.evaluation.base_eval import plan_base_eval
    from rlax_tasks.rundir.paths import run_paths

    # the run config the DAG's plan task makes of the trigger form's Params
    overrides = {"run_root": run_root, "run_id": RUN_ID, "model.path": model_path,
                 "model.warmup_if_missing": False}  # fmt: skip
    cfg = load_config(PRESET, overrides)
    plan = plan_base_eval(cfg, rc.base_eval_argv(cfg, run_paths(cfg.run_dir).heldout))
    os.makedirs(plan.cache_dir)
    results = {"dataset": "heldout", "models": [{"name": PRESET, "overall": SEEDED_BEFORE}]}
    with open(os.path.join(plan.cache_dir, "results.json"), "w") as f:
        json.dump(results, f)
    return plan.cache_dir


def write_other_run(run_root: str) -> None:
    """A second run beside RUN_ID, written from files as the components write them: RUN_ID's
    config with j=2, k=4, its metrics with other rewards, its base evaluation, another final."""
    from rlax_tasks.rundir.paths import run_paths

    src, dst = (
        run_paths(os.path.join(run_root, RUN_ID)),
        run_paths(os.path.join(run_root, OTHER_RUN_ID)),
    )
    with open(src.config) as f:
        config = yaml.safe_load(f)
    config.update(run_id=OTHER_RUN_ID, staleness={"reload_every": 2, "max_staleness": 4})
    os.makedirs(dst.eval_dir(0))
    with open(dst.config, "w") as f:
        yaml.safe_dump(config, f)
    with open(src.metrics) as f, open(dst.metrics, "w") as out:
        for line in f:
            row = json.loads(line)
            row["reward_mean"] = min(1.0, row.get("reward_mean", 0.0) + 0.2)
            out.write(json.dumps(row) + "\n")
    shutil.copy(src.eval_results(0), dst.eval_results(0))
    with open(src.eval_results(STEPS)) as f:
        final = json.load(f)
    overall = final["models"][0]["overall"]
    for key in [k for k in overall if k.startswith("pass@")]:
        overall[key] = min(1.0, overall[key] + 0.1)
    os.makedirs(dst.eval_dir(STEPS))
    with open(dst.eval_results(STEPS), "w") as f:
        json.dump(final, f)


def open_compare_view(driver, airflow: Standalone, artifacts: str, dag_run_id: str) -> dict:
    """Ticks RUN_ID and OTHER_RUN_ID in the dashboard's runs table, presses Compare, waits for
    the plots, then follows RUN_ID's DAG run link out of the iframe into the Airflow UI;
    returns the configuration differences as shown and the DAG run page's path."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    frame = _dashboard_frame(driver, airflow)
    try:
        for run_id in (RUN_ID, OTHER_RUN_ID):
            box = _wait(driver).until(
                ec.element_to_be_clickable(
                    (By.CSS_SELECTOR, f"input[type='checkbox'][value='0/{run_id}']")
                ),
                f"no checkbox for run {run_id} in the runs table",
            )
            box.click()
        driver.find_element(By.ID, "compare-button").click()
        _wait(driver).until(
            ec.text_to_be_present_in_element((By.TAG_NAME, "h1"), "Compare 2 runs"),
            "the compare view does not open",
        )
        _images_loaded(driver, COMPARE_PLOTS, "in the compare view")
        table = driver.find_element(By.CSS_SELECTOR, "table.config-differences")
        rows = [
            [td.text for td in tr.find_elements(By.XPATH, "./th|./td")]
            for tr in table.find_elements(By.TAG_NAME, "tr")
        ]
        # {key: {run: value}} (the runs' columns in the order the runs table listed them)
        differences = {r[0]: dict(zip(rows[0][1:], r[1:], strict=True)) for r in rows[1:]}
        driver.execute_script("window.scrollTo(0, 0)")
        driver.switch_to.default_content()
        _screenshot(driver, artifacts, "5-dashboard-compare")
        driver.switch_to.frame(frame)
        row = driver.find_element(By.LINK_TEXT, RUN_ID).find_element(By.XPATH, "./ancestor::tr")
        row.find_element(By.CSS_SELECTOR, "a.dag-run").click()  # target _top: leaves the iframe
    finally:
        driver.switch_to.default_content()
    quoted = urllib.parse.quote(dag_run_id, safe="")
    _wait(driver).until(
        lambda d: urllib.parse.urlparse(d.current_url).path == f"/dags/{DAG_ID}/runs/{quoted}",
        f"the dashboard's DAG run link does not open /dags/{DAG_ID}/runs/{quoted}",
    )
    _wait(driver).until(
        lambda d: d.find_elements(By.XPATH, "//table//a[normalize-space()='evaluate_base']"),
        "the DAG run page reached from the dashboard shows no task instances",
    )
    _screenshot(driver, artifacts, "6-dag-run-from-dashboard")
    return {"differences": differences, "url": driver.current_url}


# --------------------------------------------------------------------------- the test
def test_trigger_rlax_train_in_the_ui_and_see_its_plots(base_model, airflow, browser, artifacts):
    from selenium.webdriver.common.by import By

    model_path = base_model
    dag_run_id = None
    started = time.monotonic()
    try:
        seed_base_eval(airflow.run_root, model_path)
        dag_run_id = trigger_through_form(browser, airflow, artifacts, model_path)
        print(f"triggered {dag_run_id} after {time.monotonic() - started:.0f}s")
        conf = airflow.dag_run(dag_run_id)["conf"]
        assert conf["steps"] == STEPS and conf["run_id"] == RUN_ID, conf
        assert conf["preset"] == PRESET and conf["model_path"] == model_path, conf

        browser.get("about:blank")  # no page re-polling the API while the run takes the cores
        state = wait_for_run(airflow, dag_run_id)
        print(f"DAG run {state} after {time.monotonic() - started:.0f}s")
        quoted = urllib.parse.quote(dag_run_id, safe="")
        browser.get(f"{airflow.base_url}/dags/{DAG_ID}/runs/{quoted}")
        _wait(browser).until(
            lambda d: d.find_elements(By.XPATH, "//table//a[normalize-space()='record_state']"),
            "the DAG run page shows no task instances",
        )
        _screenshot(browser, artifacts, "2-dag-run")

        shown = open_dashboard_run(browser, airflow, artifacts)
        print(f"dashboard: {json.dumps(shown)}")
        assert state == "success", f"DAG run {dag_run_id} ended {state}"
        assert shown["state"] == "succeeded", shown
        # the plots drew the run's data, not "no data yet"
        series = airflow.get(f"/rlax/runs/0/{RUN_ID}/series")
        assert [p[0] for p in series["reward"]] == list(range(1, STEPS + 1)), series
        # held-out pass@k of the starting weights (from the run root's cache: evaluate_base
        # skipped, the scheduler went on to train) and of the final ones
        states = airflow.task_states(dag_run_id)
        assert states["evaluate_base"].startswith("skipped"), states
        assert states["record_base_eval"].startswith("success"), states
        pass_at_1 = series["pass_at"]["pass@1"]
        assert [p[0] for p in pass_at_1] == [0, STEPS] and pass_at_1[0][1] == 0.05, series
        assert "before (v0)" in shown["before_after"], shown
        assert f"after (v{STEPS})" in shown["before_after"], shown
        assert "pass@1 0.050" in shown["before_after"], shown

        write_other_run(airflow.run_root)
        compared = open_compare_view(browser, airflow, artifacts, dag_run_id)
        print(f"compare view: {json.dumps(compared)}")
        assert compared["differences"] == {
            "staleness.max_staleness": {RUN_ID: "1", OTHER_RUN_ID: "4"},
            "staleness.reload_every": {RUN_ID: "1", OTHER_RUN_ID: "2"},
        }, compared
    except Exception as e:
        try:
            _screenshot(browser, artifacts, "failure")
        except Exception:  # noqa: BLE001 - the browser may be what failed
            pass
        report = airflow.report(dag_run_id, RUN_ID)
        raise AssertionError(f"{type(e).__name__}: {e}\n\n{report}") from e
    finally:
        print(f"browser test took {time.monotonic() - started:.0f}s; screenshots in {artifacts}")
