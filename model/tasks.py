"""Prompt sources and verifiable rewards.

* `DigitTask`: procedurally generated digit puzzles with the built-in character tokenizer. The answer is a
  function of the prompt (no constant output beats chance); prompts whose hash falls in the held-out bucket are
  never used for training and make up the evaluation set.
* `JsonlTask`: `{"prompt": ..., "answer": ...}` lines (or other keys: GSM8K's `question`), GSM8K `#### 42` and
  `\\boxed{}` answers understood, scored by `math_reward`, which compares final answers after number/expression
  normalization.
Both give `batch(n)` (deterministic from the seed and an internal cursor), `eval_items()`, `reward(completion,
answer)` in [0, 1], `correct(completion, answer)` and `state()` / `load_state()` for checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from .config import strict_json


@dataclass
class Item:
    prompt: str
    answer: str


def jsonl_lines(path: Path, data: bytes | None = None) -> list[str]:
    """A JSONL file's lines (of data, its bytes already read, if given), split on newlines only (str.splitlines
    also splits on U+2028, U+2029 and U+0085, which JSON strings may hold), or a ValueError naming a file that is
    not UTF-8 text. A leading byte-order mark (Windows editors write one) is dropped."""
    try:
        return (path.read_bytes() if data is None else data).decode("utf-8-sig").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def json_line(line: str):
    """One JSONL line's value; a ValueError (json.JSONDecodeError for bad syntax) names a key an object gives twice
    (json.loads would keep the last silently)."""
    return strict_json(line)


def _bucket(text: str, buckets: int) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % buckets


class DigitTask:
    """Digit puzzles over `length` digits, prompt text "3725:":

      max     -> "7"    the largest digit; prompts are drawn so the answer is uniform over 0-9
      last    -> "5"    the digit before ':'
      copy    -> "3725"
      reverse -> "5273"
      sort    -> "2357"
      addmod  -> "0"    (first + second) mod 10 (length 2)

    No constant output beats chance (1/10 per digit). Reward: matching positions / max(len(answer), len(output)),
    so extra output costs; `correct` is exact match. Prompts whose hash falls in bucket 0 of `heldout_buckets`
    never appear in training; the evaluation set is drawn from them.
    """

    KINDS = ("max", "last", "copy", "reverse", "sort", "addmod")

    def __init__(self, kind: str = "max", length: int = 4, seed: int = 0, heldout_buckets: int = 10,
                 eval_size: int = 64):
        if kind not in self.KINDS:
            raise ValueError(f"task.digits_kind must be one of {self.KINDS}, got {kind!r}")
        self.kind, self.length, self.seed, self.buckets = kind, (2 if kind == "addmod" else length), seed, heldout_buckets
        self.cursor = 0
        rng, seen = random.Random(f"{seed}:eval"), set()
        for _ in range(200 * eval_size):
            if len(seen) == eval_size:
                break
            p = self._sample(rng)
            if self.is_heldout(p):
                seen.add(p)
        self._eval = [Item(p, self.answer(p)) for p in sorted(seen)]

    def _sample(self, rng: random.Random) -> str:
        if self.kind == "max":  # answer first, uniform; then digits not above it, one of them equal
            m = rng.randrange(10)
            d = [rng.randrange(m + 1) for _ in range(self.length)]
            d[rng.randrange(self.length)] = m
            return "".join(map(str, d)) + ":"
        return "".join(str(rng.randrange(10)) for _ in range(self.length)) + ":"

    def is_heldout(self, prompt: str) -> bool:
        return self.buckets > 1 and _bucket(prompt, self.buckets) == 0

    def answer(self, prompt: str) -> str:
        d = prompt.rstrip(":")
        return {"max": lambda: max(d), "last": lambda: d[-1], "copy": lambda: d, "reverse": lambda: d[::-1],
                "sort": lambda: "".join(sorted(d)), "addmod": lambda: str((int(d[0]) + int(d[1])) % 10)}[self.kind]()

    def batch(self, n: int) -> list[Item]:
        rng = random.Random(f"{self.seed}:{self.cursor}")
        self.cursor += 1
        out = []
        while len(out) < n:
            p = self._sample(rng)
            if not self.is_heldout(p):
                out.append(Item(p, self.answer(p)))
        return out

    def eval_items(self) -> list[Item]:
        return self._eval

    def reward(self, completion: str, answer: str) -> float:
        hits = sum(a == b for a, b in zip(completion, answer))
        return hits / max(len(answer), len(completion), 1)

    def correct(self, completion: str, answer: str) -> bool:
        return completion == answer

    def state(self) -> dict:
        return {"cursor": self.cursor}

    def load_state(self, s: dict):
        self.cursor = int(s["cursor"])


# ---------------------------------------------------------------------------------------------------------
# JSONL datasets and math answers

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """Final answer of a solution or completion: the last \\boxed{...}, else what follows the last '####', else the
    last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalize_answer(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\s*{([^}]*)}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\s*{([^}]*)}\s*{([^}]*)}", r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "").replace("\\%", "%")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\$", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = s.rstrip(".").strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    return re.sub(r"\s+", "", s).lower()


# a number as answers_match reads one: sign, digits, point, an exponent of at most 4 digits (a completion's
# "1e999999999" would otherwise build a billion-digit integer)
_LITERAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d{1,4})?")
_DECIMAL = re.compile(r"[-+]?\d*\.\d+")


def _as_number(s: str) -> Fraction | None:
    """A normalized answer as an exact number: a literal, or one literal over another (a \\frac); else None."""
    parts = s.replace("(", "").replace(")", "").split("/")
    if len(s) > 1000 or len(parts) > 2 or not all(_LITERAL.fullmatch(x) for x in parts):
        return None
    try:
        return Fraction(parts[0]) / Fraction(parts[1] if len(parts) == 2 else 1)
    except ZeroDivisionError:
        return None


def answers_match(pred: str | None, gold: str) -> bool:
    """Equal after normalization, or equal as exact numbers (3.0 and 3, 1/2 and 0.5; integers exactly). A decimal
    against a fraction (1/3) matches within a relative 1e-6 (0.3333333, not 0.33)."""
    if pred is None:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True
    a, b = _as_number(p), _as_number(g)
    if a is None or b is None:
        return False
    if a == b:
        return True
    return any(_DECIMAL.fullmatch(xs) and "/" in ys and abs(x - y) <= abs(y) * Fraction(1, 10 ** 6)
               for x, xs, y, ys in ((a, p, b, g), (b, g, a, p)))


def gold_answer(answer) -> str:
    """A JSONL line's "answer" as math_reward compares it: a string or a finite number; a GSM8K solution ('... ####
    72') or one with \\boxed{} reduced to its final answer. A ValueError says what is wrong."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or (
            isinstance(answer, float) and not math.isfinite(answer)):
        raise ValueError(f"answer {answer!r}: a string or a finite number")
    answer = str(answer)
    answer.encode("utf-8")  # a lone surrogate (an escaped "\ud800") raises UnicodeEncodeError, a ValueError
    gold = extract_answer(answer) if ("####" in answer or "boxed" in answer) else answer
    if gold is None or not gold.strip():
        raise ValueError(f"answer {answer!r}: no final answer")
    return gold


def completion_text(tok, out) -> str:
    """An output's completion as text, a stop token that ended it left out (what the rewards score)."""
    ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
    return tok.decode(ids)


def math_reward(completion: str, gold: str) -> float:
    return 1.0 if answers_match(extract_answer(completion), gold) else 0.0


class JsonlTask:
    """`{"prompt": ..., "answer": ...}` per line. Answers in GSM8K form ('... #### 72') or with \\boxed{} are reduced
    to their final answer. Malformed lines are skipped and counted (`bad_lines`), or fatal with strict=True."""

    def __init__(self, path: str | Path, seed: int = 0, eval_path: str | Path | None = None, eval_size: int = 64,
                 strict: bool = False, prompt_key: str = "prompt", answer_key: str = "answer"):
        self.seed, self.cursor, self.bad_lines = seed, 0, 0
        self.keys = (prompt_key, answer_key)  # the lines' (GSM8K's own files say question; MATH's problem, solution)
        self.first_bad: str | None = None  # where the first malformed line is, and what is wrong with it
        self._order: tuple[int, list[int]] = (-1, [])
        items = self._read(Path(path), strict)
        if eval_path:
            self._eval = self._read(Path(eval_path), strict)
            self.items = items
        else:  # hold out a fixed slice, chosen by content hash so it does not move when the file grows
            # (one item a prompt: a prompt held out is held out with all its copies)
            first = {}
            for it in items:
                first.setdefault(it.prompt, it)
            self._eval = sorted(first.values(), key=lambda it: _bucket(it.prompt, 2 ** 31))[:eval_size]
            held = {it.prompt for it in self._eval}
            self.items = [it for it in items if it.prompt not in held]
        if not self.items:
            raise ValueError(f"{path}: no training items left ({len(items)} read, {self.bad_lines} malformed lines"
                             + (f", the first {self.first_bad}" if self.first_bad else "")
                             + ("" if eval_path else f", {len(items) - len(self.items)} held out for evaluation: "
                                                     f"task.eval_size={eval_size}") + ")")

    def _read(self, path: Path, strict: bool) -> list[Item]:
        if not path.exists():
            raise FileNotFoundError(f"{path}: dataset not found")
        try:
            lines = jsonl_lines(path)
        except OSError as e:  # a directory, unreadable
            raise OSError(f"{path}: cannot read the dataset ({type(e).__name__}: {e.strerror or e})") from None
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json_line(line)
                if not isinstance(d, dict):
                    raise ValueError(f"a JSON object with {' and '.join(self.keys)}, not {json.dumps(d)[:40]}")
                missing = [k for k in self.keys if k not in d]
                if missing:
                    raise ValueError(f"no {' or '.join(missing)} (the line has {', '.join(d) or 'no key'}; "
                                     f"task.prompt_key and task.answer_key name others)")
                prompt, answer = (d[k] for k in self.keys)
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ValueError("empty or non-string prompt")
                prompt.encode("utf-8")  # a lone surrogate (an escaped "\ud800") raises UnicodeEncodeError
                out.append(Item(prompt, gold_answer(answer)))
            except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
                if strict:
                    raise ValueError(f"{path}:{n}: malformed line ({e})") from None
                self.bad_lines += 1
                self.first_bad = self.first_bad or f"{path}:{n}: {e}"
        return out

    def batch(self, n: int) -> list[Item]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.cursor, len(self.items))
            if self._order[0] != epoch:
                order = list(range(len(self.items)))
                random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
                self._order = (epoch, order)
            out.append(self.items[self._order[1][pos]])
            self.cursor += 1
        return out

    def eval_items(self) -> list[Item]:
        return self._eval

    def reward(self, completion: str, answer: str) -> float:
        return math_reward(completion, answer)

    def correct(self, completion: str, answer: str) -> bool:
        return math_reward(completion, answer) == 1.0

    def state(self) -> dict:
        return {"cursor": self.cursor}

    def load_state(self, s: dict):
        self.cursor = int(s["cursor"])
