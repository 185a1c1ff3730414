"""ProgressMeter: rate, ETA, unknown totals and throttling, driven by a fake clock."""

from __future__ import annotations

import logging
import threading

import pytest

from rlax_tasks.utils.progress_meter import (
    EVERY_ENV,
    ProgressMeter,
    default_every_s,
    format_duration,
    format_si,
)

LOG = logging.getLogger("tests.progress")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


@pytest.fixture(autouse=True)
def _info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)


def test_rate_eta_and_final_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    meter = ProgressMeter("eval base", 200, logger=LOG, unit="prompts", every_s=5, clock=clock)
    clock.now += 40
    assert meter.update(120, reward=0.25)  # 3/s: 80 left take 26.7 s
    assert lines(caplog) == ["eval base: 120/200 prompts (60%) 3.0/s eta 27s reward 0.25"]
    clock.now += 20
    meter.update(80, reward=0.5)
    meter.finish()
    meter.finish()  # once only
    assert lines(caplog)[1:] == [
        "eval base: 200/200 prompts (100%) 3.3/s eta 0s reward 0.5",
        "eval base: 200/200 prompts done in 1m00s (3.3/s) reward 0.5",
    ]


def test_lines_are_throttled_to_one_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    meter = ProgressMeter("steps", 100, logger=LOG, every_s=10, clock=clock)
    logged = []
    for _ in range(35):  # one update a second for 35 s
        clock.now += 1
        logged.append(meter.update())
    assert [i + 1 for i, x in enumerate(logged) if x] == [10, 20, 30]
    assert [line.split(" (")[0] for line in lines(caplog)] == [
        "steps: 10/100",
        "steps: 20/100",
        "steps: 30/100",
    ]
    meter.finish()
    assert lines(caplog)[-1] == "steps: 35/100 done in 35s (1.0/s)"


def test_zero_interval_logs_every_update(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    meter = ProgressMeter("w", 3, logger=LOG, every_s=0, clock=clock)
    for _ in range(3):
        clock.now += 1
        meter.update()
    assert len(lines(caplog)) == 3


def test_unknown_total_shows_count_rate_and_elapsed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    meter = ProgressMeter("rows read", None, logger=LOG, unit="rows", every_s=0, clock=clock)
    clock.now += 125
    meter.update(500)
    meter.finish()
    assert lines(caplog) == [
        "rows read: 500 rows 4.0/s 2m05s elapsed",
        "rows read: 500 rows done in 2m05s (4.0/s)",
    ]


def test_no_progress_yet_has_no_eta(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    ProgressMeter("w", 10, logger=LOG, every_s=0, clock=clock).update(0)
    assert lines(caplog) == ["w: 0/10 (0%) 0.00/s eta ?"]


def test_custom_count_format_and_note(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    meter = ProgressMeter("load", 7.6e9, logger=LOG, unit="params", every_s=0,
                          format_count=format_si, clock=clock)  # fmt: skip
    clock.now += 4
    meter.update(1.2e9)
    meter.finish("-> /models/x")
    assert lines(caplog) == [
        "load: 1.2G/7.6G params (16%) 300M/s eta 21s",
        "load: 1.2G/7.6G params done in 4s (300M/s) -> /models/x",
    ]


def test_track_counts_every_item_in_chunks(caplog: pytest.LogCaptureFixture) -> None:
    meter = ProgressMeter("rows", 1000, logger=LOG, every_s=0, clock=Clock())
    assert sum(meter.track(range(1000), chunk=300)) == sum(range(1000))
    assert meter.done == 1000
    assert len(lines(caplog)) == 4  # 300, 600, 900, 1000


def test_an_error_logs_where_it_stopped(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    with pytest.raises(KeyError), ProgressMeter("w", 10, logger=LOG, clock=clock) as meter:
        meter.update(3)
        clock.now += 7
        raise KeyError("x")
    assert lines(caplog) == ["w: stopped at 3/10 after 7s (KeyError)"]


def test_updates_from_threads_all_count() -> None:
    meter = ProgressMeter("bytes", None, logger=LOG, every_s=3600)
    threads = [
        threading.Thread(target=lambda: [meter.update(2) for _ in range(2000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.done == 16000


def test_default_interval_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(EVERY_ENV, "0")
    assert ProgressMeter("w", 1, logger=LOG).every_s == 0
    monkeypatch.setenv(EVERY_ENV, "soon")
    assert default_every_s() == 5.0
    assert "RLAX_PROGRESS_EVERY_S='soon'" in caplog.text
    monkeypatch.delenv(EVERY_ENV)
    assert default_every_s() == 5.0


def test_formats() -> None:
    assert [format_duration(s) for s in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    assert [format_si(n) for n in (950, 12_345, 7.62e9)] == ["950", "12.3k", "7.62G"]
