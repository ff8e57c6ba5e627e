"""Where a model's weights go: the whole model on one device, or spread by accelerate (``--device-map auto``) over
a process's GPUs, then the CPU, then disk, for a model larger than one GPU.

Under torchrun a rank spreads its model over a group of its node's GPUs: the rank with local rank L takes GPUs
[L*g, (L+1)*g) with g = the node's GPUs // its ranks, so one rank per node (``--nproc_per_node 1``) takes all of
them, and the ranks divide the data across nodes as they always do. At full size (a 70B model, 141 GB in
bfloat16, on 8 x 80 GB GPUs) a rank's max_memory names its g GPUs and the CPU; nothing here grows with the data.

Everything in this module but ``require_accelerate``, ``free_memory`` and the device lookups is arithmetic on its
arguments, tested on its own (tests/extraction/test_placement.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..base.units import parse_size
from ..errors import InvalidArgumentError, ModelError

#: the devices accelerate's max_memory takes besides GPU indices
_NAMED_DEVICES = ("cpu", "disk", "mps")


def require_accelerate() -> Any:
    """accelerate, or a one-line error saying how to install it (``--device-map`` needs it)."""
    try:
        import accelerate
    except ImportError:
        raise ModelError("--device-map auto spreads the model with accelerate, which is not installed: "
                         "pip install 'lmprobe[accelerate]'") from None
    return accelerate


def parse_max_memory(text: str) -> dict[int | str, int]:
    """``--max-memory``: ``DEVICE=SIZE`` pairs, comma-separated, as accelerate's ``max_memory`` (GPU indices as
    ints; ``cpu``, ``disk``, ``mps``; sizes as ``lmprobe.base.units.parse_size`` reads them).

    >>> parse_max_memory("0=70GiB, 1=70GiB, cpu=200GB")
    {0: 75161927680, 1: 75161927680, 'cpu': 200000000000}
    """
    example = "e.g. --max-memory 0=70GiB,1=70GiB,cpu=200GiB"
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"--max-memory {text!r} names no device; {example}")
    out: dict[int | str, int] = {}
    for item in text.split(","):
        key, eq, size = (s.strip() for s in item.partition("="))
        if not eq or not key or not size:
            raise InvalidArgumentError(f"--max-memory {text!r}: {item.strip()!r} is not DEVICE=SIZE; {example}")
        if key.isdigit():
            device: int | str = int(key)
        elif key.lower() in _NAMED_DEVICES:
            device = key.lower()
        else:
            raise InvalidArgumentError(f"--max-memory {text!r}: unknown device {key!r}; name a GPU by its index (0, 1, "
                                       f"...) or use {', '.join(_NAMED_DEVICES)}; {example}")
        if device in out:
            raise InvalidArgumentError(f"--max-memory {text!r} names {key!r} twice; name each device once")
        try:
            out[device] = parse_size(size)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--max-memory {text!r}, device {key!r}: {exc}") from None
    return out


def rank_gpus(local_rank: int, local_world: int, n_gpus: int) -> range:
    """The GPUs a rank spreads its model over: [L*g, (L+1)*g) with g = n_gpus // local_world (L: the local rank).

    >>> rank_gpus(0, 1, 8), rank_gpus(1, 2, 8), rank_gpus(0, 1, 0)
    (range(0, 8), range(4, 8), range(0, 0))
    """
    if n_gpus == 0:
        return range(0)
    g = n_gpus // local_world
    if g == 0:
        raise InvalidArgumentError(
            f"torchrun starts {local_world} ranks on this node, which has {n_gpus} GPU(s): with --device-map auto each "
            f"rank needs a GPU of its own; pass --nproc_per_node {n_gpus} or fewer (1 spreads the model over all of "
            "the node's GPUs)")
    return range(local_rank * g, (local_rank + 1) * g)


@dataclass(frozen=True)
class Placement:
    """Where the weights go: the whole model on ``device``, or (``device_map``) spread by accelerate."""

    device: str  # the one device; with device_map: the process's device before the weights load
    device_map: str | None = None  # "auto": accelerate's
    #: with device_map: what each device may hold, GPU indices as this process numbers them; None: accelerate's
    #: own, over every visible GPU and the CPU
    max_memory: dict[int | str, int] | None = None
    gpus: tuple[int, ...] = ()  # with device_map: the GPUs this process spreads the model over

    @property
    def spread(self) -> bool:
        return self.device_map is not None

    def record(self) -> dict[str, Any]:
        """What a run records about where the model ran (``lmprobe:runs``): the device, and how it was spread.

        >>> Placement("cuda", "auto", {0: 2**30, "cpu": 2**31}, (0,)).record()
        {'device': 'cuda', 'device_map': 'auto', 'gpus': [0], 'max_memory': {'0': 1073741824, 'cpu': 2147483648}}
        """
        out: dict[str, Any] = {"device": self.device}
        if self.spread:
            out.update(device_map=self.device_map, gpus=list(self.gpus))
            if self.max_memory is not None:
                out["max_memory"] = {str(k): v for k, v in self.max_memory.items()}
        return out


def modules_per_device(device_map: dict[str, Any]) -> dict[str, int]:
    """accelerate's ``hf_device_map`` summarised: how many top-level entries each device holds.

    >>> modules_per_device({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "disk"})
    {'0': 2, 'cpu': 1, 'disk': 1}
    """
    out: dict[str, int] = {}
    for device in device_map.values():
        out[str(device)] = out.get(str(device), 0) + 1
    return out


def plan_placement(device: str, *, device_map: str | None, max_memory: str | None, n_gpus: int, local_rank: int = 0,
                   local_world: int = 1, free: dict[int | str, int] | None = None) -> Placement:
    """The placement of one process's model. ``device``: the picked device (``cpu``, ``cuda``, ``cuda:N``, ...);
    ``n_gpus``: the GPUs this process sees; ``local_rank``/``local_world``: its place on its node under torchrun;
    ``free``: what each device can hold (``free_memory()``), needed only when a torchrun rank must be kept to its
    own GPUs and ``max_memory`` does not say how much each may take.

    With ``device_map``, ``--max-memory``'s GPU indices count the rank's own GPUs (0 is its first); with one rank per
    node, they are the node's. ``--device cpu`` keeps the model off the GPUs (the CPU, then disk).

    >>> plan_placement("cuda", device_map="auto", max_memory="0=70GiB,cpu=100GiB", n_gpus=8, local_rank=1,
    ...                local_world=2).max_memory
    {4: 75161927680, 'cpu': 107374182400}
    """
    if device_map is None:
        return Placement(device)
    if device.startswith("cuda:"):
        raise InvalidArgumentError(f"--device {device} puts the whole model on one GPU, and --device-map auto spreads it "
                                   "over the process's GPUs; pass --device auto (choose the GPUs with --max-memory or "
                                   "CUDA_VISIBLE_DEVICES)")
    on_gpus = device.startswith("cuda") and n_gpus > 0
    gpus = rank_gpus(local_rank, local_world, n_gpus) if on_gpus else range(0)
    asked = parse_max_memory(max_memory) if max_memory is not None else None
    if asked is not None:
        plan: dict[int | str, int] = {}
        for key, size in asked.items():
            if isinstance(key, int):
                if not on_gpus:
                    raise InvalidArgumentError(f"--max-memory {max_memory!r} names GPU {key}, and this process runs on "
                                               f"{device} with no GPU; name cpu and disk only")
                if key >= len(gpus):
                    whose = "this process sees" if local_world == 1 else \
                        f"this rank spreads its model over (GPUs {gpus.start}-{gpus.stop - 1} of the node)"
                    raise InvalidArgumentError(f"--max-memory {max_memory!r} names GPU {key}, but {whose} {len(gpus)} "
                                               f"GPU(s); number them 0 to {len(gpus) - 1}")
                plan[gpus[key]] = size
            else:
                plan[key] = size
        return Placement(device, device_map, plan, tuple(gpus))
    if device != "cpu" and local_world == 1:  # accelerate's own: every visible GPU (or mps), then the CPU
        return Placement(device, device_map, None, tuple(gpus))
    if free is None:
        raise ValueError("free memory is needed to keep a rank's model to its own GPUs")
    plan = {g: free[g] for g in gpus if g in free}
    if "cpu" in free:
        plan["cpu"] = free["cpu"]
    return Placement(device, device_map, plan, tuple(gpus))


def free_memory(gpus: range) -> dict[int | str, int]:
    """What ``gpus`` and the CPU can hold now, as accelerate's ``get_max_memory`` counts it (a GPU's free memory,
    the CPU's available memory); only ``gpus`` are asked, so that a rank opens no CUDA context on the others."""
    import psutil  # accelerate's own dependency
    import torch

    out: dict[int | str, int] = {g: int(torch.cuda.mem_get_info(g)[0]) for g in gpus}
    out["cpu"] = int(psutil.virtual_memory().available)
    return out


def placement_of(device: str, *, device_map: str | None, max_memory: str | None, world: int = 1) -> Placement:
    """``plan_placement`` for this process: its GPUs, and its place on the node under torchrun (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``); accelerate missing is an error here, before the weights load. Without ``device_map``, a
    rank of a ``world``-process job on a machine of several GPUs takes the GPU of its local rank."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if device_map is None:
        if world > 1 and device.startswith("cuda") and torch.cuda.device_count() > 1:
            return Placement(f"cuda:{local_rank % torch.cuda.device_count()}")
        return Placement(device)
    require_accelerate()
    n_gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world > 1 else 1
    local_rank = local_rank if world > 1 else 0
    needs_free = max_memory is None and (device == "cpu" or local_world > 1)
    gpus = rank_gpus(local_rank, local_world, n_gpus)
    return plan_placement(device, device_map=device_map, max_memory=max_memory, n_gpus=n_gpus, local_rank=local_rank,
                          local_world=local_world, free=free_memory(gpus if n_gpus else range(0)) if needs_free else None)


def execution_device(module: Any) -> Any:
    """The device ``module`` computes on: accelerate's hook says so for a dispatched module (whose weights may sit
    on the CPU or disk, the meta device in the module), else its first parameter's device (the CPU when it has
    none)."""
    import torch

    hook = getattr(module, "_hf_hook", None)
    for h in [*getattr(hook, "hooks", ()), hook]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)  # an int is a CUDA index
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def input_device(model: Any) -> Any:
    """Where a model's input ids go: the device its input embedding computes on (the first device of a spread
    model), else the model's own."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if embeddings is not None:
        return execution_device(embeddings)
    return execution_device(model)


def describe_spread(device_map: dict[str, Any]) -> str:
    """One line for the log: ``model spread by accelerate: 0: 20 modules, cpu: 12 modules, disk: 3 modules``."""
    return "model spread by accelerate: " + ", ".join(f"{d}: {n} module{'s' if n != 1 else ''}"
                                                      for d, n in modules_per_device(device_map).items())
