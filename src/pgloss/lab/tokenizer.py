"""A character tokenizer built in code: digits, a few symbols and three specials.

Nothing is downloaded. Id 0 is padding, 1 begins a prompt, 2 ends a response.
"""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+*=,|"


class Tokenizer:
    """Maps the lab's characters to ids and back; one character is one token."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, chars: str = CHARS) -> None:
        self.itos = list(SPECIALS) + list(chars)
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, one per character; unknown characters raise ValueError."""
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"text: character {err.args[0]!r} is not in the vocabulary {self.itos!r}") from None

    def decode(self, ids) -> str:
        """Text of `ids` up to the first end token; padding and begin tokens are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            out.append(self.itos[i])
        return "".join(out)
