# src/saev/data/ordered.py
"""
Ordered (sequential) dataloader for activation data.

This module provides a high-throughput dataloader that reads activation data from disk shards in sequential order, without shuffling. The implementation uses a single-threaded manager process to ensure data is delivered in the exact order it appears on disk.

Patch labels are provided if there is a labels.bin file on disk.

See the design decisions in src/saev/data/performance.md.

Usage:
    >>> cfg = Config(shards="./shards", layer=13, batch_size=4096)
    >>> dataloader = DataLoader(cfg)
    >>> for batch in dataloader:
    ...     activations = batch["act"]  # [batch_size, d_model]
    ...     image_indices = batch["example_idx"]  # [batch_size]
    ...     patch_indices = batch["token_idx"]  # [batch_size]
    ...     patch_labels = batch["patch_labels"]  # [batch_size]
"""

import collections.abc
import dataclasses
import logging
import math
import os
import pathlib
import queue
import time
import traceback
import typing as tp
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import beartype
import numpy as np
import torch
import torch.multiprocessing as mp
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor

from . import shards


@beartype.beartype
@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration for loading ordered (non-shuffled) activation data from disk

    Attributes:
        shards: Directory with .bin shards and a metadata.json file.
        tokens: Which kinds of tokens to use. 'special' indicates the special tokens token (if any). 'content' returns content tokens. 'all' returns both content and special tokens.
        layer: Which ViT layer(s) to read from disk. ``-2`` selects the second-to-last layer. ``"all"`` enumerates every recorded layer.
        batch_size: Batch size.
        batch_timeout_s: How long to wait for at least one batch.
        drop_last: Whether to drop the last batch if it's smaller than the others.
        buffer_size: Number of batches to queue in the shared-memory ring buffer. Higher values add latency but improve resilience to brief stalls.
        debug: Whether the dataloader process should log debug messages.
        log_every_s: How frequently the dataloader process should log (debug) performance messages.
    """

    shards: pathlib.Path = pathlib.Path("$SAEV_SCRATCH/saev/shards/abcdefg")
    tokens: tp.Literal["content"] = "content"
    layer: int | tp.Literal["all"] = -2
    batch_size: int = 1024 * 16
    batch_timeout_s: float = 30.0
    drop_last: bool = False
    buffer_size: int = 64
    debug: bool = False
    log_every_s: float = 30.0


@beartype.beartype
def _manager_main(
    cfg: Config,
    md: shards.Metadata,
    batch_queue: Queue[dict[str, torch.Tensor]],
    stop_event: Event,
    err_queue: Queue[tuple[str, str]],
):
    """
    The main function for the data loader manager process.
    Reads data sequentially and pushes batches to the queue.
    """
    log_format = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"
    level = logging.DEBUG if cfg.debug else logging.INFO
    logging.basicConfig(level=level, format=log_format, force=True)
    logger = logging.getLogger("ordered.manager")
    logger.info(
        "Manager process started (debug=%s, logging=%s)",
        cfg.debug,
        logging.getLevelName(logger.getEffectiveLevel()),
    )

    # 0. PRE-CONDITIONS
    if cfg.tokens != "content" or not isinstance(cfg.layer, int):
        raise NotImplementedError(
            "High-throughput loader only supports `content` and fixed `layer` mode for now."
        )

    assert cfg.layer in md.layers, f"Layer {cfg.layer} not in {md.layers}"

    try:
        # Load shard info to get actual distribution
        index_map = shards.IndexMap(md, cfg.tokens, cfg.layer)
        shard_info = shards.ShardInfo.load(cfg.shards)

        # Check if labels.bin exists
        labels_mmap = None
        labels_path = cfg.shards / "labels.bin"
        if labels_path.exists():
            labels_mmap = np.memmap(
                labels_path,
                mode="r",
                dtype=np.uint8,
                shape=(md.n_examples, md.content_tokens_per_example),
            )
            logger.debug("Found labels.bin, will include patch labels in batches")

        # Check that all shards besides the last one have the same number of examples.
        for shard in shard_info[:-1]:
            assert shard.n_examples == shard_info[0].n_examples == md.examples_per_shard

        # Calculate total number of samples
        n_samples = md.n_examples * md.content_tokens_per_example

        logger.debug("Found %d samples.", n_samples)

        # Process batches in order
        current_idx = 0
        while current_idx < n_samples and not stop_event.is_set():
            batch_end_idx = min(current_idx + cfg.batch_size, n_samples)

            # Collect batch activations and metadata
            batch_acts = []
            batch_example_idx = []
            batch_token_i = []
            batch_token_labels = []

            # Process samples in this batch range
            for idx in range(current_idx, batch_end_idx):
                idx = index_map.from_global(idx)

                # Load activation from the appropriate shard
                acts_fpath = cfg.shards / f"acts{idx.shard_idx:06}.bin"

                # Open mmap for this shard if needed
                mmap = np.memmap(
                    acts_fpath, mode="r", dtype=np.float32, shape=md.shard_shape
                )

                # Get the activation
                act = torch.from_numpy(
                    mmap[
                        idx.example_idx_in_shard,
                        idx.layer_idx_in_shard,
                        idx.token_idx_in_shard,
                    ].copy()
                )

                batch_acts.append(act)
                batch_example_idx.append(idx.example_idx)
                batch_token_i.append(idx.content_token_idx)

                # Add patch label if available
                if labels_mmap is not None:
                    batch_token_labels.append(
                        labels_mmap[idx.example_idx, idx.content_token_idx]
                    )

            # Send batch if we have data
            if batch_acts:
                batch = {
                    "act": torch.stack(batch_acts),
                    "example_idx": torch.tensor(batch_example_idx, dtype=torch.long),
                    "token_idx": torch.tensor(batch_token_i, dtype=torch.long),
                }

                # Add labels if available
                if labels_mmap is not None:
                    batch["token_labels"] = torch.tensor(
                        batch_token_labels, dtype=torch.long
                    )

                batch_queue.put(batch)
                logger.debug(f"Sent batch with {len(batch_acts)} samples")

            current_idx = batch_end_idx

    except Exception:
        logger.exception("Fatal error in manager process")
        err_queue.put(("manager", traceback.format_exc()))
    finally:
        logger.info("Manager process finished.")

    logger.info("Manager process sleeping.")
    # Sleep a little longer, otherwise the tensors will be released and garbage collected, then we get a memory error in the parent process..
    time.sleep(60.0)
    logger.info("Manager process finished.")


@beartype.beartype
class DataLoader:
    """
    High-throughput streaming loader that reads data from disk shards in order (no shuffling).
    """

    @jaxtyped(typechecker=beartype.beartype)
    class ExampleBatch(tp.TypedDict, total=False):
        """Individual example."""

        act: Float[Tensor, "batch d_model"]
        example_idx: Int[Tensor, " batch"]
        token_idx: Int[Tensor, " batch"]
        # Optional, only present if labels.bin exists
        token_labels: Int[Tensor, " batch"]

    def __init__(self, cfg: Config):
        self.cfg = cfg
        if not os.path.isdir(self.cfg.shards):
            raise RuntimeError(f"Activations are not saved at '{self.cfg.shards}'.")

        self.md = shards.Metadata.load(self.cfg.shards)

        # Validate shard files exist and are non-empty
        shard_info = shards.ShardInfo.load(self.cfg.shards)
        shard_info.validate(self.cfg.shards)

        self.logger = logging.getLogger("ordered.DataLoader")
        self.ctx = mp.get_context()
        self.manager_proc = None
        self.batch_queue = None
        self.stop_event = None
        self._n_samples = self._calculate_n_samples()
        self.logger.info(
            "Initialized ordered.DataLoader with %d samples. (debug=%s)",
            self.n_samples,
            self.cfg.debug,
        )

    @property
    def n_batches(self) -> int:
        return len(self)

    @property
    def n_samples(self) -> int:
        return self._n_samples

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    @property
    def drop_last(self) -> int:
        return self.cfg.drop_last

    def _start_manager(self):
        # Always shutdown existing manager to ensure fresh start
        if self.manager_proc and self.manager_proc.is_alive():
            self.logger.info("Shutting down existing manager process.")
            self.shutdown()

        self.logger.info("Starting manager process.")

        # Create the batch queue
        self.batch_queue = self.ctx.Queue(maxsize=self.cfg.buffer_size)
        self.stop_event = self.ctx.Event()
        self.err_queue = self.ctx.Queue(maxsize=2)  # Manager + main process

        self.manager_proc = self.ctx.Process(
            target=_manager_main,
            args=(
                self.cfg,
                self.md,
                self.batch_queue,
                self.stop_event,
                self.err_queue,
            ),
            daemon=True,
        )
        self.manager_proc.start()

    def __iter__(self) -> collections.abc.Iterable[ExampleBatch]:
        """Yields batches in order."""
        self._start_manager()
        n = 0

        try:
            while n < self.n_samples:
                if not self.err_queue.empty():
                    who, tb = self.err_queue.get_nowait()
                    raise RuntimeError(f"{who} crashed:\n{tb}")

                try:
                    batch = self.batch_queue.get(timeout=self.cfg.batch_timeout_s)
                    actual_batch_size = batch["act"].shape[0]

                    # Handle drop_last
                    if (
                        self.cfg.drop_last
                        and actual_batch_size < self.cfg.batch_size
                        and n + actual_batch_size >= self.n_samples
                    ):
                        break

                    n += actual_batch_size
                    yield self.ExampleBatch(**batch)
                    continue
                except queue.Empty:
                    self.logger.info(
                        "Did not get a batch from manager process in %.1fs seconds.",
                        self.cfg.batch_timeout_s,
                    )
                except FileNotFoundError:
                    self.logger.info("Manager process (probably) closed.")
                    continue

                # If we don't continue, then we should check on the manager process.
                if not self.manager_proc.is_alive():
                    raise RuntimeError(
                        f"Manager process died unexpectedly after {n}/{self.n_samples} samples."
                    )

        finally:
            self.shutdown()

    def shutdown(self):
        if (
            hasattr(self, "stop_event")
            and self.stop_event
            and not self.stop_event.is_set()
        ):
            self.stop_event.set()

        if (
            hasattr(self, "manager_proc")
            and self.manager_proc
            and self.manager_proc.is_alive()
        ):
            self.manager_proc.join(timeout=5.0)
            if self.manager_proc.is_alive():
                self.logger.warning(
                    "Manager process did not shut down cleanly, killing."
                )
                self.manager_proc.kill()

        self.manager_proc = None
        self.batch_queue = None
        self.stop_event = None

    def __del__(self):
        self.shutdown()

    def _calculate_n_samples(self) -> int:
        """Helper to calculate total number of examples based on config."""
        match (self.cfg.tokens, self.cfg.layer):
            case ("special", "all"):
                return self.md.n_examples * len(self.md.layers)
            case ("special", int()):
                return self.md.n_examples
            case ("content", int()):
                return self.md.n_examples * self.md.content_tokens_per_example
            case ("content", "all"):
                return (
                    self.md.n_examples
                    * len(self.md.layers)
                    * self.md.content_tokens_per_example
                )
            case _:
                tp.assert_never((self.cfg.tokens, self.cfg.layer))

    def __len__(self) -> int:
        """Returns the number of batches in an epoch."""
        if self.cfg.drop_last:
            return self.n_samples // self.cfg.batch_size
        else:
            return math.ceil(self.n_samples / self.cfg.batch_size)
