"""Shared fixtures. Tests run offline: HF_HOME in a temporary folder, no token, no network."""

from __future__ import annotations

import os

# Set before huggingface_hub/datasets/transformers are imported by any test module.
import socket  # noqa: E402
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Subprocesses (python -m lmprobe, -m tests.hub_server) import this checkout, from whichever folder they start in.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
_HF_HOME = tempfile.mkdtemp(prefix="lmprobe-test-hf-")
os.environ["HF_HOME"] = _HF_HOME
os.environ["LMPROBE_CACHE"] = tempfile.mkdtemp(prefix="lmprobe-test-cache-")  # object-store and stream caches
# Every Hub request goes to the test server on 127.0.0.1 (tests/hub_server.py), never out.
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    HUB_PORT = _s.getsockname()[1]
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{HUB_PORT}"
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
    os.environ.pop(_var, None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

# Property tests: derandomized in CI (the same examples every run, plus the @example rows of every
# failure ever found); random exploration locally. HYPOTHESIS_PROFILE=ci reproduces CI's run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
# (the example database lives in the checkout: every test runs in an empty folder of its own, below)
settings.register_profile("dev", deadline=None,
                          database=DirectoryBasedExampleDatabase(str(ROOT / ".hypothesis" / "examples")))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

DATA = Path(__file__).parent / "data"
FIXTURE_0103 = DATA / "lmprobe-0.10.3-pooled"
FIXTURE_0103_FULL = DATA / "lmprobe-0.10.3-full_sequence"  # per-token columns, written left-padded


@pytest.fixture(autouse=True)
def _empty_working_folder(tmp_path_factory, monkeypatch):
    """Every test starts in an empty folder of its own, so that what the folder pytest runs in holds (the
    `out/` that the README's first command leaves, say) cannot change a result. Repository files are
    reached through ROOT; a test that needs another working folder changes to it itself."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_prompts(rng, n: int, *, max_tokens: int = 9, min_tokens: int = 1):
    n_tok = rng.integers(min_tokens, max_tokens + 1, size=n)
    texts = [f"prompt {i} " + "x" * int(t) for i, t in enumerate(n_tok)]
    return texts, n_tok


def write_dataset(out, rng, *, n=23, layers=(0, 2, 5), dim=8, storage="pooled", shard_size=5 * 32, batch=7,
                  logits_topk=None, dtype="float32", max_tokens=9, min_tokens=1, **kw):
    """Write a random dataset in batches; return the arrays that went in (for comparisons)."""
    from lmprobe.format.writer import DatasetWriter

    texts, n_tok = make_prompts(rng, n, max_tokens=max_tokens, min_tokens=min_tokens)
    labels = rng.integers(0, 3, size=n)
    full = storage == "full_sequence"
    rows = int(n_tok.sum()) if full else n
    hidden = {layer: rng.normal(size=(rows, dim)).astype(np.float32) for layer in layers}
    lv = -np.sort(-rng.normal(size=(n, logits_topk)).astype(np.float32), axis=1) if logits_topk else None
    li = rng.integers(0, 1000, size=(n, logits_topk)) if logits_topk else None
    tok_start = np.concatenate([[0], np.cumsum(n_tok)])
    kw.setdefault("label_type", "int")
    kw.setdefault("columns", {"source": "string", "idx": "int64"})
    w = DatasetWriter(out, layers=list(layers), dim=dim, model_name="test/model", storage=storage,
                      shard_size=shard_size, logits_topk=logits_topk, dtype=dtype, **kw)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        if full:
            hb = {layer: h[tok_start[s]:tok_start[e]] for layer, h in hidden.items()}
        else:
            hb = {layer: h[s:e] for layer, h in hidden.items()}
        extra = {}
        if logits_topk:
            extra = {"logits_values": lv[s:e], "logits_indices": li[s:e]}
        if kw.get("token_ids"):
            extra["token_ids"] = [list(range(int(t))) for t in n_tok[s:e]]  # token j of a prompt has id j
        w.add_batch(texts=texts[s:e], num_tokens=n_tok[s:e], hidden=hb, labels=labels[s:e].tolist(),
                    columns={"source": [f"src{i % 2}" for i in range(s, e)], "idx": list(range(s, e))}
                    if "source" in (kw["columns"] or {}) else None, **extra)
    w.close()
    return {"texts": texts, "n_tok": n_tok, "labels": labels, "hidden": hidden, "lv": lv, "li": li,
            "tok_start": tok_start}


def edit_index_column(root, name, edit):
    """Rewrite one index column (keeping the schema metadata): ``edit(list) -> list``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "index/train-00000-of-00001.parquet"
    table = pq.read_table(path)
    field = table.schema.field(name)
    values = edit(table.column(name).to_pylist())
    table = table.set_column(table.column_names.index(name), field, pa.array(values, field.type))
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from tiny_models import build_llama

    return build_llama(tmp_path_factory.mktemp("llama"), padding_side="left")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    from tiny_models import build_gpt2

    return build_gpt2(tmp_path_factory.mktemp("gpt2"), padding_side="right")


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    from tiny_models import build_bert

    return build_bert(tmp_path_factory.mktemp("bert"))


PROMPTS = [
    {"text": "The cat sat on the mat.", "label": 1, "source": "a"},
    {"text": "A dog.", "label": 0, "source": "b"},
    {"text": "Interpretability researchers study the activations of language models every single day.", "label": 1,
     "source": "a"},
    {"text": "Hi", "label": 0, "source": "c"},
    {"text": "This was a terrible meal, cold and far too salty, said she.", "label": 0, "source": "b"},
    {"text": "Sunny today.", "label": 1, "source": "a"},
    {"text": "Numbers like 12 and 345 appear in text as well as words.", "label": 1, "source": "c"},
]


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """The local Hub server; HF_ENDPOINT already points at it."""
    from hub_server import HubServer

    server = HubServer(tmp_path_factory.mktemp("hub"), port=HUB_PORT).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_hf_cache(tmp_path, monkeypatch):
    """A cache of its own, so that a test sees exactly the downloads it causes."""
    import huggingface_hub.constants as c

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with a bucket "acts"; AWS_ENDPOINT_URL points at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ["LMPROBE_CACHE"] = str(tmp_path_factory.mktemp("lmprobe-cache"))
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="acts")
    yield env["AWS_ENDPOINT_URL"]
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def messages():
    """The lmprobe logger's INFO messages shown, as under the command line (the library alone is quiet)."""
    from lmprobe.base.progress import messages_shown

    with messages_shown():
        yield
