"""saev protocol 2.0 export and reader: sizing, hash, offsets against the source, determinism, batches."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.datasets import edit_index_column, write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import FormatError
from lmprobe.saev import SaevDataset, SaevError, export_saev, metadata_hash, shard_sizes, validate_saev

INDEX = "index/train-00000-of-00001.parquet"


@pytest.fixture
def source(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=20, layers=(1, 4), dim=6, storage="full_sequence", shard_size="2KB",
                        min_tokens=3, max_tokens=12, token_ids=True)
    return tmp_path / "ds", src


def _source_tokens(src, layer, drop_first=False):
    """The packed token stream of the source, the obvious slow way."""
    rows = []
    for i in range(len(src["n_tok"])):
        a, b = src["tok_start"][i], src["tok_start"][i + 1]
        a += 1 if drop_first else 0
        rows.append(src["hidden"][layer][a:b])
    return np.concatenate(rows)


def test_export_layout_offsets_and_hash(tmp_path, source):
    path, src = source
    T = 5
    out = export_saev(path, tmp_path / "dump", context_len=T, patches_per_shard=4 * T * 2, quiet=True)
    meta = json.loads((out / "metadata.json").read_text())
    assert list(meta) == ["family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex",
                          "patches_per_shard", "data", "dataset", "dtype", "protocol"]
    assert out.name == metadata_hash(meta)
    total = int(src["n_tok"].sum())
    assert meta["n_ex"] == total // T and meta["layers"] == [1, 4] and meta["protocol"] == "2.0"
    shards = json.loads((out / "shards.json").read_text())
    assert [s["n_ex"] for s in shards] == shard_sizes(meta["n_ex"], 4)
    stream = {layer: _source_tokens(src, layer) for layer in (1, 4)}
    sv = SaevDataset(out)
    for ex in (0, 3, meta["n_ex"] - 1):
        for li, layer in enumerate((1, 4)):
            for t in (0, T - 1):
                want = stream[layer][ex * T + t]
                # section 4.2 by hand: seek and read
                shard_idx, ex_in = divmod(ex, 4)
                off = ((ex_in * 2 * T) + li * T + t) * 6 * 4
                with open(out / f"acts{shard_idx:06d}.bin", "rb") as f:
                    f.seek(off)
                    got = np.frombuffer(f.read(24), dtype="<f4")
                np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(sv.get(ex, layer, t), want)
                assert sv.locate(ex, layer, t) == (out / f"acts{shard_idx:06d}.bin", off)
    with pytest.raises(SaevError, match="layer 2 is not recorded"):
        sv.get(0, 2, 0)
    toks = sv.tokens()
    packed_ids = np.concatenate([list(range(int(n))) for n in src["n_tok"]])[: meta["n_ex"] * T]
    np.testing.assert_array_equal(np.asarray(toks).reshape(-1), packed_ids)
    labels = np.asarray(sv.labels()).reshape(-1)
    np.testing.assert_array_equal(labels, np.repeat(src["labels"], src["n_tok"])[: meta["n_ex"] * T])
    assert validate_saev(out) == []
    assert cli_main(["validate", str(out)]) == 0


@pytest.mark.parametrize("n_ex,per,want", [(8, 4, [4, 4]), (9, 4, [4, 4, 1]), (1, 4, [1]), (3, 3, [3])])
def test_shard_sizing(n_ex, per, want):
    assert shard_sizes(n_ex, per) == want


def test_exact_multiple_has_no_empty_trailing_shard(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=8, layers=(0,), dim=4, storage="full_sequence", min_tokens=4, max_tokens=4,
                  token_ids=True)
    out = export_saev(tmp_path / "ds", tmp_path / "d", context_len=4, patches_per_shard=16, quiet=True)
    shards = json.loads((out / "shards.json").read_text())
    assert [s["n_ex"] for s in shards] == [4, 4] and sorted(p.name for p in out.glob("acts*")) == [
        "acts000000.bin", "acts000001.bin"]


def test_one_example_and_budget_errors(tmp_path, source, capsys):
    path, src = source
    total = int(src["n_tok"].sum())
    out = export_saev(path, tmp_path / "d", context_len=total, patches_per_shard=10**6, quiet=True)
    assert SaevDataset(out).n_ex == 1
    with pytest.raises(SaevError, match="smaller than one example"):
        export_saev(path, tmp_path / "d", context_len=5, patches_per_shard=9, quiet=True)
    with pytest.raises(SaevError, match="fewer than one window"):
        export_saev(path, tmp_path / "d", context_len=total + 1, quiet=True)
    assert cli_main(["export-saev", str(path), "--out", str(tmp_path / "d"), "--context-len", "5",
                     "--patches-per-shard", "9"]) == 2
    assert "smaller than one example" in capsys.readouterr().err


def test_deterministic_and_second_export_is_a_no_op(tmp_path, source):
    path, _ = source
    a = export_saev(path, tmp_path / "d1", context_len=4, patches_per_shard=40, quiet=True)
    b = export_saev(path, tmp_path / "d2", context_len=4, patches_per_shard=40, quiet=True)
    assert a.name == b.name
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes()
    mtimes = {f.name: f.stat().st_mtime_ns for f in a.iterdir()}
    assert export_saev(path, tmp_path / "d1", context_len=4, patches_per_shard=40, quiet=True) == a
    assert mtimes == {f.name: f.stat().st_mtime_ns for f in a.iterdir()}
    c = export_saev(path, tmp_path / "d1", context_len=4, patches_per_shard=40, drop_first_token=True, quiet=True)
    assert c != a  # a different configuration never collides


def test_drop_first_token_and_layer_subset(tmp_path, source):
    path, src = source
    out = export_saev(path, tmp_path / "d", layers=[4], context_len=3, drop_first_token=True, quiet=True)
    sv = SaevDataset(out)
    stream = _source_tokens(src, 4, drop_first=True)
    np.testing.assert_array_equal(sv.get(2, 4, 1), stream[2 * 3 + 1])


def test_interrupted_export_resumes(tmp_path, source, monkeypatch):
    path, _ = source
    ref = export_saev(path, tmp_path / "ref", context_len=4, patches_per_shard=24, quiet=True)
    import lmprobe.saev.export as saev_mod

    real, calls = saev_mod.os.replace, {"n": 0}

    def dying(a, b):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(saev_mod.os, "replace", dying)
    with pytest.raises(KeyboardInterrupt):
        export_saev(path, tmp_path / "d", context_len=4, patches_per_shard=24, quiet=True)
    monkeypatch.setattr(saev_mod.os, "replace", real)
    assert not (tmp_path / "d" / ref.name).exists()
    out = export_saev(path, tmp_path / "d", context_len=4, patches_per_shard=24, quiet=True)
    for f in ref.iterdir():
        assert f.read_bytes() == (out / f.name).read_bytes()


def test_validate_catches_tampering(tmp_path, source):
    path, _ = source
    out = export_saev(path, tmp_path / "d", context_len=4, patches_per_shard=40, quiet=True)
    (out / "acts000001.bin").write_bytes(b"\0" * 10)
    meta = json.loads((out / "metadata.json").read_text())
    meta["extra"] = 1
    (out / "metadata.json").write_text(json.dumps(meta))
    problems = validate_saev(out)
    text = " ".join(problems)
    assert "extra ['extra']" in text and "not the sha256" in text and "acts000001.bin is 10 bytes" in text


def test_shuffled_batches_cover_every_vector_once(tmp_path, source):
    path, src = source
    out = export_saev(path, tmp_path / "d", context_len=4, patches_per_shard=40, quiet=True)
    sv = SaevDataset(out)
    batches = list(sv.batches(1, 7, seed=3, memory="2KB"))
    assert all(len(b) == 7 for b in batches[:-1])
    got = np.concatenate(batches)
    want = _source_tokens(src, 1)[: sv.n_ex * 4]
    assert len(got) == len(want)
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(want, axis=0))
    assert not np.array_equal(got, want)  # shuffled
    again = np.concatenate(list(sv.batches(1, 7, seed=3, memory="2KB")))
    np.testing.assert_array_equal(got, again)
    import torch

    loader = torch.utils.data.DataLoader(sv.torch_dataset(1, 5, memory="2KB"), batch_size=None, num_workers=0)
    assert sum(len(b) for b in loader) == len(want)


def test_pooled_source_is_a_clear_error(tmp_path, rng):
    write_dataset(tmp_path / "p", rng, n=4)
    with pytest.raises(SaevError, match="--storage full_sequence"):
        export_saev(tmp_path / "p", tmp_path / "d")


def test_without_token_ids_tokens_bin_is_skipped_with_a_note(tmp_path, rng, capsys):
    """tokens.bin is lmprobe's addition, not part of the protocol: its absence is no reason to refuse."""
    write_dataset(tmp_path / "f", rng, n=4, storage="full_sequence")
    assert cli_main(["export-saev", str(tmp_path / "f"), "--out", str(tmp_path / "d"), "--context-len", "2"]) == 0
    out = capsys.readouterr()
    notes = [line for line in (out.out + out.err).splitlines() if "tokens.bin" in line]
    assert len(notes) == 1 and "--token-ids" in notes[0]
    (folder,) = (tmp_path / "d").iterdir()
    assert not (folder / "tokens.bin").exists() and validate_saev(folder) == []
    assert json.loads((folder / "metadata.json").read_text())["data"]["tokens_file"] is None
    # asked for explicitly, the ids must be there
    with pytest.raises(SaevError, match="--token-ids"):
        export_saev(tmp_path / "f", tmp_path / "e", context_len=2, tokens=True)


def test_with_token_ids_tokens_bin_is_written_unless_told_not(tmp_path, source):
    path, src = source
    with_ids = export_saev(path, tmp_path / "a", context_len=3, quiet=True)
    assert (with_ids / "tokens.bin").exists()
    without = export_saev(path, tmp_path / "b", context_len=3, tokens=False, quiet=True)
    assert not (without / "tokens.bin").exists()


SAEV_E43E7DD_FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "fake-clip")
SAEV_E43E7DD_FIELDS = {"family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model", "n_ex",
                       "patches_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"}


def saev_loader_accepts(folder) -> None:
    """What saev's own loaders (commit e43e7dd, the protocol 2.0 code) require of a folder, step by step:
    Metadata(**metadata.json) with its typed fields; the folder at .../saev/shards/<name>; every shard,
    the last included, np.memmap'ed at the full (ex_per_shard, L, T, D) shape; shards.json entries
    {name, n_ex} in order whose counts add up to n_ex."""
    m = json.loads((folder / "metadata.json").read_text())
    assert set(m) <= SAEV_E43E7DD_FIELDS, set(m) - SAEV_E43E7DD_FIELDS
    assert m["family"] in SAEV_E43E7DD_FAMILIES
    assert m["protocol"] in ("1.0.0", "1.1", "2.0") and m["dtype"] == "float32" and isinstance(m["data"], dict)
    assert folder.parent.parts[-2:] == ("saev", "shards")
    T = m["patches_per_ex"] + int(m["cls_token"])
    per = m["patches_per_shard"] // (T * len(m["layers"]))
    shards = json.loads((folder / "shards.json").read_text())
    assert all(set(s) == {"name", "n_ex"} for s in shards)
    assert sum(s["n_ex"] for s in shards) == m["n_ex"] and all(s["n_ex"] == per for s in shards[:-1])
    for i, _ in enumerate(shards):
        np.memmap(folder / f"acts{i:06d}.bin", mode="r", dtype=np.float32, shape=(per, len(m["layers"]), T, m["d_model"]))


def test_saev_compatible_export_opens_the_way_saevs_loaders_open_it(tmp_path, source):
    path, src = source
    T = 4
    n_ex = json.loads((export_saev(path, tmp_path / "count", context_len=T, quiet=True) / "metadata.json")
                      .read_text())["n_ex"]
    per = next(p for p in range(3, n_ex) if n_ex % p)  # a last shard smaller than the others
    plain = export_saev(path, tmp_path / "plain", context_len=T, patches_per_shard=per * T * 2, quiet=True)
    with pytest.raises(ValueError, match="mmap length is greater than file size"):
        saev_loader_accepts_shapes_only(plain)
    with pytest.raises(SaevError, match="saev/shards"):
        export_saev(path, tmp_path / "elsewhere", context_len=T, saev_compat=True, quiet=True)
    folder = export_saev(path, tmp_path / "saev" / "shards", context_len=T, patches_per_shard=per * T * 2,
                         saev_compat=True, quiet=True)
    saev_loader_accepts(folder)
    m = json.loads((folder / "metadata.json").read_text())
    assert m["data"]["source_family"] == "llm" and m["data"]["last_shard_padded"] is True
    # lmprobe reads it as the same data, padding never delivered
    assert validate_saev(folder) == []
    a, b = SaevDataset(plain), SaevDataset(folder)
    assert len(a) == len(b)
    got = np.concatenate(list(b.batches(1, 7, shuffle=False)))
    np.testing.assert_array_equal(got, np.concatenate(list(a.batches(1, 7, shuffle=False))))
    np.testing.assert_array_equal(b.get(len(b) - 1, 4, T - 1), a.get(len(a) - 1, 4, T - 1))


def saev_loader_accepts_shapes_only(folder) -> None:
    m = json.loads((folder / "metadata.json").read_text())
    T = m["patches_per_ex"] + int(m["cls_token"])
    per = m["patches_per_shard"] // (T * len(m["layers"]))
    for s in json.loads((folder / "shards.json").read_text()):
        np.memmap(folder / s["name"], mode="r", dtype=np.float32, shape=(per, len(m["layers"]), T, m["d_model"]))


def test_export_from_a_hub_repo(hub, tmp_path, source, fresh_hf_cache):
    import uuid

    path, src = source
    repo = f"tester/seq-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(path, repo, quiet=True)
    out = export_saev(repo, tmp_path / "d", layers=[1], context_len=4, quiet=True)
    local = export_saev(path, tmp_path / "l", layers=[1], context_len=4, quiet=True)
    assert (out / "acts000000.bin").read_bytes() == (local / "acts000000.bin").read_bytes()
    assert json.loads((out / "metadata.json").read_text())["dataset"] == repo


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_sources_export_as_float32(tmp_path, rng, dtype):
    write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=4, storage="full_sequence", dtype=dtype,
                  min_tokens=4, max_tokens=8, token_ids=True)
    ds = lmprobe.load(tmp_path / "ds")
    out = export_saev(tmp_path / "ds", tmp_path / "d", context_len=3, quiet=True)
    sv = SaevDataset(out)
    want = np.concatenate([ds.token_hidden(i, 0) for i in range(6)]).astype(np.float32)
    got = np.concatenate([np.asarray(sv.shard(i)).reshape(-1, 4) for i in range(len(sv.shards))])
    np.testing.assert_array_equal(got, want[: len(got)])


def test_saev_batches_use_the_training_reader_ranks_and_all(tmp_path, source):
    """The saev reader is the same engine as ShardStream: rank shares are disjoint and complete."""
    path, src = source
    out = export_saev(path, tmp_path / "d", context_len=4, patches_per_shard=40, quiet=True)
    sv = SaevDataset(out)
    shares = [np.concatenate(list(sv.batches(1, 5, seed=1, rank=r, world_size=2, memory="2KB"))) for r in range(2)]
    want = _source_tokens(src, 1)[: sv.n_ex * 4]
    got = np.concatenate(shares)
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(want, axis=0))
    assert min(len(s) for s in shares) > 0


def test_a_saev_dataset_shows_what_it_holds(tmp_path, source):
    path, _ = source
    folder = export_saev(path, tmp_path / "dump", context_len=5, quiet=True)
    text = repr(SaevDataset(folder))
    assert text == (f"<lmprobe SaevDataset {folder}: {len(SaevDataset(folder))} examples x 5 tokens, layers [1, 4], "
                    "d_model 6, float32>"), text


def test_info_and_validate_describe_a_saev_export_and_point_from_its_dump_folder(tmp_path, source, capsys):
    """`info` and `validate` describe a saev folder, and `validate DUMP_TO` (export-saev's --out) points at the
    export inside it."""
    path, _ = source
    folder = export_saev(path, tmp_path / "dump", context_len=5, quiet=True)
    assert cli_main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"saev export {folder} (protocol 2.0)"
    assert f"examples     {len(SaevDataset(folder)):,} x 5 tokens" in out and "layers       [1, 4]" in out
    assert "d_model      6, float32" in out
    # the folder given to export-saev's --out is described and checked as the exports it holds
    # (it was an exit-2 error naming the folder inside)
    assert cli_main(["info", str(tmp_path / "dump")]) == 0
    assert capsys.readouterr().out == out
    assert cli_main(["validate", str(tmp_path / "dump")]) == 0
    assert capsys.readouterr().out.startswith(f"{folder}: saev OK")


def test_export_into_a_log_writes_lines_not_bars(tmp_path, source, capsys, monkeypatch):
    """When stderr is not a terminal the export commands write progress lines, never bars."""
    monkeypatch.setenv("LMPROBE_PROGRESS_INTERVAL", "0")
    path, _ = source
    assert cli_main(["export-saev", str(path), "--out", str(tmp_path / "dump"), "--context-len", "5"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, err
    assert any(x.startswith("export-saev: ") and "examples" in x for x in err.splitlines()), err


def test_export_saev_checks_the_index_addresses(tmp_path, rng):
    import pyarrow as pa

    from lmprobe.saev import export_saev

    write_dataset(tmp_path / "ds", rng, n=6, storage="full_sequence", min_tokens=3, token_ids=True)
    index = tmp_path / "ds" / INDEX
    table = pq.read_table(index)
    offs = table.column("token_shard_offsets").to_pylist()
    offs[1][0] = -5
    table = table.set_column(table.column_names.index("token_shard_offsets"), "token_shard_offsets",
                             pa.array(offs, pa.list_(pa.int64())))
    pq.write_table(table, index)
    with pytest.raises(FormatError, match="offset"):
        export_saev(tmp_path / "ds", tmp_path / "dump", context_len=2, quiet=True)
    assert not list((tmp_path / "dump").glob("[!.]*"))


def test_validate_of_a_broken_saev_folder_says_so(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    (tmp_path / "s/metadata.json").write_text("{not json")
    (tmp_path / "s/shards.json").write_text("[]")
    assert cli_main(["validate", str(tmp_path / "s")]) == 1
    out = capsys.readouterr().out
    assert "saev" in out and "metadata.json" in out and "no lmprobe dataset" not in out


def test_token_id_lists_shorter_than_num_tokens_are_refused_before_export(tmp_path, rng):
    from lmprobe.saev import export_saev

    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B",
                  token_ids=True)

    def shorter(lists):
        lists[2] = lists[2][:-1]
        return lists

    edit_index_column(tmp_path / "ds", "token_ids", shorter)
    with pytest.raises(FormatError, match="row 2: .* token ids for num_tokens="):
        export_saev(tmp_path / "ds", tmp_path / "saev", context_len=4, quiet=True)
    assert not list((tmp_path / "saev").glob("[!.]*"))


def test_the_python_api_validates_and_describes_a_saev_export_and_its_dump_folder(tmp_path, source):
    """lmprobe.validate and lmprobe.info take what the command line takes: a saev export is checked against the
    protocol and described, and export-saev's --out folder stands for the exports it holds."""
    import lmprobe

    path, _ = source
    folder = export_saev(path, tmp_path / "dump", context_len=5, quiet=True)
    report = lmprobe.validate(folder)
    assert report.ok and str(report) == f"{folder}: saev OK (0 problem(s))"
    assert lmprobe.info(folder).splitlines()[0] == f"saev export {folder} (protocol 2.0)"
    assert lmprobe.info(tmp_path / "dump") == lmprobe.info(folder)
    assert lmprobe.api.artefact_paths(tmp_path / "dump") == [str(folder)]
    (folder / "shards.json").write_text("[]")
    report = lmprobe.validate(folder)
    assert not report.ok and str(report).startswith(f"{folder}: saev INVALID")
