"""Training metrics that say how they combine: over micro-batches, optimizer steps and trainer ranks.

A `Metric` is a float (so a metrics row is still a plain dict of numbers to every reader: JSONL, W&B,
tests) that also carries its reduction: `mean` (weighted by `weight`, e.g. a micro-batch's rows), `min`
or `max` (extremes stay extremes). The producer of a value says how it reduces; nothing downstream
guesses from its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Reduction = Literal["mean", "min", "max"]


class Metric(float):
    __slots__ = ("reduce", "weight")

    def __new__(cls, value: float, reduce: Reduction = "mean", weight: float = 1.0) -> Metric:
        m = float.__new__(cls, value)
        m.reduce, m.weight = reduce, float(weight)
        return m

    def __reduce__(self):  # pickles (Ray) with its reduction
        return (Metric, (float(self), self.reduce, self.weight))

    def __repr__(self) -> str:
        return f"Metric({float(self)!r}, {self.reduce!r}, weight={self.weight!r})"


@dataclass(frozen=True)
class DeviceMetric:
    """A metric whose value is still a 0-dim tensor on the trainer's device: a training micro-batch reports these so
    that it never waits for the device (`.item()` per value was a host sync per metric per micro-batch);
    `settle` reads all of a step's values back at once."""

    value: torch.Tensor
    reduce: Reduction = "mean"
    weight: float = 1.0


def settle(reports: Iterable[Mapping[str, float | DeviceMetric]]) -> list[dict[str, float]]:
    """The reports with every `DeviceMetric` read back as a `Metric`: one device-to-host copy for all of them."""
    reports = [dict(r) for r in reports]
    pending = [(r, k) for r in reports for k, v in r.items() if isinstance(v, DeviceMetric)]
    if not pending:
        return reports
    values = torch.stack([r[k].value.detach().reshape(()).float() for r, k in pending]).tolist()
    for (r, k), value in zip(pending, values):
        r[k] = Metric(value, r[k].reduce, r[k].weight)
    return reports


def _as_metric(v: float) -> Metric:
    return v if isinstance(v, Metric) else Metric(float(v))


def _combine(name: str, values: list[Metric], equal_weights: bool) -> Metric:
    kinds = {v.reduce for v in values}
    if len(kinds) != 1:
        raise ValueError(f"metric {name!r} was reported with different reductions: {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "min":
        return Metric(min(values), "min")
    if kind == "max":
        return Metric(max(values), "max")
    weights = [1.0 if equal_weights else v.weight for v in values]
    total = sum(weights)
    if total <= 0:
        return Metric(0.0, "mean", 0.0)
    return Metric(sum(float(v) * w for v, w in zip(values, weights)) / total, "mean", total)


def reduce_metrics(reports: Iterable[Mapping[str, float]], *, equal_weights: bool = False) -> dict[str, Metric]:
    """Each name combined over the reports that have it: weighted mean, min or max as each value says (plain
    floats are means of weight 1). `equal_weights` averages means report by report (e.g. one per rank: loss
    metrics come from the last pipeline stage only, sync figures from every rank)."""
    by_name: dict[str, list[Metric]] = {}
    for report in reports:
        for name, v in report.items():
            by_name.setdefault(name, []).append(_as_metric(v))
    return {name: _combine(name, values, equal_weights) for name, values in by_name.items()}


def plain(metrics: Mapping[str, float]) -> dict[str, float]:
    """The values as builtin floats (for JSON writers and for printing)."""
    return {k: float(v) for k, v in metrics.items()}
