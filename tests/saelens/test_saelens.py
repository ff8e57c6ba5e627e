"""SAELens' activation cache both ways: export-saelens and import-saelens (docs/saelens.md).

The slow tests run the real SAELens (sae-lens 6.54.12, datasets 5.2.0) in the interop venv
(tests/reference/envs.py) through tests/reference/saelens_cache.py: its LanguageModelSAETrainingRunner
trains from an export, and its CacheActivationsRunner writes a cache from a tiny TransformerLens
model with random weights that lmprobe then imports. HF_HOME is a temporary folder and the Hub
is offline there: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from reference.envs import interop_python
from support.artefacts import read_cache
from support.datasets import write_dataset
from support.paths import REFERENCE

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import DatasetNotFoundError, SaelensError
from lmprobe.saelens import TL_HOOKS, export_saelens, import_saelens, parse_tl_hook, tl_hook_name
from lmprobe.stream import ShardStream

REF = REFERENCE
CTX, DIM = 8, 16


@pytest.fixture
def source(tmp_path, rng):
    """A full_sequence dataset of 8-token windows (two layers), with token ids."""
    src = write_dataset(tmp_path / "ds", rng, n=12, layers=(0, 1), dim=DIM, storage="full_sequence", shard_size="4KB",
                        min_tokens=CTX, max_tokens=CTX, token_ids=True)
    return tmp_path / "ds", src


def windows(src, layer: int) -> np.ndarray:
    return src["hidden"][layer].reshape(-1, CTX, DIM)


def test_hook_names_round_trip():
    for hp in TL_HOOKS:
        assert parse_tl_hook(tl_hook_name(hp, 7)) == (7, hp)
    assert tl_hook_name("resid_post", 6) == "blocks.6.hook_resid_post"
    with pytest.raises(SaelensError, match="no TransformerLens hook"):
        tl_hook_name("mlp.act_fn:output", 1)
    with pytest.raises(SaelensError, match="not a TransformerLens hook"):
        parse_tl_hook("hook_embed")


def test_export_writes_the_datasets_layout_row_by_row(tmp_path, source):
    path, src = source
    out = export_saelens(path, tmp_path / "cache", layer=1, shard_bytes=3 * (CTX * DIM * 4 + CTX * 4), quiet=True)
    state, batches = read_cache(out)
    assert [f["filename"] for f in state["_data_files"]] == [f"data-{i:05d}-of-00004.arrow" for i in range(4)]
    info = json.loads((out / "dataset_info.json").read_text())
    assert info["features"] == {"blocks.1.hook_resid_post": {"shape": [CTX, DIM], "dtype": "float32", "_type": "Array2D"},
                                "token_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "length": CTX,
                                              "_type": "List"}}
    table = pa.Table.from_batches(batches)
    assert table.num_rows == 12
    acts = np.array(table.column("blocks.1.hook_resid_post").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(acts, windows(src, 1))  # row order kept
    assert table.column("token_ids").to_pylist() == [list(range(CTX))] * 12
    field = table.schema.field("blocks.1.hook_resid_post")
    # pyarrow reads it as datasets' extension type once `datasets` (which registers it) is imported here
    name = getattr(field.type, "extension_name", None) or field.metadata[b"ARROW:extension:name"].decode()
    assert name == "datasets.features.features.Array2DExtensionType"
    # the way back gives the same dataset
    back = lmprobe.load(import_saelens(out, tmp_path / "back", quiet=True))
    assert back.layers == [1] and back.hookpoints == ["resid_post"] and back.num_prompts == 12
    np.testing.assert_array_equal(np.stack([back.token_hidden(i, 1) for i in range(12)]), windows(src, 1))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_sources_round_trip_in_small_batches(tmp_path, rng, monkeypatch, dtype):
    """Values equal lmprobe's reader (as float32), with batches far smaller than a data file."""
    from lmprobe.saelens import layout

    monkeypatch.setattr(layout, "BATCH_BYTES", 3 * 4 * 4 * 4)  # three rows of (4 tokens, 4 dims) at a time
    write_dataset(tmp_path / "ds", rng, n=10, layers=(2,), dim=4, storage="full_sequence", dtype=dtype, min_tokens=4,
                  max_tokens=4)
    ds = lmprobe.load(tmp_path / "ds")
    want = np.stack([np.asarray(ds.token_hidden(i, 2), dtype=np.float32) for i in range(10)])
    cache = export_saelens(ds, tmp_path / "cache", hookpoint="resid_post", quiet=True)
    _, batches = read_cache(cache)
    assert [len(b) for b in batches] == [3, 3, 3, 1] and "token_ids" not in batches[0].schema.names
    back = lmprobe.load(import_saelens(cache, tmp_path / "back", quiet=True))
    assert back.dtype == "float32" and "token_ids" not in back.column_names
    np.testing.assert_array_equal(np.stack([back.token_hidden(i, 2) for i in range(10)]), want)


def test_exact_windows_take_the_prompts_of_one_length_and_say_what_they_left_out(tmp_path, rng, capsys, messages):
    write_dataset(tmp_path / "ds", rng, n=10, layers=(3,), dim=4, storage="full_sequence", min_tokens=2,
                  max_tokens=6, token_ids=True)
    ds = lmprobe.load(tmp_path / "ds")
    lengths = ds.token_lengths()
    out = export_saelens(tmp_path / "ds", tmp_path / "c", hookpoint="resid_post", windows="exact")
    kept = np.flatnonzero(lengths == lengths.max())
    _, batches = read_cache(out)
    acts = np.array(pa.Table.from_batches(batches).column(0).to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(acts, np.stack([ds.token_hidden(int(i), 3) for i in kept]))
    err = capsys.readouterr().err
    assert f"{len(lengths) - len(kept)} prompt(s) of another length left out" in err
    assert f"context_size={int(lengths.max())}" in err


def test_export_refuses_what_saelens_cannot_hold_in_one_line(tmp_path, rng, source, capsys):
    path, _ = source
    write_dataset(tmp_path / "pooled", rng, n=4, layers=(0,), dim=4)
    cases = [
        (["export-saelens", str(tmp_path / "pooled"), "--out", str(tmp_path / "a")], "pooled"),
        (["export-saelens", str(path), "--out", str(tmp_path / "b")], "pass --layer"),
        (["export-saelens", str(path), "--out", str(tmp_path / "c"), "--layer", "5"], "layer 5 is not in"),
        (["export-saelens", str(path), "--out", str(tmp_path / "d"), "--layer", "1", "--context-len", "3",
          "--windows", "exact"], "exactly 3 tokens"),
        (["export-saelens", str(path), "--out", str(tmp_path / "e"), "--layer", "1", "--context-len", "1000"],
         "fewer than one window of 1000"),
    ]
    for argv, message in cases:
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
        assert not Path(argv[3]).exists()


def test_a_cache_folder_is_not_opened_as_a_dataset(tmp_path, source):
    path, _ = source
    out = export_saelens(path, tmp_path / "cache", layer=0, quiet=True)
    with pytest.raises(DatasetNotFoundError, match="import-saelens"):
        lmprobe.load(out)


def test_import_refuses_unsafe_or_broken_caches(tmp_path, source, capsys):
    path, _ = source
    good = export_saelens(path, tmp_path / "cache", layer=0, quiet=True)
    state = json.loads((good / "state.json").read_text())

    def broken(name: str, state_patch=None, info_patch=None, data_bytes=None) -> Path:
        import shutil

        d = tmp_path / name
        shutil.copytree(good, d)
        if state_patch:
            (d / "state.json").write_text(json.dumps({**state, **state_patch}))
        if info_patch:
            info = json.loads((d / "dataset_info.json").read_text())
            info["features"].update(info_patch)
            (d / "dataset_info.json").write_text(json.dumps(info))
        if data_bytes is not None:
            (d / state["_data_files"][0]["filename"]).write_bytes(data_bytes)
        return d

    (tmp_path / "outside.arrow").write_bytes(b"x")
    cases = [
        (broken("escape", {"_data_files": [{"filename": "../outside.arrow"}]}), "plain file names"),
        (broken("missing", {"_data_files": [{"filename": "data-9.arrow"}]}), "missing"),
        (broken("two", info_patch={"blocks.0.hook_mlp_out": {"shape": [CTX, DIM], "dtype": "float32",
                                                             "_type": "Array2D"}}), "one Array2D"),
        (broken("shape", info_patch={"blocks.0.hook_resid_post": {"shape": [CTX, DIM + 1], "dtype": "float32",
                                                                  "_type": "Array2D"}}), "not all 17 long"),
        (broken("garbage", data_bytes=b"\x1b[31mnot arrow"), "cannot be read as Arrow data"),
    ]
    for folder, message in cases:
        out = tmp_path / f"out-{folder.name}"
        assert cli_main(["import-saelens", str(folder), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "\x1b" not in err, err
        # found in the description or a file's schema before anything is written, or in the data (a wrong
        # shape), when what was written is removed: nothing is left either way
        assert not out.exists()


def test_an_imported_cache_pushes_and_streams_like_any_dataset(tmp_path, source, hub, fresh_hf_cache):
    import uuid

    path, src = source
    out = import_saelens(export_saelens(path, tmp_path / "cache", layer=1, quiet=True), tmp_path / "ds2",
                         model_name="test/model", quiet=True)
    assert lmprobe.validate(out).ok
    got = np.concatenate([np.asarray(b) for b in ShardStream(lmprobe.load(out), 1, 10, shuffle=False)])
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][1], axis=0))  # every vector once
    page = lmprobe.report(out, tmp_path / "report", probe=False, quiet=True)
    assert page.name == "index.html" and "test/model" in page.read_text()
    repo = f"tester/imported-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(out, repo, quiet=True)
    remote = lmprobe.load(repo)
    np.testing.assert_array_equal(remote.token_hidden(11, 1), windows(src, 1)[11])
    assert remote.model["name"] == "test/model"


# ---------------------------------------------------------------------------------------------- real SAELens


def run_saelens(*args: str | Path, tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    r = subprocess.run([str(interop_python()), "-I", str(REF / "saelens_cache.py"), *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def saelens_cache(tmp_path_factory) -> Path:
    """A cache written by SAELens' CacheActivationsRunner from a tiny random TransformerLens model."""
    out = tmp_path_factory.mktemp("saelens")
    run_saelens("write", out, tmp=out)
    return out


@pytest.mark.slow
def test_saelens_trains_from_an_export(tmp_path, source):
    path, src = source
    out = export_saelens(path, tmp_path / "cache", layer=1, quiet=True)
    run_saelens("train", out, "blocks.1.hook_resid_post", CTX, DIM, tmp_path, tmp=tmp_path)
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert trained == {"steps": 5, "W_dec_finite": True, "d_in": DIM, "sae_dir": str(tmp_path / "sae")}
    assert (tmp_path / "sae" / "sae_weights.safetensors").is_file()
    with np.load(tmp_path / "read.npz", allow_pickle=False) as z:
        np.testing.assert_array_equal(z["acts"], windows(src, 1))  # as datasets.load_from_disk reads it
        np.testing.assert_array_equal(z["token_ids"], np.tile(np.arange(CTX), (12, 1)))
        np.testing.assert_array_equal(z["store_first"], windows(src, 1)[:2].reshape(-1, DIM))  # what training reads


@pytest.mark.slow
def test_import_a_cache_saelens_wrote(tmp_path, saelens_cache):
    cache = saelens_cache / "cache"
    assert list(cache.glob("cache-*.arrow"))  # the runner's shuffle indices, which state.json does not list
    ds = lmprobe.load(import_saelens(cache, tmp_path / "ds", quiet=True))
    with np.load(saelens_cache / "expected.npz", allow_pickle=False) as z:
        expected = {k: z[k] for k in z.files}
    assert ds.layers == [1] and ds.hookpoints == ["resid_post"] and ds.num_prompts == len(expected["acts"]) == 24
    np.testing.assert_array_equal(np.stack([ds.token_hidden(i, 1) for i in range(ds.num_prompts)]), expected["acts"])
    assert ds.token_columns(["token_ids"])["token_ids"].to_pylist() == expected["token_ids"].tolist()
    # the cache holds TransformerLens' blocks.1.hook_resid_post of those tokens
    np.testing.assert_allclose(ds.token_hidden(0, 1), expected["recomputed"], rtol=0, atol=1e-6)
    assert lmprobe.validate(tmp_path / "ds").ok


@pytest.mark.slow
def test_import_a_cache_pushed_to_the_hub(tmp_path, saelens_cache, hub, fresh_hf_cache):
    """What CacheActivationsRunner's push_to_hub uploads: Parquet under data/ and its config."""
    import uuid

    from huggingface_hub import HfApi

    repo = f"tester/saelens-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    api.upload_folder(repo_id=repo, repo_type="dataset", folder_path=str(saelens_cache / "hub"))
    assert cli_main(["import-saelens", repo, "--out", str(tmp_path / "ds"), "--quiet"]) == 0
    ds = lmprobe.load(tmp_path / "ds")
    with np.load(saelens_cache / "expected.npz", allow_pickle=False) as z:
        hub_acts = z["hub_acts"]
    np.testing.assert_array_equal(np.stack([ds.token_hidden(i, 1) for i in range(ds.num_prompts)]), hub_acts)
    assert ds.model["name"] == "tiny"  # from cache_activations_runner_cfg.json


def test_import_a_cache_folder_uploaded_to_the_hub_as_it_is(tmp_path, source, hub, fresh_hf_cache):
    """A save_to_disk folder uploaded whole (state.json, dataset_info.json, Arrow files) reads like the folder."""
    import uuid

    from huggingface_hub import HfApi

    path, src = source
    cache = export_saelens(path, tmp_path / "cache", layer=0, shard_bytes=5 * (CTX * DIM * 4 + CTX * 4), quiet=True)
    repo = f"tester/cache-{uuid.uuid4().hex[:8]}"
    HfApi().create_repo(repo, repo_type="dataset")
    HfApi().upload_folder(repo_id=repo, repo_type="dataset", folder_path=str(cache))
    ds = lmprobe.load(import_saelens(repo, tmp_path / "imported", model_name="test/model", quiet=True))
    np.testing.assert_array_equal(np.stack([ds.token_hidden(i, 0) for i in range(12)]), windows(src, 0))


# ---------------------------------------------------------------------------------------------- hostile caches


def hand_cache(folder: Path, columns: dict[str, pa.Array], features: dict | None = None) -> Path:
    """A cache folder written by hand: one Arrow stream of ``columns``, described by ``features`` (default: the
    activation column declared Array2D (CTX, DIM) float32, token_ids int32 of CTX)."""
    folder.mkdir(parents=True)
    hook = "blocks.0.hook_resid_post"
    if features is None:
        features = {hook: {"shape": [CTX, DIM], "dtype": "float32", "_type": "Array2D"}}
        if "token_ids" in columns:
            features["token_ids"] = {"feature": {"dtype": "int32", "_type": "Value"}, "length": CTX, "_type": "List"}
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return folder


def nested(values: np.ndarray, type_: pa.DataType | None = None) -> pa.Array:
    """(rows, CTX, DIM) values as list<list<T>>, as datasets writes an Array2D column."""
    rows = len(values)
    inner = pa.ListArray.from_arrays(pa.array(np.arange(rows * CTX + 1, dtype=np.int32) * DIM),
                                     pa.array(values.reshape(-1), type=type_))
    return pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * CTX), inner)


def tokens(values, type_: pa.DataType) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(values).reshape(-1), type=type_), CTX)


def test_import_checks_the_arrow_data_against_its_description(tmp_path, source, capsys):
    """Offsets outside their buffer read process memory (or abort); types that contradict dataset_info.json were
    cast silently (2^40+1 lost its +1, 1e300 became inf, NaN token ids -2^63, 1.7 became 1); text gave
    tracebacks."""
    import subprocess
    import sys

    path, _ = source
    good = export_saelens(path, tmp_path / "good", layer=0, quiet=True)
    acts = np.ones((3, CTX, DIM), np.float32)
    ids = np.tile(np.arange(CTX), (3, 1))
    big = np.full((3, CTX, DIM), 2**40 + 1, np.int64)
    hook = "blocks.0.hook_resid_post"
    f64 = {hook: {"shape": [CTX, DIM], "dtype": "float64", "_type": "Array2D"}}
    cases = {
        "int activations": ({hook: nested(big)}, None, "float32"),
        "float64 as float32": ({hook: nested(np.full((3, CTX, DIM), 1e300))}, None, "float32"),
        "declared float64, beyond float32": ({hook: nested(np.full((3, CTX, DIM), 1e300))}, f64, "not finite"),
        "NaN activations": ({hook: nested(np.where(np.eye(CTX, DIM) > 0, np.nan, acts).astype(np.float32))}, None,
                            "not finite"),
        "NaN token ids": ({hook: nested(acts), "token_ids": tokens(np.where(ids == 3, np.nan, ids), pa.float64())},
                          None, "int32"),
        "fractional token ids": ({hook: nested(acts), "token_ids": tokens(ids + 0.7, pa.float64())}, None, "int32"),
        "text activations": ({hook: nested(np.full((3, CTX, DIM), "x"), pa.string())}, None, "float32"),
        "text token ids": ({hook: nested(acts), "token_ids": tokens(ids.astype(str), pa.string())}, None, "int32"),
    }
    for name, (columns, features, message) in cases.items():
        folder = hand_cache(tmp_path / name.replace(" ", "-"), columns, features)
        out = tmp_path / f"out-{folder.name}"
        assert cli_main(["import-saelens", str(folder), "--out", str(out), "--quiet"]) == 2, name
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, (name, err)
        assert not out.exists(), name  # refused before anything was written, or what was written removed
    # list offsets moved outside the values buffer (each list still CTX x DIM long): full validation refuses them
    bad = tmp_path / "offsets"
    import shutil

    shutil.copytree(good, bad)
    data = bad / "data-00000-of-00001.arrow"
    raw = data.read_bytes()
    offsets = (np.arange(12 * CTX + 1, dtype=np.int32) * DIM).astype("<i4").tobytes()
    assert raw.count(offsets) == 1
    data.write_bytes(raw.replace(offsets, (np.arange(12 * CTX + 1, dtype=np.int32) * DIM + 10**6).astype("<i4")
                                 .tobytes()))
    r = subprocess.run([sys.executable, "-m", "lmprobe", "import-saelens", str(bad), "--out", str(tmp_path / "o"),
                        "--quiet"], capture_output=True, text=True, timeout=120)  # a process of its own: it may abort
    assert r.returncode == 2 and "out of bounds" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()


def test_an_interrupted_import_resumes_with_the_same_command(tmp_path, source, monkeypatch, capsys):
    """import-saelens interrupted, then the same command: refused with "resume it, or pass --overwrite", an option
    it did not have."""
    from lmprobe.format.writer import DatasetWriter
    from lmprobe.saelens import layout

    path, src = source
    cache = export_saelens(path, tmp_path / "cache", layer=1, quiet=True)
    monkeypatch.setattr(layout, "BATCH_BYTES", 2 * CTX * DIM * 4)  # two rows a batch
    real = DatasetWriter.add_batch
    calls = []

    def dying(self, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, **kw)

    monkeypatch.setattr(DatasetWriter, "add_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        import_saelens(cache, tmp_path / "imported", quiet=True, checkpoint_interval=0)
    monkeypatch.setattr(DatasetWriter, "add_batch", real)
    assert (tmp_path / "imported").exists() and not (tmp_path / "imported/index").exists()
    assert cli_main(["import-saelens", str(cache), "--out", str(tmp_path / "imported"), "--quiet"]) == 0
    ds = lmprobe.load(tmp_path / "imported")
    np.testing.assert_array_equal(np.stack([ds.token_hidden(i, 1) for i in range(12)]), windows(src, 1))
    assert lmprobe.validate(tmp_path / "imported").ok
    # the same command after it finished has nothing to do; another import is not put over it by accident
    capsys.readouterr()
    assert cli_main(["import-saelens", str(cache), "--out", str(tmp_path / "imported")]) == 0
    assert "already holds this import" in capsys.readouterr().err
    argv = ["import-saelens", str(cache), "--out", str(tmp_path / "imported"), "--quiet", "--model-name", "other/m"]
    assert cli_main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main([*argv, "--overwrite"]) == 0
    assert lmprobe.load(tmp_path / "imported").model["name"] == "other/m"
    # a partial import of another cache is not resumed over
    other = export_saelens(path, tmp_path / "other", layer=0, quiet=True)
    monkeypatch.setattr(DatasetWriter, "add_batch", dying)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        import_saelens(cache, tmp_path / "imported2", quiet=True, checkpoint_interval=0)
    monkeypatch.setattr(DatasetWriter, "add_batch", real)
    assert cli_main(["import-saelens", str(other), "--out", str(tmp_path / "imported2"), "--quiet"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert cli_main(["import-saelens", str(other), "--out", str(tmp_path / "imported2"), "--quiet", "--overwrite"]) == 0
    assert lmprobe.load(tmp_path / "imported2").layers == [0]


def test_a_cache_of_no_rows_leaves_nothing_behind(tmp_path, capsys):
    """A cache with 0 rows left a complete 0-prompt dataset behind after its one-line error (finding 16)."""
    hook = "blocks.0.hook_resid_post"
    folder = hand_cache(tmp_path / "empty", {hook: nested(np.zeros((0, CTX, DIM), np.float32))})
    assert cli_main(["import-saelens", str(folder), "--out", str(tmp_path / "ds"), "--quiet"]) == 2
    assert "holds no rows" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("stale", ["file", "symlink", "dangling symlink"])
def test_export_replaces_a_stale_partial_of_any_kind(tmp_path, source, stale):
    """A `.NAME.partial` that is a file or a symlink gave a traceback; a link is removed,
    never followed."""
    path, src = source
    partial = tmp_path / ".cache.partial"
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    if stale == "file":
        partial.write_text("junk")
    else:
        partial.symlink_to(target if stale == "symlink" else tmp_path / "nowhere")
    out = export_saelens(path, tmp_path / "cache", layer=1, quiet=True)
    _, batches = read_cache(out)
    acts = np.array(pa.Table.from_batches(batches).column(0).to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(acts, windows(src, 1))
    assert not os.path.lexists(partial) and (target / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


def test_export_run_again_has_nothing_to_do_and_another_is_refused(tmp_path, source, capsys):
    """The same export after it finished (or after a kill that landed once it had) is done, not refused; another
    export into the folder is refused (a kill at every step of the export)."""
    path, _ = source
    argv = ["export-saelens", str(path), "--out", str(tmp_path / "cache"), "--layer", "1"]
    assert cli_main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "cache").iterdir()}
    capsys.readouterr()
    assert cli_main(argv) == 0
    assert "already holds this export" in capsys.readouterr().err
    assert cli_main([*argv[:-1], "0"]) == 2  # layer 0 into the folder holding layer 1
    assert "is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "cache").iterdir()} == before


def test_info_of_an_imported_cache_and_of_the_demo_says_how_they_were_made(tmp_path, source, capsys):
    """`info` says how an imported cache and the demo were made, never "backend None"."""
    path, _ = source
    cache = export_saelens(path, tmp_path / "cache", layer=1, quiet=True)
    back = import_saelens(cache, tmp_path / "back", quiet=True)
    assert cli_main(["info", str(back)]) == 0
    made = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("made with"))
    assert "None" not in made and f"imported from a SAELens activation cache ({cache})" in made, made
    assert cli_main(["demo", "--out", str(tmp_path / "demo")]) == 0
    made = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("made with"))
    assert "None" not in made and "written directly (no extraction)" in made, made


def test_export_takes_a_negative_layer_as_every_other_command_does(tmp_path, source):
    """`export-saelens --layer -1` is the last stored layer, as `--layers -1` is elsewhere."""
    path, src = source
    assert cli_main(["export-saelens", str(path), "--out", str(tmp_path / "c"), "--layer", "-1", "--quiet"]) == 0
    _, batches = read_cache(tmp_path / "c")
    assert batches[0].schema.names[0] == "blocks.1.hook_resid_post"
    acts = np.array(pa.Table.from_batches(batches).column(0).to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(acts, windows(src, 1))


def test_export_packs_every_stored_token_into_windows_by_default(tmp_path, rng, capsys, messages):
    """Prompts of many lengths exported 1 prompt of 48 (those of the longest length) and exited 0.
    By default the tokens are packed in index order, as SAELens' own caching does: all but the last partial window."""
    src = write_dataset(tmp_path / "ds", rng, n=48, layers=(2,), dim=4, storage="full_sequence", min_tokens=3,
                        max_tokens=20, token_ids=True)
    total = int(src["n_tok"].sum())
    T = int(src["n_tok"].max())
    out = export_saelens(tmp_path / "ds", tmp_path / "c", shard_bytes=4 * T * 4 * 3)  # several data files
    state, batches = read_cache(out)
    assert len(state["_data_files"]) > 1
    table = pa.Table.from_batches(batches)
    n = total // T
    assert table.num_rows == n and n * T > total - T  # every token but the last partial window's
    acts = np.array(table.column("blocks.2.hook_resid_post").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(acts.reshape(-1, 4), src["hidden"][2][: n * T])  # the stream, in index order
    ids = np.concatenate([np.arange(k) for k in src["n_tok"]])  # write_dataset's token j has id j
    np.testing.assert_array_equal(np.array(table.column("token_ids").to_pylist()).reshape(-1), ids[: n * T])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"wrote {n} windows x {T} tokens x 4 dims of blocks.2.hook_resid_post to {out}: the "
                          f"{total:,} stored tokens of 48 prompts packed in index order (the last {total - n * T} "
                          "left out; --windows exact keeps whole prompts of one length instead)"), err
    back = lmprobe.load(import_saelens(out, tmp_path / "back", quiet=True))
    assert back.num_prompts == n and int(back.token_lengths().sum()) == n * T
