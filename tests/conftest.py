"""Shared fixtures; the helpers tests import live in tests/support/. Tests run offline: HF_HOME in a temporary
folder, no token, no network."""

from __future__ import annotations

import os

# Set before huggingface_hub/datasets/transformers are imported by any test module.
import socket  # noqa: E402
import tempfile

from support.paths import ROOT

# Subprocesses (python -m lmprobe, -m tests.support.hub_server) import this checkout, from whichever folder they
# start in.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
_HF_HOME = tempfile.mkdtemp(prefix="lmprobe-test-hf-")
os.environ["HF_HOME"] = _HF_HOME
os.environ["LMPROBE_CACHE"] = tempfile.mkdtemp(prefix="lmprobe-test-cache-")  # object-store and stream caches
# Every Hub request goes to the test server on 127.0.0.1 (tests/support/hub_server.py), never out.
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


@pytest.fixture(autouse=True)
def _empty_working_folder(tmp_path_factory, monkeypatch):
    """Every test starts in an empty folder of its own, so that what the folder pytest runs in holds (the
    `out/` that the README's first command leaves, say) cannot change a result. Repository files are
    reached through ROOT; a test that needs another working folder changes to it itself."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from support.tiny_models import build_llama

    return build_llama(tmp_path_factory.mktemp("llama"), padding_side="left")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    from support.tiny_models import build_gpt2

    return build_gpt2(tmp_path_factory.mktemp("gpt2"), padding_side="right")


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    from support.tiny_models import build_bert

    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """The local Hub server; HF_ENDPOINT already points at it."""
    from support.hub_server import HubServer

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
