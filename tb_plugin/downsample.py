"""Long series made short for drawing: extremes kept, steps bucketed."""

import math


def downsample_min_max(values, points):
    """Indices of at most `points` values that keep each bucket's extremes.

    Non-finite values are always kept: they are what a reader looks for.
    The first and last values are always kept.
    """
    n = len(values)
    if n <= points:
        return list(range(n))
    buckets = max(1, (points - 2) // 2)
    keep = {0, n - 1}
    size = (n - 2) / buckets
    for b in range(buckets):
        start, end = 1 + int(b * size), 1 + int((b + 1) * size)
        if start >= end:
            continue
        chunk = range(start, end)
        finite = [i for i in chunk if math.isfinite(values[i])]
        keep.update(i for i in chunk if not math.isfinite(values[i]))
        if finite:
            keep.add(min(finite, key=values.__getitem__))
            keep.add(max(finite, key=values.__getitem__))
    return sorted(keep)


def heat_map(series, columns):
    """Per-series maxima over `columns` equal ranges of steps.

    Each series is a list of `(step, value)` points.

    Returns `{"columns": [[first_step, last_step], ...], "values": [[...]]}`,
    one row per series, `None` where a range holds no point of it.
    """
    all_steps = sorted({step for s in series for step, _ in s})
    if not all_steps:
        return {"columns": [], "values": [[] for _ in series]}
    first, last = all_steps[0], all_steps[-1]
    count = min(columns, len(all_steps))
    width = (last - first + 1) / count
    ranges = [[int(first + c * width), int(first + (c + 1) * width) - 1] for c in range(count)]
    ranges[-1][1] = last
    rows = []
    for s in series:
        row = [None] * count
        for step, value in s:
            c = min(count - 1, int((step - first) / width))
            if not math.isfinite(value):
                row[c] = finite_or_text(value)
            elif row[c] is None or (isinstance(row[c], float) and value > row[c]):
                row[c] = value
        rows.append(row)
    return {"columns": ranges, "values": rows}


def finite_or_text(value):
    """JSON has no NaN or Infinity: those become the strings JavaScript parses."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
