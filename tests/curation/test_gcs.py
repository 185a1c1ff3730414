"""`rlax curate` reading inputs from and writing outputs to gs:// (local GCS emulator)."""

import json

from rlax_tasks.cli import main
from rlax_tasks.rundir import storage
from tests.evaluation.helpers import arithmetic_rows
from tests.paramserver.helpers import gcs_emulator


def test_curate_from_and_to_gcs(capsys):
    with gcs_emulator("curation-test") as bucket:
        rows = arithmetic_rows(6)
        lines = "".join(json.dumps(r) + "\n" for r in rows) + "{not json\n"
        storage.write_bytes(f"{bucket}/data/a.jsonl", lines.encode())
        storage.write_bytes(
            f"{bucket}/data/b.csv",
            b"prompt,answer,source,date\nWhat is 6*7?,42,csv,2024-02-02\n",
        )
        storage.write_bytes(f"{bucket}/data/notes.txt", b"ignored: not an input format")
        out = f"{bucket}/curated"
        code = main(["curate", f"{bucket}/data/", "--out", out, "--split-date", "2024-04-01"])
        assert code == 0, capsys.readouterr().err
        report = json.loads(storage.read_bytes(f"{out}/report.json"))
        assert report["totals"]["rows_read"] == 8
        assert report["totals"]["quarantined"] == 1
        assert report["files"] == [f"{bucket}/data/a.jsonl", f"{bucket}/data/b.csv"]
        names = storage.list_children(out)
        assert {"train.parquet", "test.parquet", "quarantine.jsonl", "report.md"} <= set(names)
        quarantine = storage.read_bytes(f"{out}/quarantine.jsonl").decode().splitlines()
        assert json.loads(quarantine[0])["row"] == 7
