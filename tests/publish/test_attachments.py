"""One Hub repo carries the dataset, its saev exports and SAE dictionaries; each part downloads alone."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.datasets import write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import AttachmentError
from lmprobe.publish.attachments import publish_attachment
from lmprobe.sae import SAEConfig, load_dictionary, project_topk
from lmprobe.sae.export import export_sae
from lmprobe.saev import SaevDataset, export_saev

INDEX = "index/train-00000-of-00001.parquet"


def repo_name():
    return f"tester/all-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def bundle(tmp_path, rng):
    ds_path = tmp_path / "ds"
    src = write_dataset(ds_path, rng, n=16, layers=(0, 3), dim=6, storage="full_sequence", shard_size="1KB",
                        min_tokens=3, max_tokens=9, token_ids=True)
    saev = export_saev(ds_path, ds_path / "saev", layers=[3], context_len=4, patches_per_shard=40, quiet=True)
    W = rng.normal(size=(6, 20)).astype(np.float32)
    export_sae(layer=3, root=ds_path / "sae", dictionary="tiny-sae", W_enc=W, b_enc=np.zeros(20, np.float32),
               threshold=0.2)
    return ds_path, src, saev


def repo_name_of_other(hub, ds_path) -> str:
    """Another repo holding the same parts."""
    repo = repo_name()
    lmprobe.push_to_hub(ds_path, repo, quiet=True)
    return repo


def _gets(hub, start, prefix):
    return [p for m, p in hub.log[start:] if m == "GET" and "/resolve/" in p and prefix in p]


def test_push_everything_then_fetch_each_part_alone(hub, bundle, fresh_hf_cache):
    ds_path, src, saev = bundle
    repo = repo_name()
    lmprobe.push_to_hub(ds_path, repo, quiet=True)
    files = hub.files(repo)
    assert f"saev/{saev.name}/metadata.json" in files and "sae/tiny-sae/meta.json" in files
    assert "sae/tiny-sae/layer_3/encoder.npz" in files
    card = files["README.md"].data.decode()
    assert "Also in this repo" in card and "--only saev" in card and f"saev/{saev.name}" in card

    # the saev export alone
    start = len(hub.log)
    sv = SaevDataset(f"hf://datasets/{repo}/saev/{saev.name}")
    local = SaevDataset(saev)
    np.testing.assert_array_equal(sv.get(3, 3, 2), local.get(3, 3, 2))
    assert not _gets(hub, start, "/tensors/") and not _gets(hub, start, "/sae/")
    assert _gets(hub, start, "acts000000.bin") and not _gets(hub, start, "acts000001.bin")

    # the dictionary alone
    start = len(hub.log)
    remote = load_dictionary(SAEConfig(root_path=f"hf://datasets/{repo}/sae", dictionary_name="tiny-sae"))
    x = np.arange(6, dtype=np.float32)
    want = project_topk(load_dictionary(SAEConfig(root_path=ds_path / "sae", dictionary_name="tiny-sae")).get_layer(3), x, 5)
    assert project_topk(remote.get_layer(3), x, 5) == want
    assert not _gets(hub, start, "/tensors/") and not _gets(hub, start, "/saev/")

    # the dataset alone
    start = len(hub.log)
    ds = lmprobe.load(repo)
    ends = src["tok_start"][1:] - 1
    np.testing.assert_array_equal(ds.hidden(0), src["hidden"][0][ends])
    assert not _gets(hub, start, "/saev/") and not _gets(hub, start, "/sae/")
    attached = ds.info["attachments"]
    assert [x["path"] for x in attached["saev"]] == [f"saev/{saev.name}"]
    assert attached["sae"][0]["layers"] == [3]


def test_a_third_party_reading_the_index_sees_nothing_unexpected(hub, bundle, tmp_path):
    ds_path, _, _ = bundle
    before = pq.read_table(ds_path / "index/train-00000-of-00001.parquet")
    lmprobe.push_to_hub(ds_path, repo_name(), quiet=True)
    after = pq.read_table(ds_path / "index/train-00000-of-00001.parquet")
    assert after.equals(before)  # same rows and columns
    new_keys = set(after.schema.metadata) - set(before.schema.metadata)
    assert new_keys == {b"lmprobe:attachments"}
    for k in before.schema.metadata:
        assert after.schema.metadata[k] == before.schema.metadata[k]
    from lmprobe.format.validate import validate

    assert validate(ds_path).ok


def test_pull_only_one_part(hub, bundle, tmp_path):
    ds_path, _, saev = bundle
    repo = repo_name()
    lmprobe.push_to_hub(ds_path, repo, quiet=True)
    assert cli_main(["pull", repo, "--only", "saev", "--out", str(tmp_path / "p"), "--quiet"]) == 0
    got = sorted(p.relative_to(tmp_path / "p").as_posix() for p in (tmp_path / "p").rglob("*")
                 if p.is_file() and p.name != ".lmprobe-pull.json")  # where the part came from, for a re-run
    assert got and all(g.startswith(f"saev/{saev.name}/") for g in got)
    assert SaevDataset(tmp_path / "p/saev" / saev.name).n_ex == SaevDataset(saev).n_ex
    assert cli_main(["pull", repo, "--only", "sae", "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert load_dictionary(SAEConfig(root_path=tmp_path / "q/sae", dictionary_name="tiny-sae")).layers == [3]
    # a part goes into a new or empty folder, or a copy of the same repo, never over the user's own files
    assert cli_main(["pull", repo, "--only", "saev", "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert cli_main(["pull", repo_name_of_other(hub, ds_path), "--only", "sae", "--out", str(tmp_path / "q"),
                     "--quiet"]) == 2
    assert load_dictionary(SAEConfig(root_path=tmp_path / "q/sae", dictionary_name="tiny-sae")).layers == [3]


@pytest.mark.slow
def test_export_commands_push_into_the_dataset_repo(hub, tmp_path, rng):
    ds_path = tmp_path / "ds"
    write_dataset(ds_path, rng, n=10, layers=(1,), dim=4, storage="full_sequence", min_tokens=3, max_tokens=6,
                  token_ids=True)
    repo = repo_name()
    lmprobe.push_to_hub(ds_path, repo, quiet=True)
    assert cli_main(["export-saev", repo, "--out", str(tmp_path / "dump"), "--context-len", "3", "--push", repo,
                     "--quiet"]) == 0
    W = rng.normal(size=(4, 9)).astype(np.float32)
    np.savez(tmp_path / "enc.npz", w=W, b=np.zeros(9, np.float32))
    assert cli_main(["export-sae", str(tmp_path / "enc.npz"), "--weight-key", "w", "--bias-key", "b", "--layer", "1",
                     "--root", str(tmp_path / "sae"), "--dict", "d1", "--push", repo, "--repo-type", "dataset"]) == 0
    ds = lmprobe.load(repo)
    attached = ds.info["attachments"]
    assert len(attached["saev"]) == 1 and attached["sae"][0]["path"] == "sae/d1"
    name = attached["saev"][0]["path"].split("/")[1]
    sv = SaevDataset(f"hf://datasets/{repo}/saev/{name}")
    assert sv.layers == [1] and sv.tokens_per_ex == 3
    card = hub.files(repo)["README.md"].data.decode()
    assert "sae/d1" in card and name in card
    json.loads(json.dumps(attached))


def test_push_flags_copy_attachments_in(hub, tmp_path, rng):
    ds_path = tmp_path / "ds"
    write_dataset(ds_path, rng, n=8, layers=(0,), dim=4, storage="full_sequence", min_tokens=3, max_tokens=6,
                  token_ids=True)
    saev = export_saev(ds_path, tmp_path / "elsewhere", context_len=3, quiet=True)
    repo = repo_name()
    assert cli_main(["push", str(ds_path), repo, "--saev", str(saev), "--quiet"]) == 0
    assert (ds_path / "saev" / saev.name / "metadata.json").exists()
    assert f"saev/{saev.name}/acts000000.bin" in hub.files(repo)


def test_validate_checks_recorded_attachments(hub, bundle):
    from lmprobe import validate
    from lmprobe.publish.attachments import attach, scan_attachments

    ds_path, _, saev = bundle
    attach(ds_path, scan_attachments(ds_path))
    assert validate(ds_path).ok
    (saev / "acts000000.bin").write_bytes(b"\0")
    rep = validate(ds_path)
    assert not rep.ok and any("acts000000.bin is 1 bytes" in e for e in rep.errors)


def test_info_lists_the_parts_published_beside_the_dataset(hub, bundle, capsys):
    ds_path, _, saev = bundle
    repo = repo_name()
    lmprobe.push_to_hub(ds_path, repo, quiet=True)
    for where in (str(ds_path), repo):
        assert cli_main(["info", where]) == 0
        out = capsys.readouterr().out
        assert f"saev/        saev/{saev.name}/: saev export (layers [3], " in out
        assert "sae/         sae/tiny-sae/: SAE dictionary (layers [3], 20 features)" in out


def test_a_saev_export_of_replaced_data_is_not_published_beside_it(hub, tmp_path, rng, capsys):
    """export-saev into DS/saev, then `extract --overwrite` with other prompts: the export no longer belongs to DS;
    validate, push and export-saev --push say so instead of publishing it."""
    import shutil

    ds_path = tmp_path / "ds"
    kw = dict(n=12, layers=(0,), dim=4, storage="full_sequence", min_tokens=3, max_tokens=6)
    write_dataset(ds_path, rng, **kw)
    saev = export_saev(ds_path, ds_path / "saev", layers=[0], context_len=3, patches_per_shard=30, quiet=True)
    shutil.copytree(saev, tmp_path / "kept" / saev.name)
    assert lmprobe.validate(ds_path).ok
    write_dataset(ds_path, rng, overwrite=True, **kw)  # the dataset re-extracted in place, other values
    assert saev.exists()  # the export is the user's: not deleted, but it describes the old data
    assert cli_main(["validate", str(ds_path)]) == 1
    out = capsys.readouterr().out
    assert f"saev/{saev.name}" in out and "another dataset, or an earlier version of this one" in out, out
    repo = repo_name()
    assert cli_main(["push", str(ds_path), repo, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "export-saev" in err and len(err.splitlines()) == 1, err
    assert ("dataset", repo) not in hub.state.repos  # refused before anything was sent
    shutil.rmtree(saev)
    assert cli_main(["push", str(ds_path), repo, "--quiet"]) == 0
    # publishing the old export beside the new data in the Hub repo is refused too
    assert cli_main(["push", str(ds_path), repo, "--quiet", "--saev", str(tmp_path / "kept" / saev.name)]) == 2
    assert "export-saev" in capsys.readouterr().err
    with pytest.raises(AttachmentError, match="another dataset"):  # export-saev --push: into the repo directly
        publish_attachment(repo, tmp_path / "kept" / saev.name, "saev")
    assert not any(f.startswith("saev/") for f in hub.files(repo))
    # an export of the data as it is now validates and publishes
    fresh = export_saev(ds_path, ds_path / "saev", layers=[0], context_len=3, patches_per_shard=30, quiet=True)
    assert lmprobe.validate(ds_path).ok
    assert cli_main(["push", str(ds_path), repo, "--quiet"]) == 0
    assert f"saev/{fresh.name}/metadata.json" in hub.files(repo)


def test_copying_an_attachment_never_deletes_its_source(tmp_path, rng, monkeypatch, hub):
    from lmprobe.saev import export_saev

    ds = tmp_path / "ds"
    write_dataset(ds, rng, n=8, storage="full_sequence", token_ids=True)
    first = export_saev(ds, ds / "saev", context_len=2, quiet=True)
    second = export_saev(ds, ds / "saev", context_len=3, quiet=True)
    monkeypatch.chdir(first)
    assert cli_main(["push", str(ds), "tester/saev-dot", "--saev", ".", "--quiet"]) == 0
    assert (first / "metadata.json").exists() and (second / "metadata.json").exists()
    monkeypatch.chdir(ds / "saev")
    assert cli_main(["push", str(ds), "tester/saev-dotdot", "--saev", "..", "--quiet"]) == 2
    assert (ds / INDEX).exists() and (first / "metadata.json").exists()


def test_the_owners_card_text_survives_a_push_with_attachments(tmp_path, rng, hub):
    from lmprobe.saev import export_saev

    ds = tmp_path / "ds"
    write_dataset(ds, rng, n=8, storage="full_sequence", token_ids=True)
    card = (ds / "README.md").read_text()
    (ds / "README.md").write_text(card + "\n## Notes by the owner\n\nCollected from our lab's prompts.\n")
    saev = export_saev(ds, tmp_path / "saev", context_len=2, quiet=True)
    assert cli_main(["push", str(ds), "tester/card-kept", "--saev", str(saev), "--quiet"]) == 0
    text = (ds / "README.md").read_text()
    assert "Collected from our lab's prompts." in text and "saev protocol 2.0 export" in text
    assert text.count("# Activations of") == 1
    assert "Collected from our lab's prompts." in hub.read("tester/card-kept", "README.md").decode()


def test_export_saev_push_keeps_the_repos_card(tmp_path, rng, hub):
    ds = tmp_path / "ds"
    write_dataset(ds, rng, n=8, storage="full_sequence", token_ids=True)
    (ds / "README.md").write_text((ds / "README.md").read_text() + "\nOwner's words.\n")
    lmprobe.push_to_hub(ds, "tester/card-hub", quiet=True)
    assert cli_main(["export-saev", str(ds), "--out", str(tmp_path / "dump"), "--context-len", "2", "--push",
                     "tester/card-hub", "--quiet"]) == 0
    text = hub.read("tester/card-hub", "README.md").decode()
    assert "Owner's words." in text and "saev protocol 2.0 export" in text
