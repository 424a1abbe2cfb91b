"""What the plugin keeps between requests: listings for a moment, answers per data generation.

A team sharing one TensorBoard asks for the same runs again and again, and
TensorBoard only changes what a run holds when it reloads the logs (every
`--reload_interval` seconds, 5 by default). Two things are kept:

- `Listings`: which series each run holds, for `LISTING_SECONDS`. Listing
  is what every request needs first (to know whether its answer is still
  good), and TensorBoard's Python loader (`--load_fast=false`, or where its
  Rust data server cannot run) lists by walking every point it keeps.
- `AnswerCache`: serialized answers, kept while their run's data is
  unchanged.

Concurrent requests for the same missing entry compute it once.
"""

import collections
import json
import threading
import time

LISTING_SECONDS = 1.0


class _Once:
    """Per-key locks: concurrent misses of one key compute it once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._computing = {}

    def lock(self, key):
        with self._lock:
            return self._computing.setdefault(key, threading.Lock())

    def done(self, key):
        with self._lock:
            self._computing.pop(key, None)


class Listings:
    """Listings kept `seconds` after they were made (a monotonic clock)."""

    def __init__(self, seconds=LISTING_SECONDS, clock=time.monotonic):
        self._seconds = seconds
        self._clock = clock
        self._kept = {}  # key -> (made at, listing)
        self._once = _Once()

    def get(self, key, compute):
        kept = self._kept.get(key)
        if kept is not None and self._clock() - kept[0] < self._seconds:
            return kept[1]
        with self._once.lock(key):
            kept = self._kept.get(key)
            if kept is not None and self._clock() - kept[0] < self._seconds:
                return kept[1]
            listing = compute()
            self._kept[key] = (self._clock(), listing)
            self._once.done(key)
            return listing


class AnswerCache:
    """Serialized JSON answers, kept while their run's data is unchanged.

    An answer is kept under its request (route, experiment, run, parameters)
    with the data generation it was computed from, and recomputed once that
    changes. The least recently used answers go first beyond `size` entries.
    """

    def __init__(self, size=128):
        self._size = size
        self._answers = collections.OrderedDict()  # key -> (generation, body)
        self._lock = threading.Lock()
        self._once = _Once()

    def get(self, key, generation, compute):
        """The body for `key` at `generation`, from `compute()` if not kept."""
        with self._lock:
            kept = self._answers.get(key)
            if kept is not None and kept[0] == generation:
                self._answers.move_to_end(key)
                return kept[1]
        with self._once.lock(key):
            with self._lock:
                kept = self._answers.get(key)
                if kept is not None and kept[0] == generation:
                    return kept[1]
            body = json.dumps(compute(), allow_nan=False, separators=(",", ":"))
            with self._lock:
                self._answers[key] = (generation, body)
                self._answers.move_to_end(key)
                while len(self._answers) > self._size:
                    self._answers.popitem(last=False)
            self._once.done(key)
            return body
