"""Third-party readers, the lmprobe 0.10.3 fixture, the dataset card and the validator."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors import safe_open
from support.datasets import write_dataset
from support.paths import FIXTURE_0103, FIXTURE_0103_FULL, ROOT

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.format.validate import validate

DOCS = ROOT / "docs"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _reading_snippets() -> list[str]:
    text = (DOCS / "format.md").read_text()
    section = text.split("## Reading without lmprobe", 1)[1].split("## Files on disk", 1)[0]
    blocks = _python_blocks(section)
    assert len(blocks) == 3, "docs/format.md should hold the three reading examples"
    return blocks


@pytest.fixture
def big_full_sequence(tmp_path_factory):
    out = tmp_path_factory.mktemp("snip") / "ds"
    rng = np.random.default_rng(7)
    src = write_dataset(out, rng, n=50, layers=(0, 16), dim=6, storage="full_sequence", shard_size="1KB",
                        min_tokens=6, max_tokens=12, logits_topk=4)
    return out, src


#: runs the format document's reading examples in a process where torch cannot be imported (the page promises that
#: pyarrow, safetensors and numpy suffice), and saves what they read
WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
import json
import numpy as np
snippets = json.loads(open(sys.argv[1]).read())
ns = {}
for i, code in enumerate(snippets):
    exec(code, ns)
    names = ["vector"] if i < 2 else ["values", "indices"]
    for name in names:
        np.save(f"{sys.argv[2]}/{i}-{name}.npy", np.asarray(ns[name]))
"""


def _run_snippets_without_torch(folder: Path, snippets: list[str], out: Path) -> None:
    out.mkdir(exist_ok=True)
    (out / "snippets.json").write_text(json.dumps(snippets))
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, str(out / "snippets.json"), str(out)], cwd=folder,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_document_snippets_run_as_written_without_torch(tmp_path, dtype):
    """The format document's snippets run without torch (never framework="pt"); bfloat16 is read through
    uint16."""
    out = tmp_path / "ds"
    rng = np.random.default_rng(7)
    src = write_dataset(out, rng, n=50, layers=(0, 16), dim=6, storage="full_sequence", shard_size="1KB",
                        min_tokens=6, max_tokens=12, logits_topk=4, dtype=dtype)
    _run_snippets_without_torch(out, _reading_snippets(), tmp_path / "read")
    ds = lmprobe.load(out)  # float32, as lmprobe reads every dtype
    np.testing.assert_array_equal(np.load(tmp_path / "read/0-vector.npy").astype(np.float32), ds.hidden(16)[42])
    np.testing.assert_array_equal(np.load(tmp_path / "read/1-vector.npy").astype(np.float32),
                                  ds.token_hidden(42, 16)[5])
    if dtype == "float32":
        np.testing.assert_array_equal(np.load(tmp_path / "read/0-vector.npy"),
                                      src["hidden"][16][src["tok_start"][43] - 1])
    np.testing.assert_array_equal(np.load(tmp_path / "read/2-values.npy"), src["lv"][42])
    np.testing.assert_array_equal(np.load(tmp_path / "read/2-indices.npy"), src["li"][42])


def test_document_snippet_on_pooled_output(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=45, layers=(16,), dim=4, shard_size="100B")
    _run_snippets_without_torch(tmp_path / "ds", _reading_snippets()[:1], tmp_path / "read")
    np.testing.assert_array_equal(np.load(tmp_path / "read/0-vector.npy"), src["hidden"][16][42])


def test_int8_numpy_snippet_reads_a_vector_exactly_as_lmprobe_load(tmp_path, rng, monkeypatch):
    """docs/format.md's numpy-only reading of an int8 dataset (no torch): codes times the row's scale."""
    text = (DOCS / "format.md").read_text()
    section = text.split("## Dtypes", 1)[1].split("## Reading without lmprobe", 1)[0]
    (snippet,) = _python_blocks(section)
    assert "torch" not in snippet
    write_dataset(tmp_path / "ds", rng, n=50, layers=(0, 16), dim=6, dtype="int8", shard_size=200)
    monkeypatch.chdir(tmp_path / "ds")
    ns: dict = {}
    exec(snippet, ns)
    want = lmprobe.load(tmp_path / "ds").hidden(16)[42]
    assert ns["vector"].dtype == np.float32
    np.testing.assert_array_equal(ns["vector"], want)
    assert lmprobe.load(tmp_path / "ds").column("shard_index")[42] > 0  # the row is not in the first shard


def test_card_front_matter_and_snippet(big_full_sequence, monkeypatch):
    out, src = big_full_sequence
    text = (out / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["configs"][0]["data_files"][0]["path"] == "index/*.parquet"
    standalone = [b for b in _python_blocks(text) if "safe_open" in b][0]
    monkeypatch.chdir(out)
    ns: dict = {}
    exec(standalone, ns)
    np.testing.assert_array_equal(ns["vector"], src["hidden"][16][src["tok_start"][1] - 1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_card_snippet_runs_as_written_for_every_dtype(tmp_path, rng, monkeypatch, dtype):
    write_dataset(tmp_path / "ds", rng, n=6, layers=(0, 3), dim=4, dtype=dtype)
    text = (tmp_path / "ds/README.md").read_text()
    standalone = [b for b in _python_blocks(text) if "safe_open" in b][0]
    assert "torch" not in standalone  # bfloat16 is read through its uint16 view
    monkeypatch.chdir(tmp_path / "ds")
    ns: dict = {}
    exec(standalone, ns)
    vector = np.asarray(ns["vector"], dtype=np.float32)
    np.testing.assert_array_equal(vector, lmprobe.load(tmp_path / "ds").hidden(3)[0])


def test_datasets_load_dataset_reads_the_index(big_full_sequence):
    import datasets
    out, src = big_full_sequence
    ds = datasets.load_dataset(str(out), split="train")
    assert ds.num_rows == 50
    assert ds[3]["text"] == src["texts"][3] and ds[3]["label"] == int(src["labels"][3])


def test_reads_the_lmprobe_0_10_3_fixture():
    ds = lmprobe.load(FIXTURE_0103)
    assert ds.num_prompts == 10 and ds.layers == [0, 1, 2] and ds.dim == 32 and ds.storage == "pooled"
    df = pq.read_table(FIXTURE_0103 / "index/train-00000-of-00001.parquet").to_pandas()
    for layer in ds.layers:
        got = ds.hidden(layer)
        for i, row in df.iterrows():
            path = FIXTURE_0103 / f"tensors/hidden_layer{layer:03d}_shard{row['shard_index']:03d}.safetensors"
            with safe_open(str(path), "np") as f:
                np.testing.assert_array_equal(got[i], f.get_tensor(f"hidden.layer_{layer}")[row["row_offset"]])
    values, indices = ds.logits_topk()
    assert values.shape == (10, 5) and indices.dtype == np.int32
    row = df.iloc[7]
    with safe_open(str(FIXTURE_0103 / f"tensors/logits_topk_{row['shard_index_logits']:03d}.safetensors"), "np") as f:
        np.testing.assert_array_equal(values[7], f.get_tensor("logits_topk.values")[row["row_offset_logits"]])
        np.testing.assert_array_equal(indices[7], f.get_tensor("logits_topk.indices")[row["row_offset_logits"]])
    assert np.all(np.diff(values, axis=1) <= 0)
    assert ds.token_lengths().tolist() == [len(t) for t in df["token_ids"]]
    assert ds.labels.tolist() == df["label"].tolist()


def test_fixture_validates_with_warnings_for_its_quirks():
    rep = validate(FIXTURE_0103)
    assert rep.ok, str(rep)
    text = "\n".join(rep.warnings)
    assert "num_tokens is null" in text and "logits_topk.values" in text and "row_bytes is 60" in text
    assert "lmprobe_info.json" in text


def test_reader_does_not_depend_on_the_quirks(tmp_path):
    """Remove the sidecars and rekey the logits the standard way: still reads the same."""
    d = tmp_path / "fx"
    shutil.copytree(FIXTURE_0103, d)
    (d / "lmprobe_info.json").unlink()
    (d / "_stage_complete").unlink()
    before = lmprobe.load(FIXTURE_0103).logits_topk()
    from safetensors.numpy import save_file

    for p in (d / "tensors").glob("logits_topk_*.safetensors"):
        with safe_open(str(p), "np") as f:
            t = {"topk_values": f.get_tensor("logits_topk.values"), "topk_indices": f.get_tensor("logits_topk.indices")}
        p.chmod(0o644)
        save_file(t, str(p))
    after = lmprobe.load(d).logits_topk()
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])


# ---------------------------------------------------------------- the validator


def test_validator_reports_every_problem_in_one_pass(tmp_path, rng, capsys):
    write_dataset(tmp_path / "ds", rng, n=20, shard_size="160B", logits_topk=2)
    d = tmp_path / "ds"
    (d / "tensors/hidden_layer002_shard001.safetensors").unlink()
    p = d / "tensors/hidden_layer005_shard003.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    p.write_bytes(bytes(data))
    q = d / "tensors/hidden_layer000_shard000.safetensors"
    q.write_bytes(q.read_bytes()[:-4])  # truncated
    rep = validate(d)
    assert not rep.ok
    text = "\n".join(rep.errors)
    assert "hidden_layer002_shard001.safetensors: file is missing" in text
    assert "hidden_layer005_shard003.safetensors: sha256 is" in text
    assert "hidden_layer000_shard000.safetensors" in text
    assert len(rep.errors) >= 3
    assert cli_main(["validate", str(d)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "file is missing" in out
    assert cli_main(["validate", str(d), "--no-checksums"]) == 1


def test_validator_checks_addressing_and_counts(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=12, shard_size="160B")
    d = tmp_path / "ds"
    index = d / "index/train-00000-of-00001.parquet"
    table = pq.read_table(index)
    df = table.to_pandas()
    df.loc[3, "row_offset"] = 2  # collides with row 2
    import pyarrow as pa

    pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), index)
    rep = validate(d)
    assert any("more than once" in e for e in rep.errors), str(rep)


def test_cli_validate_ok_and_info(tmp_path, rng, capsys):
    write_dataset(tmp_path / "ds", rng, n=9, storage="full_sequence", logits_topk=3)
    assert cli_main(["validate", str(tmp_path / "ds")]) == 0
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "prompts      9" in out and "full_sequence" in out and "top-3" in out


def test_info_counts_in_words_and_lists_only_the_users_columns(tmp_path, rng, capsys):
    write_dataset(tmp_path / "ds", rng, n=9, storage="full_sequence", logits_topk=3, shard_size="1MB")
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "1 last-token + 1 sequence shard)" in out and "top-3 at the last token (1 shard)" in out
    assert "1 shards" not in out
    assert "\ncolumns      source, idx\n" in out  # not token_offset, token_shard_ids, shard_index_logits, ...
    for internal in ("token_shard_ids", "token_offset", "shard_index", "row_offset"):
        assert internal not in out


def test_python_m_lmprobe_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmprobe", "validate", str(FIXTURE_0103)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_info_on_a_folder_without_a_dataset(tmp_path, capsys):
    assert cli_main(["info", str(tmp_path)]) == 2
    assert "holds no lmprobe dataset" in capsys.readouterr().err


def test_reads_and_validates_the_0_10_3_full_sequence_fixture():
    """0.10.3 keeps a first-token entry in token_perplexity for left-padded rows: a warning, not an error."""
    rep = validate(FIXTURE_0103_FULL)
    assert rep.ok, str(rep)
    assert any("token_perplexity" in w and "another implementation" in w for w in rep.warnings)
    ds = lmprobe.load(FIXTURE_0103_FULL)
    assert ds.storage == "full_sequence" and ds.layers == [0, 2]
    p_of_row = ds.table.column("orig_idx").to_pylist()
    for row, p in enumerate(p_of_row):
        n = int(ds.token_lengths()[row])
        for layer in ds.layers:
            want = 1000 * layer + 10 * p + np.arange(n)[:, None] + np.arange(4)[None, :] / 1000
            np.testing.assert_allclose(ds.token_hidden(row, layer), want, rtol=0, atol=1e-3)
    values, indices = ds.logits_topk()
    np.testing.assert_array_equal(indices, [[3 + p, 9 + p, 15 + p] for p in p_of_row])


def test_our_own_datasets_stay_strict_about_per_token_lengths(tmp_path, rng):
    import pyarrow as pa

    write_dataset(tmp_path / "ds", rng, n=5, storage="full_sequence", token_ids=True)
    index = tmp_path / "ds/index/train-00000-of-00001.parquet"
    table = pq.read_table(index)
    ids = table.column("token_ids").to_pylist()
    ids[0] = ids[0] + [7]  # one entry too many
    i = table.column_names.index("token_ids")
    table = table.set_column(i, "token_ids", pa.array(ids, pa.list_(pa.int64())))
    pq.write_table(table, index)
    rep = validate(tmp_path / "ds")
    assert not rep.ok and any("token_ids has" in e for e in rep.errors)
