"""The shape of the readers that take a reply's text in pieces as it streams (the reasoning
split, the tool-call readers): a state machine over the text so far, stepped until it can go
no further, and the hold-back of a marker that may still be forming."""

from __future__ import annotations


class StateReader:
    """Text fed in pieces, read by `_<state>` methods: each reads from `pos` and moves `pos`
    or `state` on; reading stops when a step changes neither (it waits for more text)."""

    def __init__(self, state: str) -> None:
        self.text = ""
        self.pos = 0  # how far the text has been read
        self.state = state
        self.finished = False

    def feed(self, piece: str) -> None:
        self.text += piece
        self._read()

    def _read(self) -> None:
        while not self._stopped():
            before = (self.state, self.pos)
            getattr(self, f"_{self.state}")()
            if (self.state, self.pos) == before:
                return

    def _stopped(self) -> bool:
        """Whether reading has ended for good (the text left the format)."""
        return False


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: text held back, as it may
    be a marker forming."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - k :]):
            return k
    return 0
