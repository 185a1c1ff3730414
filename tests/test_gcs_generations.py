"""The GCS emulator answers generation preconditions as GCS does (``tests.gcs_generations``):
what TensorStore's OCDBT commits under Orbax's checkpoints rely on, through TensorStore itself."""

from __future__ import annotations

import pytest
import tensorstore as ts

from rlax_tasks.rundir import storage
from tests.paramserver.helpers import gcs_emulator


@pytest.fixture(scope="module")
def kvstore():
    with gcs_emulator("generations-test"):
        storage.configure_gcs_clients()  # TensorStore's GCS endpoint: the emulator
        yield ts.KvStore.open({"driver": "gcs", "bucket": "generations-test"}).result()


def test_a_read_names_the_generation_its_write_returned(kvstore):
    written = kvstore.write("a", b"one").result()
    read = kvstore.read("a").result()
    assert (read.state, read.value) == ("value", b"one")
    assert read.stamp.generation == written.generation


def test_a_read_if_changed_of_an_unchanged_object_is_not_modified(kvstore):
    # the conditional re-read of an OCDBT manifest: 304, not the same bytes with no generation
    written = kvstore.write("b", b"one").result()
    again = kvstore.read("b", if_not_equal=written.generation).result()
    assert again.state == "unspecified" and again.stamp.generation == written.generation
    rewritten = kvstore.write("b", b"two").result()
    changed = kvstore.read("b", if_not_equal=written.generation).result()
    assert (changed.state, changed.value) == ("value", b"two")
    assert changed.stamp.generation == rewritten.generation


def test_a_conditional_write_fails_when_the_object_moved_on(kvstore):
    absent = kvstore.read("c").result()
    assert absent.state == "missing"
    created = kvstore.write("c", b"first", if_equal=absent.stamp.generation).result()
    assert created.generation  # an empty generation is TensorStore's "condition failed"
    assert not kvstore.write("c", b"second", if_equal=absent.stamp.generation).result().generation
    updated = kvstore.write("c", b"third", if_equal=created.generation).result()
    assert updated.generation
    assert not kvstore.write("c", b"fourth", if_equal=created.generation).result().generation
    assert kvstore.read("c").result().value == b"third"
