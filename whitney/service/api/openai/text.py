"""Sampled tokens as OpenAI's text: decoded as they arrive, whole characters only, cut before a stop string.

`TextStream` follows one sample. Tokens are decoded in a sliding window (from the last point where the text
was whole): a character whose UTF-8 bytes are split across tokens shows as U+FFFD until its last token
arrives, so text ending in U+FFFD is held back; text that could still become the start of a stop string is
held back too, and the text ends just before the first stop string, as OpenAI's does. Fed all tokens at
once it decodes them in one piece, so a streamed answer joined up equals the answer decoded whole.

The tokenizer stays in the engine: `decode` is the backend's (`Backend.decode`), a function of token lists.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()):
        self.decode = decode
        self.stops = stops
        self.tokens: list[int] = []
        self._start = 0  # the window's first token: the text before it is final
        self._whole = 0  # tokens whose text is whole (the window's text up to them is in self.text)
        self.text = ""  # the whole characters decoded so far
        self._sent = 0  # characters of self.text handed out
        self.stopped = False  # a stop string was found: nothing more is handed out

    def add(self, tokens: list[int]) -> str:
        """Take the next tokens; the text that is now final (maybe "")."""
        self.tokens += tokens
        before = self.decode(self.tokens[self._start:self._whole])
        after = self.decode(self.tokens[self._start:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self._start, self._whole = self._whole, len(self.tokens)
        return self._release(final=False)

    def finish(self, tokens: list[int] = ()) -> str:
        """Take the last tokens; the rest of the text, an unfinished character included (as decoding all
        the tokens at once shows it)."""
        self.tokens += tokens
        before = self.decode(self.tokens[self._start:self._whole])
        self.text += self.decode(self.tokens[self._start:])[len(before):]
        self._start = self._whole = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(0, self._sent - longest + 1)
        cuts = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            end = max(min(cuts), self._sent)
        elif final:
            end = len(self.text)
        else:  # keep back what may be the start of a stop string
            held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = max(len(self.text) - held, self._sent)
        out, self._sent = self.text[self._sent:end], end
        return out
