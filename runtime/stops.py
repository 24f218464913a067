"""Stop strings matched on the decoded text, also when one spans several decoded chunks.

Input: decoded text chunks of one request (e.g. from ``IncrementalDetokenizer.add``). Output: the
text that is safe to emit and, once a stop string appears, which one. The stop string and anything
after it are never emitted; only a suffix that could still grow into a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """One request's stop-string matcher: a small held-back tail, at most ``max(len(stop)) - 1`` characters."""

    def __init__(self, stop: str | Sequence[str] | None) -> None:
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, Sequence):
            stops = list(stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got an entry {s!r} ({type(s).__name__})")
            if s == "":
                raise ValueError(f"stop strings must be non-empty, got {stop!r}; remove the empty entries")
        self.stops: tuple[str, ...] = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once found

    @property
    def empty(self) -> bool:
        """No stop strings: ``feed`` returns its input unchanged."""
        return not self.stops

    def feed(self, text: str) -> tuple[str, str | None]:
        """New decoded text in; ``(text safe to emit now, the stop string matched or None)``.

        The first stop string to be completed ends the text; when one call completes several, the one
        that starts earliest wins (at the same start, the first listed). After a match every call
        returns ``("", matched)``.
        """
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return text, None
        buf = self._held + text
        best, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, s
        if which is not None:
            self.matched = which
            self._held = ""
            return buf[:best], which
        hold = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason (eos, length); '' after a match."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
