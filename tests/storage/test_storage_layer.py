"""Storage is one folder: the files protocol lists what readers call, every source implements it, URL schemes are
parsed in one module, and a dictionary or a saev folder in object storage (moto on 127.0.0.1) loads like a local one."""

from __future__ import annotations

import ast
import inspect
import re
import uuid
from pathlib import Path

import pytest
from support.paths import ROOT

from lmprobe.errors import DictionaryError, SaevError
from lmprobe.format.files import DatasetFiles, LocalFiles

PACKAGE = ROOT / "lmprobe"


def protocol_members() -> set[str]:
    names = {n for n in vars(DatasetFiles) if not n.startswith("_")}
    return names | set(inspect.get_annotations(DatasetFiles))


def test_the_files_protocol_lists_what_readers_call():
    """Every member a reader asks of a dataset's files (``ds.files.X``, ``self.files.X`` in the Dataset, the gather's
    ``self._files.X``) is in DatasetFiles, so a new source knows all it must offer."""
    wanted = protocol_members()
    assert {"fetch", "missing_hint", "has", "pin", "read_range", "download", "remote", "origin"} <= wanted
    called: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "storage" and path.name in ("lrufiles.py",):  # the wrapper: its own .files
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("files", "_files"):
                called.setdefault(node.attr, f"{path.relative_to(PACKAGE)}:{node.lineno}")
    # merge.py reads ``root`` only after isinstance(ds.files, LocalFiles): a local folder's own member
    called.pop("root", None)
    missing = {name: where for name, where in called.items() if name not in wanted}
    assert not missing, f"readers call members DatasetFiles does not list: {missing}"


@pytest.mark.parametrize("source", ["local", "hub", "object_store"])
def test_every_source_implements_the_protocol(source):
    from lmprobe.storage.hub import HubFiles
    from lmprobe.storage.objectstore import ObjectStoreFiles

    cls = {"local": LocalFiles, "hub": HubFiles, "object_store": ObjectStoreFiles}[source]
    absent = sorted(n for n in protocol_members() if not hasattr(cls, n))
    assert not absent, f"{cls.__name__} lacks {absent}"


def test_local_files_read_ranges_and_pin(tmp_path):
    (tmp_path / "tensors").mkdir()
    (tmp_path / "tensors" / "a.bin").write_bytes(bytes(range(16)))
    files = LocalFiles(tmp_path)
    files.pin()
    assert not files.remote and files.origin is None
    assert files.has("tensors/a.bin") and not files.has("tensors/b.bin")
    assert files.read_range("tensors/a.bin", 4, 8) == bytes([4, 5, 6, 7])
    out = tmp_path / "out.bin"
    with open(out, "wb") as f:
        assert files.read_range("tensors/a.bin", 10, 12, out=f) is None
    assert out.read_bytes() == bytes([10, 11])
    files.download("tensors/a.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == bytes(range(16))


#: a literal that is a bare scheme prefix ("hf://", "s3://") or the separator ("://"): what a module compares or
#: cuts a string with
_SCHEME_PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)?://")
#: modules that look at web links (a page's href), not at storage
_WEB_MODULES = ("pages/features.py",)
#: web links (a page's href), not storage
_WEB = ("http://", "https://")


def test_url_schemes_are_parsed_in_one_module():
    """``storage/urls.py`` is the one module that splits or compares a scheme: elsewhere a bare scheme prefix
    (``startswith("hf://")``, ``removeprefix("s3://")``, ``len("hf://")``) is a second grammar. Messages, docstrings
    and f-strings that build a URL (``f"hf://{path}"``) may name a scheme."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "storage" / "urls.py" or path.relative_to(PACKAGE).as_posix() in _WEB_MODULES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        built = {id(c) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for c in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in built \
                    and _SCHEME_PREFIX.fullmatch(node.value) and node.value not in _WEB:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not found, f"a scheme parsed outside lmprobe/storage/urls.py (call remote_of, is_hub_url, hub_path): {found}"


@pytest.mark.parametrize(("text", "remote"), [
    ("hf://datasets/me/acts", "hub"), ("hf://me/sae", "hub"), ("s3://bucket/run", "object"),
    ("gs://bucket/run", "object"), ("memory://x", "object"), ("file:///tmp/x", "local"), ("out/acts", "local"),
    ("me/acts", "local"), ("/abs/path", "local"),
])
def test_remote_of_names_the_storage(text, remote):
    from lmprobe.storage.urls import remote_of

    assert remote_of(text) == remote
    assert remote_of(Path(text)) == remote or "://" in text  # a Path collapses "//"


def _upload(local: Path, url: str) -> None:
    """Copy a local folder to an object-storage prefix, file by file (as a user's `aws s3 cp --recursive`)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{url.removeprefix('s3://')}/{p.relative_to(local).as_posix()}")


def test_a_dictionary_in_object_storage_loads_and_validates(s3, tmp_path, rng):
    import numpy as np

    from lmprobe.sae import SAEConfig, load_dictionary, project_topk, validate_dictionary
    from lmprobe.sae.export import export_sae

    for layer in (0, 3):
        W = rng.normal(size=(40, 24)).astype(np.float32)
        export_sae(layer=layer, root=tmp_path / "saes", dictionary="d", W_enc=W, b_enc=np.zeros(40, np.float32),
                   threshold=0.2)
    url = f"s3://acts/saes-{uuid.uuid4().hex[:6]}"
    _upload(tmp_path / "saes", url)
    remote = load_dictionary(SAEConfig(root_path=url, dictionary_name="d", device="cpu"))
    local = load_dictionary(SAEConfig(root_path=tmp_path / "saes", dictionary_name="d", device="cpu"))
    assert remote.layers == local.layers == [0, 3]
    x = rng.normal(size=24)
    assert project_topk(remote.get_layer(3), x, 6) == project_topk(local.get_layer(3), x, 6)
    assert validate_dictionary(url, "d") == []
    with pytest.raises(DictionaryError, match="meta.json is missing"):
        load_dictionary(SAEConfig(root_path=url, dictionary_name="absent", device="cpu"))


def test_a_saev_folder_in_object_storage_loads_and_validates(s3, tmp_path, rng):
    import numpy as np
    from support.datasets import write_dataset

    from lmprobe.saev import SaevDataset, export_saev

    write_dataset(tmp_path / "ds", rng, n=12, layers=(1, 4), dim=6, storage="full_sequence", shard_size="2KB",
                  min_tokens=3, max_tokens=9, token_ids=True)
    out = export_saev(tmp_path / "ds", tmp_path / "dump", context_len=4, patches_per_shard=4 * 4 * 2, quiet=True)
    url = f"s3://acts/dump-{uuid.uuid4().hex[:6]}/{out.name}"
    _upload(out, url)
    local, remote = SaevDataset(out), SaevDataset(url)  # opening one validates it
    assert (remote.n_ex, remote.layers, remote.d_model) == (local.n_ex, local.layers, local.d_model)
    for ex in (0, local.n_ex - 1):
        np.testing.assert_array_equal(remote.get(ex, 4, 2), local.get(ex, 4, 2))
    np.testing.assert_array_equal(remote.tokens(), local.tokens())
    np.testing.assert_array_equal(remote.labels(), local.labels())
    # a folder whose name is not its metadata's hash is refused, as a local one is
    moved = f"s3://acts/dump-{uuid.uuid4().hex[:6]}/not-the-hash"
    _upload(out, moved)
    with pytest.raises(SaevError, match="is not the sha256 of metadata.json"):
        SaevDataset(moved)
