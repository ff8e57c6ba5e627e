"""A part's checkpoint copy on the Hub (storage/hubresume.py), read back as untrusted input: whatever it says, a
rank resumes from it only when every shard it names is a file of the part that the Hub holds at the stated size and
hash, sizes are bounded and the settings are this extraction's; else one line that says to re-run with --overwrite."""

from __future__ import annotations

import json

import pytest

from lmprobe.errors import ResumeMismatchError
from lmprobe.storage.hubresume import MAX_RESUME_META_BYTES, check_resume

SETTINGS = {"layers": [1], "storage": "full_sequence", "batch_size": 1}
A, B = "a" * 64, "b" * 64


def _doc(**over):
    state = {"version": 1, "fingerprint": {"caller": SETTINGS}, "num_prompts": 5, "index_parts": 1,
             "statistics_file": None,
             "streams": {"last": {"shard": 1, "rows": 2, "prompts": 2,
                                  "closed": [{"num_prompts": 3, "num_tokens": 3,
                                              "files": {"1": {"bytes": 100, "staging": "last-1-000000.safetensors",
                                                              "sha256": A}}}]}}}
    doc = {"version": 1, "state": state, "files": {"tensors/layer_001_000000.safetensors": [100, A]},
           "statistics": None}
    doc.update(over)
    return doc


LISTING = {"tensors/layer_001_000000.safetensors": (100, A)}


def _check(doc, listing=LISTING, settings=SETTINGS):
    return check_resume(json.dumps(doc).encode(), listing, settings, "hf://datasets/u/r/.lmprobe-parts/part-00001")


def test_a_sound_copy_is_taken():
    assert _check(_doc())["state"]["num_prompts"] == 5


@pytest.mark.parametrize("files, listing, why", [
    ({"tensors/layer_001_000000.safetensors": [101, A]}, LISTING, "does not hold"),  # a wrong size
    ({"tensors/layer_001_000000.safetensors": [100, B]}, LISTING, "does not hold"),  # another file's hash
    ({"tensors/layer_001_000000.safetensors": [100, A]}, {}, "does not hold"),  # not on the Hub (not committed)
    ({"../part-00000/tensors/x.safetensors": [100, A]}, LISTING, "not a path inside the part"),
    ({"/etc/passwd": [100, A]}, LISTING, "not a path inside the part"),
    ({"index/train-00000-of-00001.parquet": [100, A]}, LISTING, "not a shard"),  # not under tensors/
    ({"tensors/layer_001_000000.safetensors": [10**15, A]}, {"tensors/layer_001_000000.safetensors": (10**15, A)},
     "not a shard"),  # a huge declared size
    ({"tensors/layer_001_000000.safetensors": [True, A]}, LISTING, "not a shard"),
    ({"tensors/layer_001_000000.safetensors": [100, "zz"]}, LISTING, "not a shard"),
])
def test_a_tampered_copy_is_refused_in_one_line(files, listing, why):
    with pytest.raises(ResumeMismatchError, match=why) as exc:
        _check(_doc(files=files), listing)
    assert "\n" not in str(exc.value) and "--overwrite" in str(exc.value)


def test_a_copy_whose_state_names_other_shards_than_it_lists_is_refused():
    doc = _doc()
    doc["state"]["streams"]["last"]["closed"][0]["files"]["1"]["sha256"] = B  # the writer would trust this one
    with pytest.raises(ResumeMismatchError, match="other shards than its writer state"):
        _check(doc)
    doc = _doc()
    doc["state"]["streams"]["last"]["closed"] = "x"
    with pytest.raises(ResumeMismatchError, match="damaged"):
        _check(doc)


def test_a_copy_of_other_settings_is_refused_before_anything_is_downloaded():
    with pytest.raises(ResumeMismatchError, match="other settings") as exc:
        _check(_doc(), settings={**SETTINGS, "layers": [2]})
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("raw", [b"{", b"[]", json.dumps({"version": 99}).encode(), b"\xff\xfe",
                                 json.dumps({"version": 1, "state": [], "files": {}, "statistics": None}).encode(),
                                 json.dumps(_doc(statistics=5)).encode()])
def test_a_copy_that_is_not_a_checkpoint_is_refused(raw):
    with pytest.raises(ResumeMismatchError):
        check_resume(raw, LISTING, SETTINGS, "part")


def test_a_huge_checkpoint_is_refused_before_it_is_parsed():
    with pytest.raises(ResumeMismatchError, match="more than"):
        check_resume(b" " * (MAX_RESUME_META_BYTES + 1), LISTING, SETTINGS, "part")


def test_statistics_the_state_does_not_name_are_refused():
    with pytest.raises(ResumeMismatchError, match="statistics"):
        _check(_doc(statistics="AAAA"))


def test_a_copy_whose_rows_are_not_its_states_is_refused(tmp_path):
    """The index rows come with the state in one file; a copy with fewer or more rows than its state counts
    would resume at the wrong prompt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmprobe.storage.hubresume import seed_staging

    copy = tmp_path / "checkpoint.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), copy)
    with pytest.raises(ResumeMismatchError, match="2 index rows, its state 5"):
        seed_staging(tmp_path / "staging", _check(_doc()), copy)
    assert not (tmp_path / "staging" / "state.json").exists()  # nothing a later run would resume from


GOOD_REPLAY = {"prompts": 3, "tokens": 30, "progress": {"document": 2, "window": 1}}


def _with_position(progress=None, replay=GOOD_REPLAY):
    doc = _doc()
    doc["state"].update(num_tokens=50, progress={"document": 4, "window": 0} if progress is None else progress,
                        replay=replay)
    return doc


def test_a_corpus_copys_source_position_is_taken():
    state = _check(_with_position())["state"]
    assert state["replay"] == GOOD_REPLAY and state["progress"] == {"document": 4, "window": 0}


@pytest.mark.parametrize("progress, replay", [
    ({"document": -1}, GOOD_REPLAY),  # a negative position
    ({"document": 10**30}, GOOD_REPLAY),  # a huge one
    ({"document": "4"}, GOOD_REPLAY),  # a string
    ({"document": True}, GOOD_REPLAY),
    ([4, 0], GOOD_REPLAY),  # not a mapping
    (None, {**GOOD_REPLAY, "prompts": -1}),
    (None, {**GOOD_REPLAY, "prompts": 6}),  # past the checkpoint's 5 rows
    (None, {**GOOD_REPLAY, "tokens": 51}),  # past its 50 tokens
    (None, {**GOOD_REPLAY, "tokens": 10**30}),
    (None, {**GOOD_REPLAY, "tokens": 3.5}),
    (None, {**GOOD_REPLAY, "progress": {"document": -2}}),
    (None, {**GOOD_REPLAY, "progress": {"window": 2**60}}),
    (None, {**GOOD_REPLAY, "progress": "document 2"}),
    (None, {"prompts": 3, "tokens": 30}),  # no progress key
    (None, {**GOOD_REPLAY, "extra": 1}),
    (None, [3, 30, None]),
])
def test_a_tampered_source_position_is_refused_in_one_line(progress, replay):
    """A corpus is replayed from the copy's source position: a position that is not a count within the
    checkpoint's own is refused, never followed."""
    with pytest.raises(ResumeMismatchError, match="source position") as exc:
        _check(_with_position(progress, replay))
    assert "\n" not in str(exc.value) and "--overwrite" in str(exc.value)
