"""``ByteCounter``: the bytes a communicator really moved, per tensor name and per step.

Per-step history is a window: ``steps`` holds the summaries of the last ``window`` steps
(default 1000), oldest first, so a long run's memory stays flat. What has scrolled out of the
window is not lost from the totals: ``total`` holds the number of closed steps and their sent and
received bytes since the counter was created (or ``reset``).
"""

from __future__ import annotations

from collections import defaultdict

DEFAULT_WINDOW = 1000


class ByteCounter:
    """Bytes moved for this rank: per tensor name and per step.

    ``sent`` counts what this rank puts on the wire, ``received`` what it gets back from the
    others (its own contribution excluded). ``end_step`` closes a step."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer (steps of history), "
                             f"got {window!r}")
        self.window = window
        self.sent = defaultdict(int)
        self.received = defaultdict(int)
        self.steps: list[dict] = []
        self.total = {"steps": 0, "sent": 0, "received": 0}

    def add(self, name: str, sent: int = 0, received: int = 0) -> None:
        self.sent[name] += int(sent)
        self.received[name] += int(received)

    def add_each(self, moved) -> None:
        """``add(name, n, n)`` for each ``(name, n)`` of ``moved`` (an allreduce's share per
        tensor: as much received as sent)."""
        sent, received = self.sent, self.received
        for name, n in moved:
            sent[name] += n
            received[name] += n

    def end_step(self) -> dict:
        per_tensor = {}
        for name, sent in self.sent.items():
            per_tensor[name] = (sent, self.received[name])
        summary = {"sent": sum(self.sent.values()), "received": sum(self.received.values()),
                   "per_tensor": per_tensor}
        self.steps.append(summary)
        if len(self.steps) > self.window:
            del self.steps[:len(self.steps) - self.window]
        self.total["steps"] += 1
        self.total["sent"] += summary["sent"]
        self.total["received"] += summary["received"]
        self.sent.clear()
        self.received.clear()
        return summary

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.steps.clear()
        self.total = {"steps": 0, "sent": 0, "received": 0}
