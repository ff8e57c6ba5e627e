"""The one layer grammar of lmprobe, for extraction and for reading alike.

A layer is the output of decoder block i, 0-based; a negative layer counts back from the last
one (``-1`` is the last), as Python indexes. A list of layers is ``all``, ``"0,3,-1"``, a range
such as ``"10:20"`` (a Python slice: 10..19), an int or a list of ints. Against a model, "the
last" is the model's last block; against a dataset, its last stored layer, so that a dataset of
every layer reads ``-1`` as the extraction that made it did.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError, LayerNotFoundError


def resolve_layer(layer: Any, num_layers: int, *, of: str = "the model") -> int:
    """``layer`` (negative: from the end) as an index 0..num_layers-1; LayerNotFoundError when out of range.

    >>> resolve_layer(-1, 12), resolve_layer(3, 12)
    (11, 3)
    """
    if isinstance(layer, bool) or not isinstance(layer, int) and not hasattr(layer, "__index__"):
        raise InvalidArgumentError(f"a layer is an integer (negative counts back from the last), got {layer!r}")
    i = int(layer.__index__())
    if not -num_layers <= i < num_layers:
        raise LayerNotFoundError(f"layer {i} does not exist: {of} has {num_layers} layers (0..{num_layers - 1}, or "
                                 f"-1..-{num_layers})", layer=i, available=list(range(num_layers)))
    return i % num_layers


def parse_layers(spec: str | int | list[int] | None, num_layers: int, *, of: str = "the model") -> list[int]:
    """Resolve ``all``, ``0,3,-1``, ``10:20`` (Python slice: 10..19) or a list to sorted layer indices.

    >>> parse_layers("0,2:4,-1", 12)
    [0, 2, 3, 11]
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return list(range(num_layers))
    items: list[Any]
    if isinstance(spec, int):
        items = [spec]
    elif isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = list(spec)
    if not items:
        raise InvalidArgumentError(f"no layers in {spec!r}; use 'all', a list like '0,3,-1' or a range like '10:20'")
    out: set[int] = set()
    for item in items:
        if isinstance(item, str) and ":" in item:
            try:
                parts = [int(p) if p.strip() else None for p in item.split(":")]
                if len(parts) > 3:
                    raise ValueError
                rng = range(num_layers)[slice(*parts)]
            except ValueError:
                raise InvalidArgumentError(f"cannot read layer range {item!r}; write START:STOP like '10:20'") from None
            if len(rng) == 0:
                raise LayerNotFoundError(f"layer range {item!r} is empty for {of} with {num_layers} layers",
                                         layer=item, available=list(range(num_layers)))
            out.update(rng)
            continue
        try:
            i = int(item)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"cannot read layer {item!r}; use integers, ranges like '10:20' or 'all'") from None
        out.add(resolve_layer(i, num_layers, of=of))
    return sorted(out)


def stored_layer(layer: Any, stored: list[int]) -> int:
    """``layer`` of a dataset that stores the layers ``stored`` (negative: back from the last stored one).

    >>> stored_layer(-1, [0, 2, 5])
    5
    """
    if isinstance(layer, bool) or not isinstance(layer, int) and not hasattr(layer, "__index__"):
        raise LayerNotFoundError(f"layer {layer!r} is not a layer number; stored layers: {list(stored)}",
                                 layer=layer, available=list(stored))
    n = max(stored) + 1 if stored else 0
    if not -n <= int(layer.__index__()) < n:
        raise LayerNotFoundError(f"layer {int(layer.__index__())} does not exist: this dataset's layers run 0..{n - 1} "
                                 f"(stored: {list(stored)}), so negative ones go -1..-{n}", layer=layer,
                                 available=list(stored))
    i = resolve_layer(layer, n)
    if i not in stored:
        given = f"layer {int(layer)} (layer {i})" if int(layer) < 0 else f"layer {i}"
        raise LayerNotFoundError(f"{given} is not stored in this dataset; stored layers: {list(stored)}",
                                 layer=layer, available=list(stored))
    return i
