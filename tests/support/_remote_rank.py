"""One rank of tests/stream/test_remote_stream.py's multi-node test, started by torchrun (gloo, c10d on
127.0.0.1).

    _remote_rank.py URL OUT MODE BUDGET     MODE: whole | first (stop mid-epoch, save the state) | resume

Writes OUT/<mode><rank>.npy (the vectors served, in order) and OUT/<mode><rank>.json (the largest size the
node's cache folder was seen at while this rank read, sampled every millisecond).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import torch.distributed as dist

from lmprobe.storage.cachedir import usage
from lmprobe.stream import ShardStream


def main() -> None:
    url, out, mode, budget = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()  # the stream takes rank and world size from torch.distributed
    stream = ShardStream(url, 0, 8, seed=7, cache=budget, memory="64KiB", piece="2KiB")
    folder = stream.engine.source.cache().folder
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            try:
                peak[0] = max(peak[0], usage(folder))
            except OSError:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    dist.barrier()  # the ranks of both nodes read at once
    batches = []
    if mode == "first":
        it = iter(stream)
        for b in it:
            batches.append(b.copy())
            if len(batches) == 5 + 3 * rank:  # each rank stops at its own point, some mid-window
                break
        state = stream.state_dict()
        it.close()
        (out / f"state{rank}.json").write_text(json.dumps(state))
    else:
        if mode == "resume":
            stream.load_state_dict(json.loads((out / f"state{rank}.json").read_text()))
        batches = [b.copy() for b in stream]
    done.set()
    sampler.join()
    np.save(out / f"{mode}{rank}.npy", np.concatenate(batches) if batches else np.zeros((0, stream.dim), np.float32))
    (out / f"{mode}{rank}.json").write_text(json.dumps({"peak": peak[0]}))
    stream.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
