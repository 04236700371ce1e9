"""The version rule by definition, in plain Python, for the tests' expected results.

Written from the rule's text (docs/how-it-works.md, "Which version wins"), not from the
product's Spark code: among the versions of one id, the largest ``first`` value (an event field
the spec orders by; None loses) wins; among those tied on it, within one Kafka partition the
later offset, whatever the Kafka timestamps say; across partitions the later Kafka timestamp
of each partition's pick, then the higher partition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def newest(
    versions: Iterable[T],
    position: Callable[[T], tuple[Any, int, int]],
    first: Callable[[T], Any] | None = None,
) -> T:
    """The winning version; ``position`` gives (Kafka timestamp ms, partition, offset)."""
    rows = list(versions)
    if not rows:
        raise ValueError("no versions")
    if first is not None:
        values = [first(r) for r in rows if first(r) is not None]
        if values:
            top = max(values)
            rows = [r for r in rows if first(r) == top]
    last_in_partition: dict[int, T] = {}
    for r in rows:
        _ts, partition, offset = position(r)
        held = last_in_partition.get(partition)
        if held is None or offset > position(held)[2]:
            last_in_partition[partition] = r
    return max(last_in_partition.values(), key=lambda r: (position(r)[0], position(r)[1]))
