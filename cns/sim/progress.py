"""A one-line progress bar for long simulations, written to a terminal (stderr)."""

from __future__ import annotations

import time
from typing import TextIO

from cns.sim.recording import Progress

WIDTH = 30


class ProgressBar:
    """Overall progress over `runs` runs. Silent until `delay_seconds` have passed, so a short
    run prints nothing; then redrawn at most ten times a second, and cleared by `close`."""

    def __init__(self, stream: TextIO, runs: int, delay_seconds: float = 1.0) -> None:
        self.stream = stream
        self.runs = runs
        self.delay_seconds = delay_seconds
        self.started = time.monotonic()
        self.drawn_at = 0.0
        self.shown = False

    def run(self, index: int, label: str) -> Progress:
        """The callback for run `index` (0-based), which reports its own fraction done."""

        def update(fraction: float) -> None:
            now = time.monotonic()
            if now - self.started < self.delay_seconds or now - self.drawn_at < 0.1:
                return
            self.drawn_at = now
            self.shown = True
            overall = (index + min(max(fraction, 0.0), 1.0)) / self.runs
            filled = round(overall * WIDTH)
            bar = "#" * filled + "." * (WIDTH - filled)
            self.stream.write(f"\r[{bar}] {100 * overall:5.1f}% {label:<16}")
            self.stream.flush()

        return update

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * (WIDTH + 26) + "\r")
            self.stream.flush()
