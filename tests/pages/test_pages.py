"""Pages a person looks at: the dataset report, the feature cache and browser, rich notebook display.

Pages are opened in a real headless Chromium (Debian's package; .ci/run installs it): they must
render with no script error and show what they promise. Each page's screenshot is kept under
tests/_screenshots/ for a person to look at.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.artefacts import random_dictionary
from support.datasets import write_dataset
from support.paths import ROOT, TESTS

import lmprobe
from lmprobe.base.html import page
from lmprobe.errors import InvalidArgumentError
from lmprobe.format.writer import DatasetWriter
from lmprobe.pages.features import FeatureCache
from lmprobe.tensors import load_file

SHOTS = TESTS / "_screenshots"
HOSTILE = 'Nice <script>document.title="pwned"</script> & <img src=x onerror=alert(1)> \x1b[31m'


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "these tests need Chromium: apt-get install chromium (.ci/run installs it)"
    return exe


def render(path: Path, name: str, *, height: int = 1600, fragment: str = "") -> str:
    """The page's DOM after its scripts ran, and a screenshot in tests/_screenshots/NAME.png."""
    SHOTS.mkdir(exist_ok=True)
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--no-first-run", "--virtual-time-budget=3000"]
    uri = path.resolve().as_uri() + fragment
    dom = subprocess.run(base + ["--dump-dom", uri], capture_output=True, text=True, timeout=120).stdout
    shot = SHOTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    subprocess.run(base + [f"--window-size=1200,{height}", f"--screenshot={shot}", uri], capture_output=True,
                   timeout=120)
    assert shot.stat().st_size > 10_000, f"no screenshot of {path}"
    return dom


def assert_clean(dom: str) -> None:
    assert 'data-rendered="ok"' in dom, "the page's script did not finish"
    assert "data-errors" not in dom, re.findall(r'data-errors="[^"]*"', dom)
    # self-contained: nothing is fetched at view time
    assert not re.search(r'<(script|img|link|iframe)[^>]+(src|href)="(https?:)?//', dom)


def assert_round_ticks(dom: str) -> int:
    """Every chart's y ticks step by 1, 2 or 5 times a power of ten and sit on multiples of it; returns the charts."""
    charts = re.findall(r"<svg.*?</svg>", dom, flags=re.S)
    for svg in charts:
        ys = [float(v.replace(",", "")) for v in re.findall(r'class="ytick"[^>]*>([^<]*)<', svg)]
        assert len(ys) >= 3, svg[:200]
        steps = {round(b - a, 9) for a, b in zip(ys, ys[1:], strict=False)}
        assert len(steps) == 1, ys
        step = steps.pop()
        assert round(step / 10 ** math.floor(math.log10(step)), 6) in (1, 2, 5), ys
        assert all(abs(y / step - round(y / step)) < 1e-6 for y in ys), ys
    return len(charts)


def test_the_harness_sees_script_errors(tmp_path):
    (tmp_path / "bad.html").write_text(page("broken", "<script>notAFunction()</script>"))
    dom = render(tmp_path / "bad.html", "harness-broken")
    assert "data-errors" in dom and "notAFunction" in dom


@pytest.fixture(scope="module")
def tiny_ds(tmp_path_factory):
    """lmprobe-tiny over labelled prompts (one hostile), every token, perplexity and top-k logits."""
    prompts = [{"text": t, "label": i % 2} for i, t in enumerate([
        "The film was great.", "The service was terrible.", HOSTILE, "In the end our hotel was wonderful.",
        "Honestly, the trip was rude and I hated it.", "Everyone said the game was superb.",
        "The coffee was cold.", "I loved the book."])]
    out = tmp_path_factory.mktemp("pages") / "ds"
    return lmprobe.extract("lmprobe-tiny", prompts, out=out, storage="full_sequence", perplexity=True,
                           logits_topk=5, token_ids=True, quiet=True)


def test_report_renders_facts_plots_prompts_and_labels(tiny_ds, tmp_path):
    index = lmprobe.report(tiny_ds, tmp_path / "report", prompts="2", sample=3, quiet=True)
    dom = render(index, "report", height=3200)
    assert_clean(dom)
    for heading in ("Dataset", "Activations", "Prompts", "Labels"):
        assert f"<h2>{heading}</h2>" in dom
    for chart in ("Mean L2 norm by layer", "Per-dimension std by layer", "Norm by token position", "Label balance",
                  "Probe accuracy by layer"):
        assert f"<b>{chart}</b>" in dom
    assert dom.count("<svg") == 5
    assert assert_round_ticks(dom) == 5
    position_chart = re.search(r'aria-label="Norm by token position".*?</svg>', dom, flags=re.S).group(0)
    positions = re.findall(r'class="xtick"[^>]*>([^<]*)<', position_chart)
    assert positions and all(re.fullmatch(r"\d+", x) for x in positions), positions  # no 3.5 or 10.5
    assert "-fold cross-validated logistic regression" in dom
    assert re.search(r"Best probe: layer \d+, accuracy [\d.]+ ± [\d.]+; best baseline \w+ [\d.]+ on the same folds\. "
                     r"The probe beats (every|no) baseline", dom)
    assert dom.count('class="prompt"') == 4  # 3 sampled + the chosen one
    assert "perplexity" in dom and "next token, top 5 by logit: " in dom  # tokens by perplexity, top-k logits
    assert "lmprobe-tiny" in dom and "full_sequence" in dom
    # the hostile prompt is text, not markup
    assert "pwned" not in re.search(r"<title>(.*?)</title>", dom).group(1)
    assert "<script>document.title" not in dom and "<img" not in dom and "&lt;" in dom


def test_report_errors_are_clear_and_early(tiny_ds, tmp_path):
    with pytest.raises(InvalidArgumentError, match="prompt 99 does not exist"):
        lmprobe.report(tiny_ds, tmp_path / "r", prompts="99", quiet=True)
    assert not (tmp_path / "r").exists()


def test_report_of_a_hub_dataset(tiny_ds, tmp_path, hub, fresh_hf_cache):
    lmprobe.push_to_hub(tiny_ds.files.root, "me/pages", token="hf_testSECRETtoken1234567890", quiet=True)
    index = lmprobe.report("hf://datasets/me/pages", tmp_path / "r", sample=2, probe=False, quiet=True)
    assert_clean(render(index, "report-hub"))


def test_feature_cache_equals_brute_force(tiny_ds, tmp_path):
    layer = tiny_ds.layers[-1]
    W, b = random_dictionary(tiny_ds, tmp_path / "sae", layer)
    out = lmprobe.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "f", top=4, memory="40KB",
                           checkpoint_tokens=5, quiet=True)
    t = load_file(out / "features.safetensors")
    # brute force: every token's dense scores at once
    rows = [(p, i) for p in range(tiny_ds.num_prompts) for i in range(int(tiny_ds.token_lengths()[p]))]
    X = np.concatenate([tiny_ds.token_hidden(p, layer) for p in range(tiny_ds.num_prompts)])
    S = X @ W.T + b  # (tokens, features)
    np.testing.assert_allclose(t["frequency"], (S > 0).mean(axis=0))
    edges = t["histogram_edges"]  # each firing score counted once, in its log bin
    for f in range(W.shape[0]):
        fire = np.clip(S[S[:, f] > 0, f], edges[0], np.nextafter(edges[-1], 0))
        np.testing.assert_array_equal(t["histogram"][f], np.histogram(fire, bins=edges)[0])
    where = {r: i for i, r in enumerate(rows)}
    for f in range(W.shape[0]):
        fire = np.flatnonzero(S[:, f] > 0)
        best = sorted(fire, key=lambda r: (-S[r, f], rows[r]))[:4]
        n = len(best)
        # the top values are the brute-force ones; equal scores (the same first tokens in several prompts)
        # may come in either order, as matrix products of other shapes round them differently
        np.testing.assert_allclose(t["top_values"][f][:n], S[best, f], rtol=1e-5, atol=1e-6)
        got = list(zip(t["top_prompt"][f][:n].tolist(), t["top_token"][f][:n].tolist(), strict=True))
        assert len(set(got)) == n
        np.testing.assert_allclose([S[where[g], f] for g in got], t["top_values"][f][:n], rtol=1e-5, atol=1e-6)
        assert (t["top_prompt"][f][n:] == -1).all() and (t["top_token"][f][n:] == -1).all()
        assert (t["top_values"][f][n:] == 0).all()
        assert np.all(np.diff(t["top_values"][f][:n]) <= 0)
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer"] == layer and manifest["top"] == 4 and manifest["dictionary"] == "d"
    assert manifest["tokens"] == len(rows)


def test_running_top_n_does_not_depend_on_batching():
    rng = np.random.default_rng(1)
    S = rng.normal(size=(300, 20)).astype(np.float32)
    prompt, token = np.repeat(np.arange(30), 10), np.tile(np.arange(10), 30)
    one = FeatureCache(20, 7)
    one.add(S, prompt, token)
    many = FeatureCache(20, 7)
    for a in range(0, 300, 13):
        many.add(S[a : a + 13], prompt[a : a + 13], token[a : a + 13])
    for k, v in one.tensors().items():
        np.testing.assert_array_equal(v, many.tensors()[k], err_msg=k)


def test_an_interrupted_feature_run_resumes_to_the_same_cache(tiny_ds, tmp_path, monkeypatch):
    import lmprobe.pages.features as F

    layer = tiny_ds.layers[0]
    random_dictionary(tiny_ds, tmp_path / "sae", layer, seed=2)
    whole = F.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "a", top=3, memory="40KB", quiet=True,
                       checkpoint_tokens=5)
    calls = {"n": 0}
    real_add = F.FeatureCache.add

    def flaky(self, *a):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_add(self, *a)

    monkeypatch.setattr(F.FeatureCache, "add", flaky)
    with pytest.raises(KeyboardInterrupt):
        F.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "b", top=3, memory="40KB", quiet=True,
                   checkpoint_tokens=5)
    assert (tmp_path / "b" / ".features-partial.json").exists() and not (tmp_path / "b" / "manifest.json").exists()
    monkeypatch.setattr(F.FeatureCache, "add", real_add)
    F.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "b", top=3, memory="40KB", quiet=True,
               checkpoint_tokens=5)
    a, b = load_file(whole / "features.safetensors"), load_file(tmp_path / "b" / "features.safetensors")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def feature_setup(tmp_path_factory):
    from lmprobe.sae.export import export_sae

    root = tmp_path_factory.mktemp("features")
    rng = np.random.default_rng(3)
    write_dataset(root / "ds", rng, n=30, layers=(1,), dim=16, storage="full_sequence", shard_size="1KB",
                  token_ids=True)
    W = rng.normal(size=(24, 16)).astype(np.float32) / 4
    export_sae(layer=1, root=root / "sae", dictionary="d", W_enc=W, b_enc=np.full(24, 0.1, np.float32),
               orientation="out_in", activation="topk:4")
    ref = lmprobe.features(root / "ds", root / "sae", "d", 1, root / "ref", top=3, quiet=True)
    return root, ref


def _features(root, out, **kw):
    return lmprobe.features(root / "ds", root / "sae", "d", 1, out, top=3, quiet=True, **kw)


def _same_cache(a, b):
    from safetensors.numpy import load_file

    x, y = load_file(str(a / "features.safetensors")), load_file(str(b / "features.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _damage_cache(path, how):
    from safetensors.numpy import load_file, save_file

    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    else:
        t = load_file(str(path))
        if how == "no frequency":
            del t["frequency"]
        elif how == "wrong shape":
            t["top_values"] = t["top_values"][:, :2].copy()
        elif how == "wrong dtype":
            t["top_prompt"] = t["top_prompt"].astype(np.float32)
        elif how == "prompt out of range":
            t["top_prompt"][0, 0] = 10**6
        elif how == "token out of range":
            t["top_token"][0, 0] = 10**6
        elif how == "no histogram edges":
            del t["histogram_edges"]
        save_file(t, str(path))


@pytest.mark.parametrize("how", ["truncated", "empty", "deleted", "no frequency", "wrong shape", "wrong dtype",
                                 "prompt out of range", "token out of range", "no histogram edges"])
def test_a_damaged_feature_cache_is_computed_again(feature_setup, tmp_path, capsys, how):
    """A damaged feature cache, whatever the damage, is computed again, never trusted as complete (tracebacks)."""
    import shutil

    root, ref = feature_setup
    out = tmp_path / "f"
    shutil.copytree(ref, out)
    _damage_cache(out / "features.safetensors", how)
    _features(root, out)
    _same_cache(ref, out)
    assert "computing it again" in capsys.readouterr().err


@pytest.mark.parametrize("manifest", ["[1, 2]", '"x"', "{}", '{"tokens": -5}'])
def test_a_manifest_that_is_not_this_runs_object_is_computed_again_or_refused(feature_setup, tmp_path, manifest,
                                                                              capsys):
    import json
    import shutil

    root, ref = feature_setup
    out = tmp_path / "f"
    shutil.copytree(ref, out)
    good = json.loads((ref / "manifest.json").read_text())
    text = json.dumps({**good, **json.loads(manifest)}) if manifest.startswith('{"tokens"') else manifest
    (out / "manifest.json").write_text(text)
    _features(root, out)
    _same_cache(ref, out)
    assert json.loads((out / "manifest.json").read_text())["tokens"] == good["tokens"]


def _partial(root, ds, out, monkeypatch):
    """A run killed after its first checkpoint: its partial cache and state."""
    import lmprobe.pages.features as F

    real, calls = F.FeatureCache.add, {"n": 0}

    def dying(self, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(F.FeatureCache, "add", dying)
    with pytest.raises(KeyboardInterrupt):
        lmprobe.features(ds, root / "sae", "d", 1, out, top=3, quiet=True, memory="20KB", checkpoint_tokens=1)
    monkeypatch.setattr(F.FeatureCache, "add", real)
    assert (out / ".features-partial.json").exists()
    return out


@pytest.mark.parametrize("edit", [
    {"next_prompt": "x"}, {"next_prompt": None}, {"next_prompt": -5}, {"next_prompt": 1.5}, {"next_prompt": 10**6},
    {"next_prompt": 2**70}, "a list", "truncated cache", "float16 cache", "negative tokens_seen", "tokens_seen off",
])
def test_a_tampered_partial_feature_state_starts_over(feature_setup, tmp_path, monkeypatch, capsys, edit):
    import json

    from safetensors.numpy import load_file, save_file

    root, ref = feature_setup
    out = _partial(root, root / "ds", tmp_path / "p", monkeypatch)
    state, cache = out / ".features-partial.json", out / ".features-partial.safetensors"
    if isinstance(edit, dict):
        state.write_text(json.dumps({**json.loads(state.read_text()), **edit}))
    elif edit == "a list":
        state.write_text("[1]")
    elif edit == "truncated cache":
        cache.write_bytes(cache.read_bytes()[:100])
    else:
        t = load_file(str(cache))
        if edit == "float16 cache":
            t["values"] = t["values"].astype(np.float16)
        elif edit == "negative tokens_seen":
            t["tokens_seen"] = np.array([-2**40], dtype=np.int64)
        else:
            t["tokens_seen"] = t["tokens_seen"] + 1
        save_file(t, str(cache))
    _features(root, out)
    _same_cache(ref, out)
    assert "starting over" in capsys.readouterr().err


def test_a_partial_feature_state_over_a_rewritten_dataset_starts_over(feature_setup, tmp_path, monkeypatch):
    """The matrix found a partial cache resumed over a dataset rewritten in place (same path, same prompt count)."""
    import shutil

    root, _ = feature_setup
    ds = tmp_path / "ds"
    shutil.copytree(root / "ds", ds)
    out = _partial(root, ds, tmp_path / "p", monkeypatch)
    shutil.rmtree(ds)
    write_dataset(ds, np.random.default_rng(9), n=30, layers=(1,), dim=16, storage="full_sequence",
                  shard_size="1KB", token_ids=True)  # the same path and prompt count, other data
    fresh = lmprobe.features(ds, root / "sae", "d", 1, tmp_path / "fresh", top=3, quiet=True)
    lmprobe.features(ds, root / "sae", "d", 1, out, top=3, quiet=True)
    _same_cache(fresh, out)


def test_feature_browser_renders_index_and_pages(tiny_ds, tmp_path):
    layer = tiny_ds.layers[-1]
    W, b = random_dictionary(tiny_ds, tmp_path / "sae", layer)
    out = lmprobe.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "f", top=5, quiet=True)
    t = load_file(out / "features.safetensors")
    dom = render(out / "index.html", "features-index")
    assert_clean(dom)
    fired = int((t["frequency"] > 0).sum())
    assert dom.count('<a href="feature/') == fired
    assert "Feature density" in dom and '<figure class="chart histogram">' in dom and 'id="filter"' in dom
    percents = re.findall(r"<td>([^<]*%)</td>", dom)  # frequencies: 82%, 5.3%, 0.041%; not 34.1155%
    assert len(percents) == fired and all(len(re.sub(r"\D", "", p).lstrip("0")) <= 2 for p in percents), percents
    assert_round_ticks(dom)
    f = int(np.argmax(t["frequency"]))
    dom = render(out / "feature" / f"{f}.html", "feature-page")
    assert_clean(dom)
    # every top context is shown once: identical ones are one box naming the other prompts
    repeats = sum(len(m.split(",")) for m in re.findall(r"the same context in prompts? ([\d, ]+)<", dom))
    assert dom.count('class="prompt"') + repeats == int((t["top_prompt"][f] >= 0).sum())
    boxes = re.findall(r'<div class="toks">(.*?)</div>', dom, flags=re.S)
    assert len(set(boxes)) == len(boxes)
    assert dom.count('class="tok hit"') == dom.count('class="prompt"')  # the activating token, highlighted
    assert "background:rgba(44,160,44" in dom  # neighbours shaded by the feature's activation
    assert 'class="ell"> …</span>' in dom  # a context cut before its prompt's end says so
    assert '<figure class="chart histogram">' in dom and "Activation histogram" in dom
    bins = [int(n.replace(",", "")) for n in re.findall(r'class="bin"[^>]*><title>[^<]*: ([\d,]+)</title>', dom)]
    assert sum(bins) == round(t["frequency"][f] * int(tiny_ds.token_lengths().sum()))  # every firing token
    assert_round_ticks(dom)


def test_feature_index_filter_and_the_link_back_to_the_report(tiny_ds, tmp_path):
    layer = tiny_ds.layers[-1]
    random_dictionary(tiny_ds, tmp_path / "sae", layer)
    report = lmprobe.report(tiny_ds, tmp_path / "report", sample=1, probe=False, quiet=True)
    out = lmprobe.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "f", top=5, report=tmp_path / "report",
                           quiet=True)
    dom = render(out / "index.html", "features-index-filtered", fragment="#q=was")
    assert_clean(dom)
    rows = re.findall(r"<tr( style=\"display: none;\")?><td><a href=\"feature/\d+\.html\">\d+</a></td>(.*?)</tr>", dom)
    shown = [cells for hidden, cells in rows if not hidden]
    assert shown and len(shown) < len(rows) and all("was" in cells for cells in shown)
    assert re.search(r'id="filter-count"[^>]*>\d+ shown<', dom)
    f = re.search(r'<a href="feature/(\d+)\.html">', dom).group(1)
    dom = render(out / "index.html", "features-index-by-number", fragment=f"#q={f}")
    assert len(re.findall(r"<tr><td><a ", dom)) == 1  # a number finds that feature, not 1, 10, 12, ...
    # the filter text is only ever a value: markup in the address is not run
    dom = render(out / "index.html", "features-index-hostile", fragment="#q=%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E")
    assert_clean(dom)
    assert "<img" not in dom
    # the report, one click away from every page; the link resolves
    assert '<a href="../report/index.html">dataset report</a>' in (out / "index.html").read_text()
    page_html = (out / "feature" / f"{f}.html").read_text()
    assert '<a href="../../report/index.html">dataset report</a>' in page_html
    assert ((out / "feature" / "../../report/index.html").resolve()) == report.resolve()
    with pytest.raises(InvalidArgumentError, match="http"):
        lmprobe.features(tiny_ds, tmp_path / "sae", "d", layer, tmp_path / "f", report="javascript:alert(1)", quiet=True)


def test_contexts_are_cut_at_word_boundaries():
    from lmprobe.pages.features import context_window

    toks = ["<s>", "After", " a", " long", " day", ",", " the", " show", " was", " b", "rill", "iant", " and", " fun"]
    lo, hi = context_window(toks, 7, before=2, after=2)  # " show": 2 after ends inside " b|rill|iant"
    assert toks[lo:hi] == [",", " the", " show", " was", " b", "rill", "iant"]
    lo, hi = context_window(toks, 11, before=1, after=0)  # "iant": 1 before starts inside the word
    assert toks[lo:hi] == [" b", "rill", "iant"]
    assert context_window(toks, 1, before=5, after=20) == (0, len(toks))


def test_features_need_every_token(tmp_path, rng):
    with DatasetWriter(tmp_path / "pooled", layers=[0], dim=4, model_name="m") as w:
        w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 4))})
    with pytest.raises(InvalidArgumentError, match="pooled"):
        lmprobe.features(tmp_path / "pooled", tmp_path / "sae", "d", 0, tmp_path / "f", quiet=True)


def test_prompt_decodes_tokens_and_top_k_with_the_embedded_models_tokenizer(tiny_ds):
    from transformers import AutoTokenizer

    from lmprobe.base.tokenizer import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir("lmprobe-tiny"))
    p = tiny_ds.prompt(0)  # no tokenizer passed: the dataset's model is embedded, so it is here
    assert p.tokens == [tok.decode([t]) for t in p.token_ids]
    assert "".join(p.tokens).endswith("The film was great.")
    assert p.topk and not any(name.startswith("#") for name, _ in p.topk)


def test_notebook_display(tiny_ds, tmp_path):
    html = tiny_ds._repr_html_()
    assert "lmprobe-tiny" in html and "full_sequence" in html and "&lt;script&gt;" in html
    p = tiny_ds.prompt(0)
    assert p.num_tokens == int(tiny_ds.token_lengths()[0]) and len(p.token_perplexity) == p.num_tokens - 1
    assert len(p.topk) == 5
    view = p._repr_html_()
    assert len(re.findall(r'class="tok[" ]', view)) == p.num_tokens and "perplexity" in view
    (tmp_path / "nb.html").write_text(page("notebook views", html + view))
    assert_clean(render(tmp_path / "nb.html", "notebook-views", height=700))


def test_report_and_features_say_wrote_once(tiny_ds, tmp_path, capsys):
    from lmprobe.cli import main as cli_main

    layer = tiny_ds.layers[-1]
    random_dictionary(tiny_ds, tmp_path / "sae", layer)
    src = str(tiny_ds.files.root)
    assert cli_main(["report", src, "--out", str(tmp_path / "r"), "--sample", "1", "--no-probe"]) == 0
    cap = capsys.readouterr()
    assert (cap.out + cap.err).count("wrote") == 1 and cap.out == f"wrote {tmp_path / 'r' / 'index.html'}\n"
    assert cli_main(["features", src, "--sae", str(tmp_path / "sae"), "--dict", "d", "--layer", str(layer),
                     "--out", str(tmp_path / "f")]) == 0
    cap = capsys.readouterr()
    assert (cap.out + cap.err).count("wrote") == 1 and cap.out.startswith("wrote ")


def test_a_datasets_model_name_never_runs_tokenizer_code(tmp_path, monkeypatch):
    """model.name naming a tokenizer with custom code: transformers would ask "run the custom code? [y/N]"
    and run it on "y". Metadata must never lead to code execution."""
    from lmprobe.base.tokenizer import embedded_model_dir, local_tokenizer
    from lmprobe.stream import ShardStream

    evil, ran = tmp_path / "evil-model", tmp_path / "RAN"
    evil.mkdir()
    shutil.copy(embedded_model_dir("lmprobe-tiny") / "tokenizer.json", evil)
    (evil / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "EvilTokenizer", '
        '"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}}')
    (evil / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\nfrom transformers import "
                                  "PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name=str(evil), storage="full_sequence",
                       token_ids=True) as w:
        w.add_batch(texts=["a b", "c"], num_tokens=[2, 1], hidden={0: np.ones((3, 4), np.float32)},
                    token_ids=[[5, 6], [7]])
    monkeypatch.setattr("builtins.input", lambda *a, **k: "y")  # a user who answers yes to the prompt
    page_path = lmprobe.report(tmp_path / "ds", tmp_path / "report", probe=False, quiet=True)
    assert "#5" in page_path.read_text()  # ids shown as ids: the tokenizer was not loaded
    assert local_tokenizer(str(evil)) is None
    assert lmprobe.load(tmp_path / "ds").prompt(0).token_ids == [5, 6]
    with pytest.raises(InvalidArgumentError, match="cannot be loaded here"):
        ShardStream(lmprobe.load(tmp_path / "ds"), 0, 2, skip_special_tokens=True)
    assert not ran.exists()


# ------------------------------------------------------------------ the report's layout: tables, facts, legends


def _facts_table(dom: str) -> str:
    return re.search(r"<h2>Dataset</h2>(<table.*?</table>)", dom, flags=re.S).group(1)


def test_a_single_layer_report_shows_a_table_not_a_dot_in_an_empty_frame(tmp_path):
    ds = lmprobe.extract("lmprobe-tiny", ["The cat sat.", "A dog ran far.", "Hi"], out=tmp_path / "ds", layers="-1",
                         quiet=True)
    dom = render(lmprobe.report(ds, tmp_path / "r", sample=1, quiet=True), "report-one-layer", height=1400)
    assert_clean(dom)
    assert "by layer</b>" not in dom  # no per-layer line charts for one layer
    stats = ds.statistics(5)
    figure = re.search(r'<figure class="chart"><table class="facts">(.*?)</table><figcaption><b>Statistics of layer '
                       r"5</b>", dom, flags=re.S)
    assert figure, dom[:3000]
    assert f"<td>resid_post</td><td>{stats['mean_norm']:.4g}</td>" in figure.group(1)


def test_a_corpus_report_says_windows_and_the_facts_align_alike(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(" ".join(f"word{i}{j}" for j in range(40)) for i in range(3)) + "\n")
    ds = lmprobe.extract("lmprobe-tiny", corpus, out=tmp_path / "ds", layers="0,-1", context_len=16,
                         storage="full_sequence", quiet=True)
    dom = render(lmprobe.report(ds, tmp_path / "r", sample=2, quiet=True), "report-corpus", height=1600)
    assert_clean(dom)
    facts = _facts_table(dom)
    assert "<td>windows</td>" in facts and "<td>prompts</td>" not in facts
    assert f"{ds.num_prompts} windows" in re.search(r'<p class="sub">(.*?)</p>', dom).group(1)
    assert "<h2>Windows</h2>" in dom and "<h2>Prompts</h2>" not in dom
    assert re.search(r'<div class="meta"><b>window \d+</b>', dom) and "<b>prompt " not in dom
    assert "mean over 54 windows" in dom or f"mean over {ds.num_prompts} windows" in dom
    assert 'class="num"' not in facts  # one alignment for every value of the facts table


def test_the_legend_of_several_hookpoints_sits_beside_the_plot_not_on_its_lines(tmp_path):
    ds = lmprobe.extract("lmprobe-tiny", ["The cat sat.", "A dog ran far.", "Hi there"], out=tmp_path / "ds",
                         hookpoints="resid_post,mlp_out,attn_out", storage="full_sequence", quiet=True)
    dom = render(lmprobe.report(ds, tmp_path / "r", sample=1, probe=False, quiet=True), "report-hookpoints",
                 height=1600)
    assert_clean(dom)
    chart = re.search(r'<figure class="chart">(<svg[^>]*aria-label="Mean L2 norm by layer".*?)</figure>', dom,
                      flags=re.S).group(1)
    svg, after = chart.split("</svg>", 1)
    for hp in ("resid_post", "mlp_out", "attn_out"):
        assert f">{hp}<" not in svg and hp in after  # the key is below the plot, outside its area
    assert after.count('class="key"') == 3


def test_pages_doc_runs_chromium_as_root_too():
    text = (ROOT / "docs" / "pages.md").read_text()
    for cmd in re.findall(r"`(chromium [^`]*)`", text.replace("\n", " ")):
        assert "--no-sandbox" in cmd, cmd


# ------------------------------------------------------------------ whitespace and wrapping

def test_whitespace_tokens_are_visible_in_the_top_k_and_the_text():
    """A top-k entry that is a space or a newline showed as an empty bold ("dis 10.4,  10.2, a 3.8")."""
    from lmprobe.format.view import Prompt

    view = Prompt(0, "a b", 3, tokens=["a", " ", "\n"], topk=[("dis", 10.4), (" ", 10.2), ("\n", 9.0), ("\t", 8.0),
                                                                 (" a", 3.8)])
    html = view.html()
    preds = html.split('class="pred"')[1]
    assert "<b>dis</b> 10.4, <b>␣</b> 10.2, <b>↵</b> 9, <b>⇥</b> 8, <b>␣a</b> 3.8" in preds, preds
    text = html.split('class="toks"')[1].split("</div>")[0]
    assert ">␣</span>" in text and ">↵\n</span>" in text, text  # the newline still breaks the line


def test_windows_wrap_between_tokens_never_inside_one(tmp_path):
    """A window wrapped mid-token ("conce rt"): every token must sit on one line, whatever the width."""
    from lmprobe.base.html import tokens_html

    words = ["The", " con", "cert", " was", " extraordinarily", " wonderful", ",", " and", " every", "one",
             " adored", " it", "."] * 12
    body = (f'<div style="width:230px">{tokens_html(words, [1.0] * len(words))}</div>'
            "<script>document.addEventListener('DOMContentLoaded',function(){var n=0,lines=new Set();"
            "document.querySelectorAll('.tok').forEach(function(t){var r=t.getClientRects();"
            "if(r.length!==1)n++;lines.add(Math.round(r[0].top));});"
            "document.body.dataset.split=n;document.body.dataset.lines=lines.size;});</script>")
    (tmp_path / "wrap.html").write_text(page("wrapping", body))
    dom = render(tmp_path / "wrap.html", "tokens-wrap")
    assert_clean(dom)
    lines = int(re.search(r'data-lines="(\d+)"', dom).group(1))
    assert lines > 10, lines  # the test wraps at all
    assert 'data-split="0"' in dom, re.search(r'data-split="\d+"', dom)
