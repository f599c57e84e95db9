"""The hypervolume of a set of points: how much of the objective space they dominate up to a reference point.

Every axis is minimized. Optuna computes this internally (``optuna._hypervolume``) but publishes no API for it
in the versions this project supports, so this is a small exact computation by slicing: sort the points along
the last axis, and between consecutive values the dominated region is the hypervolume of the points seen so
far, one dimension down. Exact for any dimension; fast enough for the few hundred points of a frontier
benchmark in 2-4 dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence

Point = tuple[float, ...]


def pareto_minimal(points: Sequence[Point]) -> list[Point]:
    """The points no other point weakly dominates (duplicates kept once); every axis minimized."""
    unique = sorted(set(points))
    out: list[Point] = []
    for p in unique:
        if not any(all(a <= b for a, b in zip(q, p, strict=True)) for q in out):
            out = [q for q in out if not all(a <= b for a, b in zip(p, q, strict=True))]
            out.append(p)
    return out


def hypervolume(points: Sequence[Point], reference: Point) -> float:
    """Volume of the region dominated by ``points`` and bounded by ``reference`` (points beyond it add nothing)."""
    inside = [tuple(min(x, r) for x, r in zip(p, reference, strict=True)) for p in points
              if all(x < r for x, r in zip(p, reference, strict=True))]
    return _hv(pareto_minimal(inside), tuple(reference))


def _hv(points: list[Point], ref: Point) -> float:
    if not points:
        return 0.0
    if len(ref) == 1:
        return ref[0] - min(p[0] for p in points)
    if len(ref) == 2:
        total, best_y = 0.0, ref[1]
        for x, y in sorted(points):
            if y < best_y:
                total += (ref[0] - x) * (best_y - y)
                best_y = y
        return total
    ordered = sorted(points, key=lambda p: p[-1])
    total = 0.0
    for i, p in enumerate(ordered):
        top = ordered[i + 1][-1] if i + 1 < len(ordered) else ref[-1]
        if top > p[-1]:
            total += (top - p[-1]) * _hv(pareto_minimal([q[:-1] for q in ordered[:i + 1]]), ref[:-1])
    return total


def normalizer(points: Sequence[Point], margin: float = 0.1) -> tuple[Point, Point]:
    """Per-axis lower bound and span of ``points``, so axes in seconds, tokens and KLD weigh alike; the
    reference point then sits at ``1 + margin`` on every normalized axis."""
    lows = tuple(min(p[i] for p in points) for i in range(len(points[0])))
    spans = tuple((max(p[i] for p in points) - lows[i]) or 1.0 for i in range(len(points[0])))
    return lows, spans


def normalized(points: Sequence[Point], lows: Point, spans: Point) -> list[Point]:
    return [tuple((x - lo) / s for x, lo, s in zip(p, lows, spans, strict=True)) for p in points]
