"""Tokenizers: a built-in character tokenizer for the procedural tasks, and `tokenizer.json` via `tokenizers`.

Both expose the same small surface: encode(text) -> ids, decode(ids) -> text, bos_id, eos_id, pad_id,
vocab_size, and apply_chat(prompt) -> ids (BOS + the chat template around the prompt).
"""
from __future__ import annotations

import string
from pathlib import Path

CHARS = "0123456789+-*=:,?|()<>abcdefghijklmnopqrstuvwxyz "


def checked_ids(ids) -> list[int]:
    """ids as ints; a negative one (no model samples it) is a ValueError (the tokenizers package raised a bare
    OverflowError)."""
    ids = [int(i) for i in ids]
    if any(i < 0 for i in ids):
        raise ValueError(f"decode: negative token id {min(ids)}")
    return ids


class CharTokenizer:
    """One token per character of a fixed alphabet, after <pad>=0, <bos>=1, <eos>=2."""

    specials = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = CHARS, vocab_size: int | None = None):
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = vocab_size or len(self.specials) + len(alphabet)
        if self.vocab_size < len(self.specials) + len(alphabet):
            raise ValueError(f"vocab_size {self.vocab_size} < {len(self.specials)} specials + "
                             f"{len(alphabet)} characters")
        self._id = {c: i + len(self.specials) for i, c in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the built-in alphabet {self.alphabet!r}") from None

    def decode(self, ids) -> str:
        """Specials and the ids past the alphabet (a model's vocabulary padded past it) decode to nothing."""
        n = len(self.specials)
        return "".join(self.alphabet[i - n] if n <= i < n + len(self.alphabet) else "" for i in checked_ids(ids))

    def apply_chat(self, prompt: str) -> list[int]:
        return [self.bos_id] + self.encode(prompt)


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a path names: the file itself, or the one in a directory (a checkpoint's, say)."""
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


class HFTokenizer:
    """A `tokenizer.json` (the `tokenizers` package) with a chat template given as a format string.

    template: e.g. "<｜User｜>{prompt}<｜Assistant｜>"; BOS/EOS are looked up by token string.
    """

    def __init__(self, path: str | Path, template: str = "{prompt}", bos: str | None = None,
                 eos: str | None = None, pad: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("a tokenizer.json needs the 'tokenizers' package: pip install '.[tokenizers]'") from None
        path = tokenizer_file(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: tokenizer file not found")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises its own plain Exception for a bad file
            raise ValueError(f"{path}: not a tokenizer the tokenizers package reads ({e})") from None
        if not isinstance(template, str):
            raise TypeError(f"chat template {template!r}: a format string with one {{prompt}} placeholder")
        try:  # the fields as str.format reads them ("{{prompt}}" is a literal, "{prompt:>10}" a placeholder)
            fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
            template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"chat template {template!r}: {type(e).__name__} {e} (it takes one placeholder, "
                             f"{{prompt}}; write a literal brace as {{{{ or }}}})") from None
        if "prompt" not in fields:
            raise ValueError(f"chat template {template!r} has no {{prompt}} placeholder (a literal {{{{prompt}}}} "
                             f"is not one)")
        self.template = template
        self.vocab_size = self.tok.get_vocab_size()

        def token_id(s, what):
            if s is None:
                return None
            i = self.tok.token_to_id(s)
            if i is None:
                raise ValueError(f"{path}: {what} token {s!r} is not in the vocabulary")
            return i
        self.bos_id = token_id(bos, "bos")
        self.eos_id = token_id(eos, "eos")
        self.pad_id = token_id(pad, "pad") if pad else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Ids past the tokenizer's vocabulary (a model's embedding padded past it) decode to nothing."""
        return self.tok.decode(checked_ids(ids), skip_special_tokens=True)

    def apply_chat(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"a text prompt must be a string, got {prompt!r}")
        prompt.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError (a ValueError) here, named
        ids = self.encode(self.template.format(prompt=prompt))
        return ([self.bos_id] if self.bos_id is not None else []) + ids
