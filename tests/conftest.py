"""Test session set-up, before any test module imports jax or airflow: 8 host CPU devices for the
sharding tests, a compilation cache for the processes the tests start, and Airflow in a
temporary AIRFLOW_HOME (SQLite) with the repository's dags/ and plugins/ (Airflow fixes its home
and DAG folder when first imported, whichever test does it)."""

import atexit
import os
import shutil
import sys
import tempfile

# XLA's backend (LLVM) optimisation off for the tests' programs and the processes they start, and
# its CPU fusions emitted the classic way rather than through MLIR: the tests' tiny models compile
# in less than half the time and run as fast as they need to (no fast-math either way).
# Benchmarks and users keep XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one JAX compilation cache, empty at the session's start, for the processes the tests start:
# the end-to-end tests' jobs compile the same tiny programs again and again (as a run's restarted
# components do from the run's own cache, which tests/run/test_compilation_cache checks without
# this variable). Not for this process: its tests compile many programs once each, and writing
# them all cost more than the repeats saved.
# pytest-xdist's workers inherit these variables from the session's first process, which made
# the directories (RLAX_TEST_* mark them as the suite's own: shared, or one per worker).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlax-test-jax-cache-")
    os.environ["RLAX_TEST_JAX_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
if os.environ["JAX_COMPILATION_CACHE_DIR"] == os.environ.get("RLAX_TEST_JAX_CACHE"):
    import jax  # (reads the variables above as its defaults)

    jax.config.update("jax_compilation_cache_dir", None)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAGS = os.path.join(REPO, "dags")
PLUGINS = os.path.join(REPO, "plugins")
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlax-airflow-home-")
    os.environ["RLAX_TEST_AIRFLOW_HOME"] = os.environ["AIRFLOW_HOME"]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ["AIRFLOW_HOME"] == os.environ.get("RLAX_TEST_AIRFLOW_HOME"):
    # one Airflow home (SQLite metadata database) per worker: their dag.test() runs reset it
    os.environ["AIRFLOW_HOME"] = os.path.join(os.environ["AIRFLOW_HOME"], _WORKER)
    os.makedirs(os.environ["AIRFLOW_HOME"], exist_ok=True)
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", DAGS)
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", PLUGINS)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
if PLUGINS not in sys.path:  # as Airflow puts it on sys.path (the DAG files need nothing added)
    sys.path.append(PLUGINS)

import logging  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _jax_backend_started_with_the_forced_devices():
    """JAX fixes its CPU device count when its backend starts: start it now, with the 8 forced
    devices above, before a test that sets XLA_FLAGS for its subprocesses (monkeypatch) builds a
    model in this process and starts it with one. (`rlax run` no longer starts a backend in the
    tests' process, so nothing else starts it first.)"""
    import jax

    jax.devices()


@pytest.fixture(autouse=True)
def _drop_cli_log_handlers():
    """`rlax` commands called in-process install a root handler on the stream pytest captures for
    that test and closes after it; drop it so later tests do not log to a closed file."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """Airflow's in-process task runner (`dag.test()`) installs a SIGTERM handler that calls the
    finished task's `on_kill` and never removes it; put every handler back after each test."""
    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {s: signal.getsignal(s) for s in signums}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny Qwen2 chat checkpoint (BOS-adding tokenizer, template in tokenizer_config.json,
    two EOS ids in generation_config.json); see tests/data/chat_model.py."""
    from tests.data.chat_model import build_chat_model

    return build_chat_model(str(tmp_path_factory.mktemp("chat-model")))


@pytest.fixture
def tiny_config():
    """The tests' tiny model (``tests.tiny_model.tiny_model_config()``); other shapes: call
    ``tiny_model_config(shape, **overrides)``."""
    from tests.tiny_model import tiny_model_config

    return tiny_model_config()


@pytest.fixture(scope="module")
def gcs_bucket(request):
    """``gs://<bucket>`` on an in-process GCS emulator (STORAGE_EMULATOR_HOST set), one per test
    module, the bucket named after the module."""
    from tests.paramserver.helpers import gcs_emulator

    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    with gcs_emulator(name) as root:
        yield root


# --------------------------------------------------------------------------- CI: no skips
# CI installs everything the suite needs (scripts/setup.sh --test): under CI=true a skip is a
# missing dependency, so a skipped test fails, and a skipped module fails the session, each
# named with its reason.
_skipped_modules: list[str] = []


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    if os.environ.get("CI", "").lower() != "true" or not report.skipped:
        return None
    if hasattr(report, "wasxfail"):  # an expected failure is reported as skipped too
        return None
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201 (pytest's hook signature)
    report = yield
    if item.get_closest_marker("accelerator") is not None:
        return report  # a CPU host's skip by design (scripts/device_check.sh's CPU form)
    if (reason := _skip_reason(report)) is not None:
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} was skipped under CI=true: {reason}"
    return report


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if (reason := _skip_reason(report)) is not None:
        _skipped_modules.append(f"{report.nodeid} was skipped under CI=true: {reason}")


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    for line in _skipped_modules:
        terminalreporter.write_line(f"FAILED {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --------------------------------------------------------------------------- order
ROOT = os.path.dirname(os.path.abspath(__file__))
# the files that take longest in CI (pytest --durations), started first of all: a long file
# scheduled last would run alone at the end
LONGEST_FILES = (
    "dags/test_browser.py",
    "dags/test_train_dag_cloud_tpu.py",
    "test_docs_commands.py",
    "run/test_local_run.py",
    "trainer/test_master_weights.py",
    "rollout/test_sampler.py",
    "dags/test_standalone_faults.py",
    "test_device_check.py",
    "run/test_multihost_run.py",
    "airflow_ops/test_airflow_train_cli.py",
    "trainer/test_multihost.py",
    "models/test_gguf_import.py",
    "compute/test_ray_cluster.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first, then those holding a `slow` test (stable otherwise): with
    the suite spread over workers (`-n 2 --dist loadfile --no-loadscope-reorder`, which keeps
    this order), the long files start early and the fast ones fill in around them instead of
    one long file running alone at the end. On the CPU (JAX_PLATFORMS=cpu, the suite's default)
    the tests marked `accelerator` are deselected: they need a GPU or TPU
    (scripts/device_check.sh runs them, JAX picking the platform)."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        accelerator = [item for item in items if item.get_closest_marker("accelerator")]
        if accelerator:
            config.hook.pytest_deselected(items=accelerator)
            items[:] = [item for item in items if not item.get_closest_marker("accelerator")]
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    longest = {os.path.join(ROOT, name): rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (longest.get(str(item.path), 99), item.path not in slow_files))
