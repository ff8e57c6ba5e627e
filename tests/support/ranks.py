"""Ranks simulated by threads for the extraction tests, and a tokenizer whose ids can be read off the text."""

from __future__ import annotations

import json
import threading
import time


class WordTokenizer:
    """A tokenizer for tests: "w3 w17" -> [3, 17], with character offsets when ``is_fast``."""

    def __init__(self, fast: bool = True):
        self.is_fast = fast

    def __call__(self, texts, *, add_special_tokens=False, return_offsets_mapping=False, truncation=False,
                 verbose=False):
        assert not add_special_tokens and not truncation
        out = {"input_ids": [[int(w[1:]) for w in t.split()] for t in texts]}
        if return_offsets_mapping:
            assert self.is_fast
            out["offset_mapping"] = [_offsets(t) for t in texts]
        return out

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _offsets(text):
    spans, at = [], 0
    for w in text.split():
        at = text.index(w, at)
        spans.append((at, at + len(w)))
        at += len(w)
    return spans


class Ranks:
    """``world`` ranks simulated by threads; ``all_gather`` is a barrier over a shared list, and every object
    crosses it as JSON (what a rank sends must survive any transport)."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world
        self.gathers = [0] * world

    def gather(self, rank: int):
        def all_gather(obj):
            self.slots[rank] = json.loads(json.dumps(obj))
            self.barrier.wait()
            got = list(self.slots)
            self.barrier.wait()
            self.gathers[rank] += 1
            return got

        return all_gather

    def run(self, fn):
        """fn(rank, all_gather) on every rank at once: (results, exceptions), by rank."""
        results: list = [None] * self.world
        errors: list = [None] * self.world

        def target(rank):
            try:
                results[rank] = fn(rank, self.gather(rank))
            except BaseException as exc:  # noqa: BLE001 - compared by the test
                errors[rank] = exc

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank hangs"
        for _ in range(200):  # every planner thread ends with its rank's stream
            if not any(t.name == "lmprobe-planner" and t.is_alive() for t in threading.enumerate()):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("a planner thread outlived its stream")
        return results, errors


def key(w):
    return (w.document, w.index, w.start, tuple(w.input_ids), w.text)
