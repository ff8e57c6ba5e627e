"""One commit budget for a job: commits grow along huggingface_hub's ladder and keep to one
sliding hourly window, against the local Hub test server enforcing the Hub's commit rate on a scaled clock."""

from __future__ import annotations

import re
import time
import uuid

import pytest

from lmprobe.errors import InvalidArgumentError
from lmprobe.storage.budget import hour_seconds
from lmprobe.storage.commits import HubCommitter, PushConfig, RepoFile


@pytest.fixture
def limited_hub(hub):
    yield hub
    hub.limit_commits(None)


def _commits(hub, repo_id):
    return [(t, summary) for r, t, summary in hub.state.commit_log if r == repo_id]


def _files(tmp_path, n):
    out = []
    for i in range(n):
        p = tmp_path / f"f{i:04d}.safetensors"
        p.write_bytes(i.to_bytes(4, "little") * 8)
        out.append(RepoFile(f"data/f{i:04d}.safetensors", p))
    return out


def test_commits_keep_to_the_jobs_window_and_the_hub_never_refuses_one(limited_hub, tmp_path, monkeypatch):
    """3 commits an "hour" of 2 s, enforced by the server as the Hub does: 6 commits take more than an hour of the
    scaled clock, no 4 of them fall in one hour, and none is answered 429."""
    hub = limited_hub
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "2")
    hub.limit_commits(3, hour=2)
    repo = f"user/window-{uuid.uuid4().hex[:6]}"
    c = HubCommitter(repo, token=None, config=PushConfig(commit_files=1, commits_per_hour=3))
    c.prepare(private=False)
    c.push_files(_files(tmp_path, 6), last=[])
    times = [t for t, _ in _commits(hub, repo)]
    assert len(times) == 6 and hub.state.refused_commits == 0
    assert all(b - a >= 2 - 0.05 for a, b in zip(times, times[3:], strict=False)), times


def test_the_server_refuses_commits_past_its_rate_and_a_committer_waits_them_out(limited_hub, tmp_path, monkeypatch):
    """A committer that believes in a higher rate than the repo has (another writer shares it) is answered 429 with
    a Retry-After, waits, and lands every file."""
    hub = limited_hub
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "1")
    hub.limit_commits(2, hour=1)
    repo = f"user/refused-{uuid.uuid4().hex[:6]}"
    c = HubCommitter(repo, token=None, config=PushConfig(commit_files=1, commits_per_hour=100, base_wait=0.01))
    c.prepare(private=False)
    c.push_files(_files(tmp_path, 4), last=[])
    assert hub.state.refused_commits > 0
    assert len([p for p in hub.files(repo) if p.startswith("data/")]) == 4


def test_commits_climb_huggingface_hubs_ladder(hub, tmp_path):
    """700 files, every commit fast: 250 first, then 400, then the rest, not 14 commits of 50."""
    repo = f"user/ladder-{uuid.uuid4().hex[:6]}"
    c = HubCommitter(repo, token=None)
    c.prepare(private=False)
    c.push_files(_files(tmp_path, 700), last=[])
    sizes = [int(m.group(1)) for _, s in _commits(hub, repo) if (m := re.search(r"(\d+) \w* ?file", s))]
    assert sum(sizes) == 700 and sizes[0] == 250 and len(sizes) == 3 and max(sizes) <= 400, sizes


def test_the_hubs_hour_is_a_test_knob_with_a_one_line_error(monkeypatch):
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "60")
    assert hour_seconds() == 60
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "soon")
    with pytest.raises(InvalidArgumentError, match="LMPROBE_HUB_HOUR_SECONDS='soon'"):
        hour_seconds()


def test_a_commit_waits_for_the_window_not_for_a_fixed_spacing(hub, tmp_path, monkeypatch):
    """Within the window's budget commits go at once (the old per-rank spacing made each wait its turn)."""
    monkeypatch.setenv("LMPROBE_HUB_HOUR_SECONDS", "100")
    repo = f"user/burst-{uuid.uuid4().hex[:6]}"
    c = HubCommitter(repo, token=None, config=PushConfig(commit_files=1, commits_per_hour=50))
    c.prepare(private=False)
    t0 = time.monotonic()
    c.push_files(_files(tmp_path, 5), last=[])
    assert time.monotonic() - t0 < 10 and c.commits == 5


def test_the_ranks_of_a_job_upload_and_one_committer_commits_for_all(hub, tmp_path):
    """Three "ranks" (threads, one store as torchrun's c10d store): each uploads its own files and hands their records
    over; every commit is the job committer's, with files of several ranks in one commit along the ladder; each
    rank's last group (its index, a rename) lands whole, after its files; each rank is told when its files landed."""
    import threading

    import torch.distributed as dist

    from lmprobe.storage.relay import StoreRelay

    store, world = dist.HashStore(), 3
    repo = f"user/relay-{uuid.uuid4().hex[:6]}"
    job = HubCommitter(repo, token=None, commit_for=StoreRelay(store, rank=0, world=world))
    job.prepare(private=False)
    job.start()
    landed: dict[int, list[str]] = {r: [] for r in range(world)}
    results, errors = {}, []

    def rank(r):
        try:
            folder = tmp_path / f"rank{r}"
            folder.mkdir()
            files = _files(folder, 200)
            for f in files:
                f.rel = f"parts/{r}/{f.rel}"
            index = folder / "index.parquet"
            index.write_bytes(b"index of %d" % r)
            c = HubCommitter(repo, token=None, send_to=StoreRelay(store, rank=r, world=world),
                             on_landed=lambda fs: landed[r].extend(f.rel for f in fs), under=f"parts/{r}")
            c.start()
            for f in files[:-1]:
                c.add(f)
            c.add(RepoFile(f"parts/{r}/tmp/last.safetensors", files[-1].local))
            results[r] = c.finish([RepoFile(f"parts/{r}/index.parquet", index)],
                                  moves=[(f"parts/{r}/tmp/last.safetensors", files[-1].rel)])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    job.finish()
    tree = hub.files(repo)
    for r in range(world):
        assert len([p for p in tree if p.startswith(f"parts/{r}/data/")]) == 200
        assert f"parts/{r}/index.parquet" in tree and f"parts/{r}/tmp/last.safetensors" not in tree
        assert len(landed[r]) == 200  # told of every file it added (the renamed one under its provisional name)
        assert results[r].commits == 0
    log = _commits(hub, repo)
    # 603 files and 3 renames: 250, 400, the rest, and the partial commits a rank waiting for its files asks for
    assert len(log) == job.commits <= 6, [s for _, s in log]


def test_a_failed_job_committer_is_an_error_on_every_rank_not_a_wait(tmp_path):
    """The job's committer fails (here: a record naming a path outside the repo): a rank waiting for its files to
    land gets a PushError naming it instead of waiting for ever."""
    import torch.distributed as dist

    from lmprobe.errors import PushError
    from lmprobe.storage.relay import StoreRelay

    store = dist.HashStore()
    sender, committer = StoreRelay(store, rank=1, world=2), StoreRelay(store, rank=0, world=2)
    sender.send({"files": [{"rel": "../outside", "size": 1, "sha256": "0" * 64}]})
    c = HubCommitter("user/never", token=None, commit_for=committer)
    from lmprobe.storage import commits

    with pytest.raises(PushError, match="relayed file"):
        commits._group_item(*committer.receive()[0])
    c._fail(PushError("rank 1 sent a malformed commit record"))
    with pytest.raises(PushError, match="the job's committer \\(rank 0\\) failed: rank 1 sent a malformed"):
        sender.landed()
