"""The job's plan: what an extraction will write, in how many files, folders and commits, on how much staging
disk, how the model is placed, and how long the tail lasts, computed before any weight loads.

One pure function, :func:`make_plan` (no I/O), decides the shard size, the file layout and whether the job can
work at all; ``lmprobe extract ... --dry-run`` prints its result and a real run follows the same result (the
shard size, the layout, the space check, the refusal), so the two cannot disagree. Its inputs are a
:class:`Shape` (what the job stores, whole-job totals) and a :class:`Cluster` (the GPUs it runs on, or None on a
CPU). At full size (docs/publishing.md, "Jobs at full size"):

- W1, an 8B model, 10^9 tokens, 3 layers, bfloat16, 64 GPUs: 22.4 TiB in 23,235 files of 1 GiB (7,744 a
  folder), one GPU a rank, 52 commits for the job, 25 after the last shard: about 9 minutes.
- W2, the same, 10^10 tokens, 1 layer: shards grow to 8 GiB (9,664 a folder; at 1 GiB one folder would hold
  76,000), 11 commits after the last shard.
- W3, a 70B model (141 GB of weights), 2 x 10^9 tokens, 128 GPUs: 4 GiB shards, the model spread over
  4 GPUs a rank, 32 ranks (two a node).

The assumptions that are not arithmetic are named constants below (how long a commit takes, the upload
bandwidth of a rank, the memory headroom of a GPU); the scale benchmark (benchmarks/bench_scale.py) checks
the rest against real runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..base.units import format_size
from ..format.index import INDEX_BYTES_PER_ROW, INDEX_BYTES_PER_TOKEN, INDEX_BYTES_PER_TOKEN_WITH_IDS
from ..format.spec import HUB_FOLDER_ENTRIES, HUB_REPO_FILES, MAX_SHARD_SIZE, NESTED_FROM_SHARDS
from ..storage.budget import MAX_COMMIT_FILES, commits_for, in_flight_files, tail_seconds
from ..storage.urls import is_hub_url, remote_of

GiB = 1024**3
DEFAULT_SHARD_BYTES = GiB
#: the Hub refuses files over 50 GB and advises under 20 GB; shards stop at 16 GiB (MAX_SHARD_SIZE)
HUB_FILE_ADVISED = 20 * 10**9
HUB_FILE_LIMIT = 50 * 10**9
#: the Hub's storage, as its documentation states it for a free account (more on request, PRO, Enterprise)
HUB_PUBLIC_STORAGE = 5 * 10**12
HUB_PRIVATE_STORAGE = 100 * 10**9

#: index bytes on disk (format/index.py holds what a corpus index costs; benchmarks/bench_merge_memory.py measures
#: it): per row, per stored token of a full_sequence dataset (token_shard_ids and token_shard_offsets: runs that
#: DELTA_BINARY_PACKED stores in a few bits), with --perplexity (a float a token, which does not pack). The text
#: column and --token-ids are measured on a sample of the source (Shape.text_bytes_per_token, id_bytes_per_token);
#: without a sample, English (~4.2 characters a token, zstd) and a 128k vocabulary (~17 bits an id).
INDEX_ADDRESS_BYTES_PER_TOKEN = 0.05
DEFAULT_TEXT_BYTES_PER_TOKEN = INDEX_BYTES_PER_TOKEN - INDEX_ADDRESS_BYTES_PER_TOKEN
DEFAULT_ID_BYTES_PER_TOKEN = INDEX_BYTES_PER_TOKEN_WITH_IDS - INDEX_BYTES_PER_TOKEN
INDEX_BYTES_PER_TOKEN_PERPLEXITY = 8.0
INDEX_BYTES_PER_ROW_PERPLEXITY = 28
INDEX_FIXED_BYTES = 12 * 1024
#: the index's footer holds the schema metadata twice (as key-value pairs and in the arrow schema), and it lists
#: every shard (its rows, tokens, bytes, checksum)
INDEX_BYTES_PER_SHARD = 300

#: seconds the merge takes to open one part on the Hub (its index's footer, its metadata)
PART_OPEN_SECONDS = 1.0
#: closed shards a writer keeps until its next checkpoint hands them over (format/writer.py: a checkpoint is due
#: once this many closed since the last; it is checked after each batch, so a batch that closes more hands them all)
HANDED_OVER_AT_CHECKPOINT = 2
#: what a rank stages for each of its shards besides the shard, kept until its part is merged: the shard's record
#: in the writer's state.json (~260 bytes), its line in the upload ledger (~160) and its entry in the resume record
#: of the checkpoint copy (~600: parquet keeps the schema's metadata twice) (benchmarks/bench_scale.py measures it)
STAGED_BYTES_PER_SHARD = 1024
#: an upload's speed from one rank, bytes a second (a cloud GPU node reaches 1-10 GB/s over its ranks)
UPLOAD_BYTES_PER_SECOND = 100 * 10**6
#: seconds one commit takes at the Hub, copies and by-reference additions of up to 1,000 files included
COMMIT_SECONDS = 15.0
#: share of a GPU's memory the weights may take: the rest holds activations, the CUDA context and the hooks' copies
GPU_WEIGHT_SHARE = 0.85

Destination = Literal["local", "hub", "object"]


@dataclass(frozen=True)
class Shape:
    """What a job stores, whole-job totals (every rank together)."""

    storage: Literal["pooled", "full_sequence"]
    rows: int
    """Prompts, or windows of a corpus."""
    tokens: int
    """Stored tokens (full_sequence: every one is a row of a site's shards; pooled: what the index counts)."""
    site_row_bytes: tuple[int, ...]
    """Bytes of one row of each stored site (layer x hookpoint): width x the stored dtype's size."""
    logits_topk: int | None = None
    batch_rows: int = 8
    """The rows (prompts or windows) a rank's writer takes at once (--batch-size)."""
    token_ids: bool = False
    perplexity: bool = False
    hookpoints: int = 1
    exact: bool = True
    """False: the rows are an estimate (a corpus whose documents may be shorter than a window)."""
    known: bool = True
    """False: the size is unknown (a corpus without --max-tokens): nothing is sized."""
    model_bytes: int = 0
    """The weights in the dtype the model runs in (0: unknown)."""
    row_tokens: tuple[int, ...] = ()
    """The stored tokens of a sample of rows, in source order (a corpus' windows, the prompts): how sequence
    shards pack. Empty: every row as long as the average."""
    text_bytes_per_token: float = DEFAULT_TEXT_BYTES_PER_TOKEN
    """The index's text column, compressed, per token (measured on a sample of the source)."""
    id_bytes_per_token: float = DEFAULT_ID_BYTES_PER_TOKEN
    """With ``token_ids``: the index's token_ids column per token (measured on a sample of the source)."""


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job runs on."""

    gpus: int
    gpus_per_node: int
    gpu_memory: int

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


@dataclass
class JobPlan:
    """What :func:`make_plan` decided and predicts. ``as_json`` has the keys ``--dry-run json`` prints."""

    destination: str
    ranks: int
    gpus_per_rank: int
    placement: str
    shard_bytes: int
    shard_reason: str
    layout: str
    site_bytes: list[int]
    dataset_bytes: int
    shards_per_site: int
    files: int
    largest_folder_entries: int
    largest_file_bytes: int
    index_files: list[int]
    staging_bytes_per_node: int
    commits: int
    tail_commits: int
    tail_seconds: float
    refused: str | None = None
    warnings: list[str] = field(default_factory=list)
    known: bool = True
    checkpoint_copy_bytes: int = 0
    """A Hub job's uploads of its ranks' checkpoint copies (storage/hubresume.py), all of them together: each holds
    its part's index rows so far and goes up about once a commit while the ranks extract; removed at the end."""
    tail_parts: dict[str, float] = field(default_factory=dict)
    """Where the tail's seconds go: ``uploads`` (the last shards'), ``merge`` (opening the parts, sending the
    index), ``commits`` (those after the last shard, at the Hub's commit rate)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def _tail_parts(self) -> str:
        """The tail's parts in one unit: "uploads 1.1 min, merge 1.2 min, commits 6.0 min"."""
        unit, scale = ("s", 1.0) if self.tail_seconds < 90 else ("min", 60.0)
        digits = 0 if unit == "s" else 1
        return ", ".join(f"{k} {v / scale:.{digits}f} {unit}" for k, v in self.tail_parts.items())

    def describe(self) -> str:
        """The plan in a few lines, for a person."""
        if not self.known:
            return "\n".join(["plan: the size is unknown (a corpus without --max-tokens): give --max-tokens to plan",
                              f"  model: {self.placement}", *(f"  warning: {w}" for w in self.warnings)])
        sites = len(self.site_bytes)
        per_site = format_size(self.site_bytes[0]) if len(set(self.site_bytes)) == 1 else \
            ", ".join(format_size(b) for b in self.site_bytes)
        lines = [
            f"plan: {format_size(self.dataset_bytes)} in {self.files:,} files to {self.destination}",
            f"  per layer and site: {per_site} ({sites} site{'s' if sites != 1 else ''})",
            f"  shard size: {format_size(self.shard_bytes)} ({self.shard_reason}); {self.shards_per_site:,} shards "
            f"per site, {self.layout} layout",
            f"  largest folder: {self.largest_folder_entries:,} entries (the Hub takes {HUB_FOLDER_ENTRIES:,}); "
            f"largest file: {format_size(self.largest_file_bytes)}",
            f"  index: {', '.join(format_size(b) for b in self.index_files)} in {len(self.index_files)} file(s), "
            "built in bounded memory",
            f"  staging disk per node: {format_size(self.staging_bytes_per_node)}"
            + ("" if _kind(self.destination) == "local" else " at its peak, when uploads fall behind the model"),
            f"  model: {self.placement}",
        ]
        if is_hub_url(self.destination):
            lines.append(f"  commits: {self.commits:,} for the job (one committer, up to {MAX_COMMIT_FILES:,} files "
                         f"each); after the last shard is written: {self.tail_commits} commit(s), about "
                         f"{_duration(self.tail_seconds)} until the dataset is complete ({self._tail_parts()})")
            lines.append(f"  checkpoint copies: {format_size(self.checkpoint_copy_bytes)} uploaded in all (each rank's "
                         "index rows so far, about once a commit, so that a rank resumes on another node; removed "
                         "at the end)")
            lines.append(f"  Hub storage: {format_size(self.dataset_bytes)} (a free account: public repos usually up "
                         "to 5 TB, private 100 GB)")
        lines += [f"  warning: {w}" for w in self.warnings]
        if self.refused:
            lines.append(f"  refused: {self.refused}")
        return "\n".join(lines)


def _gb(n: int) -> str:
    """A GPU's memory as its maker states it (80 GB)."""
    return f"{n / 10**9:.0f} GB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------------------------------- placement


def place_model(model_bytes: int, cluster: Cluster | None, *, world: int = 1) -> tuple[int, int, str, str | None]:
    """(ranks, GPUs per rank, a description, a refusal or None): the fewest GPUs of a node that hold the model
    (a divisor of the node's GPUs, so that each node runs whole ranks); one rank per GPU when one holds it.

    >>> place_model(16 * 10**9, Cluster(64, 8, 80 * 10**9))[:2]
    (64, 1)
    >>> place_model(141 * 10**9, Cluster(128, 8, 80 * 10**9))[:2]
    (32, 4)
    """
    if cluster is None:  # processes on CPUs: ``world`` of them
        return world, 0, "on the CPU" + (f", {world} ranks" if world > 1 else ""), None
    per_gpu = cluster.gpu_memory * GPU_WEIGHT_SHARE
    node = min(cluster.gpus_per_node, cluster.gpus)
    size = format_size(model_bytes) if model_bytes else "size unknown"
    for g in range(1, node + 1):
        if node % g == 0 and model_bytes <= g * per_gpu:
            ranks = max(1, cluster.gpus // g)
            if g == 1:
                return ranks, 1, f"{size}, one GPU a rank, {ranks} rank{'s' if ranks != 1 else ''}", None
            return ranks, g, (f"{size} > {GPU_WEIGHT_SHARE:.0%} of one {_gb(cluster.gpu_memory)} GPU: spread "
                              f"over {g} GPUs a rank (--device-map auto), {node // g} rank(s) a node, {ranks} "
                              f"ranks: torchrun --nnodes {cluster.nodes} --nproc_per_node {node // g}"), None
    why = (f"the model's weights ({size}) do not fit the {node} GPU(s) of a node ({node} x "
           f"{_gb(cluster.gpu_memory)}, {GPU_WEIGHT_SHARE:.0%} of each for weights); use GPUs with more "
           "memory (--gpu-memory), more GPUs a node (--gpus-per-node), or a smaller --compute-dtype")
    return 0, node, f"{size}, does not fit a node", why


# ---------------------------------------------------------------------------------------------- files


@dataclass(frozen=True)
class _Files:
    shards_per_site: int  # every rank's, together
    logits_shards: int
    files: int
    largest_folder: int
    largest_shard: int
    layout: str
    data_files: int = 0  # the shards of every site and the logits' (not the statistics, the index, the card)
    open_bytes: int = 0  # a rank's shards being filled: one of each series (a site's last tokens and sequences, logits)
    batch_bytes: float = 0.0  # the bytes of the shards one batch closes (every series of a rank), on average


def _count(shape: Shape, shard_bytes: int, ranks: int, layout: str | None = None) -> _Files:
    """Shards and files when ``ranks`` ranks each write a part of ``shard_bytes`` shards (parts merged: each part's
    last shard of a series is partial)."""
    widest = max(shape.site_row_bytes)
    cap = max(1, shard_bytes // widest)
    rows_r = -(-shape.rows // ranks)
    last = -(-rows_r // cap) if rows_r else 0
    seq, items, seq_rows, seq_largest = _sequence_shards(shape, cap, rows_r)
    per_site = (last + seq) * ranks
    logits = 0
    if shape.logits_topk:
        lcap = max(1, shard_bytes // (8 * shape.logits_topk))
        logits = -(-rows_r // lcap) * ranks if rows_r else 0
    sites = len(shape.site_row_bytes)
    stats = shape.hookpoints
    files = per_site * sites + logits + stats + 2  # + the index and the card
    flat_tensors = per_site * sites + logits + stats
    if layout is None:
        layout = "nested" if per_site >= NESTED_FROM_SHARDS or flat_tensors > HUB_FOLDER_ENTRIES else "flat"
    largest = max(per_site, logits) if layout == "nested" else flat_tensors
    largest_shard = max(min(cap, rows_r), seq_largest) * widest  # a last-token shard, or a sequence shard
    # a rank's series: per site its last-token shards (``cap`` rows) and its sequence shards (``items`` windows or
    # prompts), and the logits' (``lcap`` rows): (the bytes of a full shard, the shards a batch of rows closes)
    series = [(min(cap, rows_r) * widest, shape.batch_rows / cap)]
    if seq:
        series.append((int(seq_rows) * widest, shape.batch_rows / items))
    series = series * sites
    if logits:
        series.append((min(lcap, rows_r) * 8 * shape.logits_topk, shape.batch_rows / lcap))
    return _Files(per_site, logits, files, largest, largest_shard, layout, data_files=per_site * sites + logits,
                  open_bytes=sum(b for b, _ in series), batch_bytes=sum(b * n for b, n in series))


def _sequence_shards(shape: Shape, cap: int, rows_r: int) -> tuple[int, float, float, int]:
    """A rank's sequence shards of ``cap`` rows (tokens): (how many, the windows or prompts a shard holds on
    average, the rows of such a shard, the rows of the fullest). A shard takes whole windows (or prompts), never
    part of one, and one longer than ``cap`` alone. With the lengths of a sample (``Shape.row_tokens``) the shards
    are packed as the writer packs them; without, every row is planned as long as the average."""
    if shape.storage != "full_sequence" or not rows_r or shape.tokens <= 0:
        return 0, 0.0, 0.0, 0
    per_row = shape.tokens / shape.rows
    if shape.row_tokens:
        items, largest = packed(shape.row_tokens, cap)
    else:
        items = max(1, cap // per_row) if per_row <= cap else 1
        largest = int(min(cap, per_row * rows_r) if per_row <= cap else per_row)
    return int(-(-rows_r // max(items, 1.0))), items, min(items, rows_r) * per_row, int(largest)


def packed(lengths: tuple[int, ...], cap: int) -> tuple[float, int]:
    """(rows a shard of ``cap`` tokens holds on average, the tokens of the fullest) when rows of ``lengths`` tokens,
    in this order and again, fill shards whole: a shard closes when the next row does not fit.

    >>> packed((64,), 125), packed((64,), 128), packed((30, 100), 128)
    ((1.0, 64), (2.0, 128), (1.0, 100))
    """
    closed = rows = fill = largest = n = 0
    while closed < 32 and n < 100_000:
        length = lengths[n % len(lengths)]
        if fill and fill + length > cap:
            closed, largest, fill = closed + 1, max(largest, fill), 0
            rows = n
        fill += length
        n += 1
    if not closed:  # the sample fits one shard: as many rows as its lengths' average lets in
        return cap / (sum(lengths) / len(lengths)), cap
    return rows / closed, largest


def index_bytes(shape: Shape, shards: int) -> int:
    """The index file's size on disk (measured constants above)."""
    per_token = shape.text_bytes_per_token + (INDEX_ADDRESS_BYTES_PER_TOKEN if shape.storage == "full_sequence"
                                              else 0.0)
    per_row = INDEX_BYTES_PER_ROW
    if shape.token_ids:
        per_token += shape.id_bytes_per_token
    if shape.perplexity:
        per_token += INDEX_BYTES_PER_TOKEN_PERPLEXITY
        per_row += INDEX_BYTES_PER_ROW_PERPLEXITY
    return int(INDEX_FIXED_BYTES + shape.rows * per_row + shape.tokens * per_token + shards * INDEX_BYTES_PER_SHARD)


def _smallest_shard(shape: Shape, ranks: int, fits) -> int | None:
    """The smallest shard size, 1 GiB up in whole GiB to 16 GiB, for which ``fits(files)`` holds; None: none."""
    for g in range(1, MAX_SHARD_SIZE // GiB + 1):
        if fits(_count(shape, g * GiB, ranks)):
            return g * GiB
    return None


# ---------------------------------------------------------------------------------------------- the plan


def make_plan(shape: Shape, *, destination: str, cluster: Cluster | None, shard_bytes: int | None = None,
              commits_per_hour: float = 100.0, world: int = 1) -> JobPlan:
    """The plan of a job (see the module docstring): pure arithmetic on whole-job totals; ``world``: the
    processes of a job on CPUs (``cluster`` None).

    >>> w1 = Shape("full_sequence", rows=10**9 // 8192, tokens=10**9, site_row_bytes=(8192,) * 3, exact=False,
    ...            model_bytes=16 * 10**9)
    >>> p = make_plan(w1, destination="hf://datasets/me/acts", cluster=Cluster(64, 8, 80 * 10**9))
    >>> p.refused, p.shard_bytes == 2**30, p.files > 20_000, p.tail_seconds < 15 * 60
    (None, True, True, True)
    """
    kind = _kind(destination)
    ranks, gpus_per_rank, placement, refused = place_model(shape.model_bytes, cluster, world=world)
    ranks = max(ranks, 1)
    warnings: list[str] = []
    if not shape.known:
        return JobPlan(destination, ranks, gpus_per_rank, placement, shard_bytes or DEFAULT_SHARD_BYTES,
                       "the default", "nested", [], 0, 0, 0, 0, 0, [], 0, 0, 0, 0.0, refused,
                       ["the job's size is unknown until the source is read: pass --max-tokens to plan it, and to "
                        "make the space check and the shard size fit it"], known=False)
    hub = kind == "hub"

    def fits(f: _Files) -> bool:
        return f.largest_folder <= HUB_FOLDER_ENTRIES and f.files <= HUB_REPO_FILES

    if shard_bytes is not None:
        size, reason = shard_bytes, "--shard-size"
    else:
        grown = _smallest_shard(shape, ranks, fits)
        size = grown or MAX_SHARD_SIZE
        reason = "the default" if size == DEFAULT_SHARD_BYTES else \
            f"grown from 1 GiB so that no folder passes {HUB_FOLDER_ENTRIES:,} entries"
    f = _count(shape, size, ranks)
    if not fits(f):
        need = _smallest_shard(shape, ranks, fits)
        fix = f"pass --shard-size {need // GiB}GiB" if need else \
            "split the job into several datasets (fewer tokens or layers each)"
        what = (f"{f.largest_folder:,} entries in one folder" if f.largest_folder > HUB_FOLDER_ENTRIES
                else f"{f.files:,} files")
        limit = f"{HUB_FOLDER_ENTRIES:,} entries a folder and {HUB_REPO_FILES:,} files a repo"
        message = f"this job makes {what} at {format_size(size)} shards, past the Hub's {limit}; {fix}"
        if hub:
            refused = refused or message
        else:
            warnings.append(message + " (a local folder or a bucket takes it, a later push to the Hub would not)")
    site_bytes = [shape.tokens * b if shape.storage == "full_sequence" else shape.rows * b
                  for b in shape.site_row_bytes]
    if shape.storage == "full_sequence":  # the last-token shards hold each row's last token again
        site_bytes = [s + shape.rows * b for s, b in zip(site_bytes, shape.site_row_bytes, strict=True)]
    index = index_bytes(shape, f.shards_per_site * len(shape.site_row_bytes) + f.logits_shards)
    logits_bytes = shape.rows * 8 * (shape.logits_topk or 0)
    dataset = sum(site_bytes) + logits_bytes + index
    if index > HUB_FILE_LIMIT and hub:
        refused = refused or (f"the index would be {format_size(index)}, past the Hub's 50 GB a file; drop --token-ids "
                              "and --token-strings, or split the job into several datasets")
    elif index > HUB_FILE_ADVISED:
        warnings.append(f"the index will be {format_size(index)}, past the 20 GB a file the Hub advises; drop "
                        "--token-ids and --token-strings, or split the job into several datasets")
    if not shape.exact:
        warnings.append(("rows are planned from the windows of the corpus' first documents" if shape.row_tokens else
                         "rows are planned from full windows: documents shorter than a window make more rows")
                        + ", and the corpus may hold fewer tokens than --max-tokens")
    # series a rank fills at once: each site's last-token shards (and its sequence shards), the logits'
    sites_open = len(shape.site_row_bytes) * (2 if shape.storage == "full_sequence" else 1) + (1 if shape.logits_topk
                                                                                            else 0)
    per_rank_index = index // ranks
    ranks_per_node = ranks if cluster is None else max(1, min(ranks, cluster.gpus_per_node // max(gpus_per_rank, 1)))
    if kind == "local":
        staging = dataset  # the output is the staging: every node writes its part into it (a shared disk)
    else:
        per_rank = staged_per_rank(f, size, ranks, per_rank_index, mean_shard=(dataset - index) // max(1, f.data_files))
        staging = min(dataset // max(1, -(-ranks // ranks_per_node)), per_rank * ranks_per_node) \
            if ranks > 1 else min(dataset, per_rank)
    commits = tail = 0
    parts: dict[str, float] = {}
    if hub:
        commits, tail, parts = _hub_commits(shape, f, ranks, index, sites_open, commits_per_hour)
        if dataset > HUB_PUBLIC_STORAGE:
            warnings.append(f"{format_size(dataset)} is past the 5 TB of public storage a free Hub account usually has: ask Hugging Face for more first, or write to a bucket "
                            "(--out s3://...)")
    return JobPlan(destination, ranks, gpus_per_rank, placement, size, reason, f.layout, site_bytes, dataset,
                   f.shards_per_site, f.files, f.largest_folder, max(f.largest_shard, index), [index],
                   staging, commits, tail, sum(parts.values()), refused, warnings, tail_parts=parts,
                   checkpoint_copy_bytes=(commits - tail) * per_rank_index * ranks // 2)


def staged_per_rank(f: _Files, shard_bytes: int, ranks: int, index: int, *, mean_shard: int) -> int:
    """A rank's staging disk at its peak, when its uplink falls behind its model: the shards it fills (one a
    series), the closed ones its next checkpoint hands over (what one batch closes, at least
    HANDED_OVER_AT_CHECKPOINT), the files uploading (budget.in_flight_files of ``mean_shard`` bytes; ``add`` waits
    beyond them), and what grows with its part until the merge: its ``index`` rows twice (its index parts and the
    checkpoint copy on the Hub, outputs.py) and a record of each shard."""
    waiting = max(HANDED_OVER_AT_CHECKPOINT * mean_shard, f.batch_bytes)
    uploading = in_flight_files(shard_bytes) * mean_shard
    shards = -(-(f.files - 2) // ranks)  # the files of its part but the index and the card
    return int(f.open_bytes + waiting + uploading + 2 * index + shards * STAGED_BYTES_PER_SHARD)


def _hub_commits(shape: Shape, f: _Files, ranks: int, index: int, sites_open: int,
                 commits_per_hour: float) -> tuple[int, int, dict[str, float]]:
    """A Hub job's commits: (all of them, those after its last shard is written, where the tail's seconds go)."""
    data_files = f.data_files
    ladder = commits_for(data_files)  # along the ladder, the last of them once the last shard is written
    # each of them also carries the checkpoint copy of every part whose copy before it has landed (hubresume.py):
    # up to one a rank a commit (W1: 64 copies in a commit of 1,000 files)
    for _ in range(8):
        more = commits_for(data_files + ranks * ladder)
        if more == ladder:
            break
        ladder = more
    if ranks > 1:
        # after the last shard: the job's committer's last commit (the ranks' last files together), then the
        # merge's copies out of the parts, 1,000 a commit, the last of them with the statistics, card and index
        copies = -(-data_files // MAX_COMMIT_FILES)
        tail = 1 + copies
        commits = ladder + copies
    else:
        tail = 1  # the last shards with the statistics, card and index
        commits = ladder
    commits += 1  # the job's marker, its first commit (storage/claim.py: one job at a time in the folder)
    during = commits - tail
    last_uploads = sites_open * f.largest_shard / UPLOAD_BYTES_PER_SECOND
    # the merge opens every part (its index's footer and metadata), reads the parts' indexes and sends the
    # merged one
    merge = (ranks * PART_OPEN_SECONDS + 2 * index / UPLOAD_BYTES_PER_SECOND) if ranks > 1 else 0.0
    paced = tail_seconds(tail, earlier=max(0, during), per_hour=commits_per_hour, commit_seconds=COMMIT_SECONDS)
    return commits, tail, {"uploads": last_uploads, "merge": merge, "commits": paced}


def _kind(destination: str) -> Destination:
    return remote_of(destination)
