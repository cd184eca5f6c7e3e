"""Tasks and rewards: the built-in digit task, JSONL datasets, math answer normalization, tokenizers."""
import collections
import json
import re

import pytest

from model.tasks import DigitTask, JsonlTask, answers_match, extract_answer, math_reward, normalize_answer
from model.tokenizer import CharTokenizer, HFTokenizer


@pytest.mark.parametrize("kind, prompt, answer", [
    ("max", "3725:", "7"), ("last", "3725:", "5"), ("copy", "3725:", "3725"), ("reverse", "3725:", "5273"),
    ("sort", "3725:", "2357"), ("addmod", "78:", "5"),
])
def test_digit_answers(kind, prompt, answer):
    assert DigitTask(kind, 4).answer(prompt) == answer


def test_digit_task_heldout_uniform_and_deterministic():
    t = DigitTask("max", 4, seed=3)
    ev = {it.prompt for it in t.eval_items()}
    assert len(ev) == 64 and all(t.is_heldout(p) for p in ev)
    answers = collections.Counter()
    for _ in range(100):
        for it in t.batch(32):
            assert it.prompt not in ev and not t.is_heldout(it.prompt)
            answers[it.answer] += 1
    # the answer is uniform over the ten digits, so a constant output earns 1/10
    assert set(answers) == set("0123456789") and max(answers.values()) / sum(answers.values()) < 0.13
    a = DigitTask("max", 4, seed=3)
    a.load_state({"cursor": 50})
    b = DigitTask("max", 4, seed=3)
    for _ in range(50):
        b.batch(32)
    assert [x.prompt for x in a.batch(8)] == [x.prompt for x in b.batch(8)]
    assert t.reward("7", "7") == 1.0 and t.reward("77", "7") == 0.5 and t.reward("", "7") == 0.0
    assert t.correct("7", "7") and not t.correct("77", "7")


@pytest.mark.parametrize("text, want", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("so the total is \\boxed{\\frac{1}{2}} dollars", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{x^{2}+1}", "x^{2}+1"),
    ("the answer is 1,234.5 apples", "1,234.5"),
    ("no number here", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("pred, gold, ok", [
    ("1,000", "1000", True), ("$1000.00", "1000", True), ("\\frac{1}{2}", "0.5", True), ("1/2", "0.50", True),
    ("50\\%", "50", True), ("\\text{72}", "72", True), ("-3", "3", False), ("x^{2}+1", "x^{2} + 1", True),
    ("0.3333333", "1/3", True), ("0.33", "1/3", False), ("\\dfrac{3}{4}", "3/4", True),
    # integers exactly (a relative 1e-6 took these as equal), one fraction bar at most (1/2/3 was read as 1.5)
    ("123456789", "123456700", False), ("1000001", "1000000", False), ("1/2/3", "1.5", False), ("1e3", "1000", True),
])
def test_answers_match(pred, gold, ok):
    assert answers_match(pred, gold) is ok


def test_math_reward_and_normalize():
    assert math_reward("We get 12 + 30 = 42. \\boxed{42}", "42") == 1.0
    assert math_reward("#### 41", "42") == 0.0
    assert normalize_answer(" $ 3,500 . ") == "3500"


def test_math_reward_never_raises_or_hangs_on_what_a_policy_writes():
    """A number past float range raised OverflowError in the driver (ending the run), and a boxed 1e999999999 built
    a billion-digit integer (the driver hung)."""
    import time
    assert math_reward("the answer is " + "9" * 400, "5") == 0.0
    assert math_reward("9" * 400, "9" * 400) == 1.0
    t0 = time.perf_counter()
    assert math_reward("\\boxed{1e999999999}", "5") == 0.0 and math_reward("\\boxed{1e9999}", "5") == 0.0
    assert time.perf_counter() - t0 < 1.0


def test_jsonl_task_lines_answers_and_held_out_copies(tmp_path):
    """Lines with U+2028 / U+2029 / U+0085 in their strings were split apart (str.splitlines) and all refused; null,
    boolean, list and NaN answers became gold answers ('None', 'True', ...); a lone surrogate raised in the hash;
    copies of a held-out prompt stayed in training."""
    ok = [{"prompt": f"q{i}\u2028\u2029\u0085?", "answer": i} for i in range(6)] + [{"prompt": "f", "answer": 2.5}]
    bad = [{"prompt": "n", "answer": None}, {"prompt": "b", "answer": True}, {"prompt": "l", "answer": [1, 2]},
           {"prompt": "s", "answer": float("nan")}]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join([json.dumps(d, ensure_ascii=False) for d in ok + bad]
                           + ['{"prompt": "\\ud800", "answer": "1"}'] + [json.dumps(d) for d in ok]) + "\n")
    t = JsonlTask(f, seed=0, eval_size=1)  # every good prompt twice
    assert t.bad_lines == 5 and t.first_bad == f"{f}:8: answer None: a string or a finite number"
    (held,) = t.eval_items()  # one prompt held out, with both its copies
    assert held.prompt not in {it.prompt for it in t.items} and len(t.items) == 12
    assert {it.answer for it in t.items} | {held.answer} == {"0", "1", "2", "3", "4", "5", "2.5"}
    with pytest.raises(ValueError, match=r"t\.jsonl:8: malformed line \(answer None"):
        JsonlTask(f, strict=True)
    twice = tmp_path / "twice.jsonl"  # a key given twice: refused, not the last one kept
    twice.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 1, "answer": 2}\n')
    with pytest.raises(ValueError, match=r"twice\.jsonl:2: malformed line \(key 'answer' given twice\)"):
        JsonlTask(twice, strict=True)
    # GSM8K's own files say question, not prompt: refused, and the error says so (it said '0 read, 2 malformed')
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps(d) + "\n" for d in ({"question": "1+1?", "answer": "#### 2"}, [1, 2],
                                                         {"prompt": "a"})))
    other = "; task.prompt_key and task.answer_key name others"
    with pytest.raises(ValueError, match=re.escape(f"{gsm}: no training items left (0 read, 3 malformed lines, the "
                                                   f"first {gsm}:1: no prompt (the line has question, answer{other}), "
                                                   f"0 held")):
        JsonlTask(gsm)
    for line, why in (({"question": "1+1?", "answer": "#### 2"}, f"no prompt (the line has question, answer{other})"),
                      ([1, 2], "a JSON object with prompt and answer, not [1, 2]"),
                      ({"prompt": "a"}, f"no answer (the line has prompt{other})"),
                      ({}, f"no prompt or answer (the line has no key{other})")):
        gsm.write_text(json.dumps(line) + "\n")
        with pytest.raises(ValueError, match=re.escape(f"{gsm}:1: malformed line ({why})")):
            JsonlTask(gsm, strict=True)
    # and read with its own keys: GSM8K's question, MATH's problem and solution (the last \\boxed{} its answer)
    gsm.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"so {i}+1 = {i + 1}\n#### {i + 1}"}) + "\n"
                           for i in range(6)))
    t = JsonlTask(gsm, eval_size=2, strict=True, prompt_key="question")
    assert sorted((it.prompt, it.answer) for it in t.items + t.eval_items()) == [(f"{i}+1?", f"{i + 1}") for i in
                                                                                range(6)]
    gsm.write_text(json.dumps({"problem": "x?", "solution": "it is $\\boxed{\\frac{1}{2}}$."}) + "\n" +
                   json.dumps({"problem": "y?", "solution": "\\boxed{3}"}) + "\n")
    t = JsonlTask(gsm, eval_size=1, strict=True, prompt_key="problem", answer_key="solution")
    assert sorted(it.answer for it in t.items + t.eval_items()) == ["3", "\\frac{1}{2}"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(12)))
    with pytest.raises(ValueError, match=r"no training items left \(12 read, 0 malformed.*task\.eval_size=64"):
        JsonlTask(small)


def test_jsonl_files_saved_with_a_byte_order_mark(tmp_path):
    """A leading UTF-8 BOM (Windows editors write one) made the first line 'not JSON' for the task and the rollout
    CLI alike; it is dropped, and a BOM anywhere else is still the line's own text."""
    from rollout_server import SamplingParams, read_prompts
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"prompt": f"p{i}?", "answer": i}) + "\n"
                                           for i in range(8)).encode())
    t = JsonlTask(f, seed=0, eval_size=2, strict=True)
    assert t.bad_lines == 0 and len(t.items) + len(t.eval_items()) == 8
    f.write_bytes(b"\xef\xbb\xbf[3, 4]\n" + json.dumps({"prompt_token_ids": [5]}).encode() + b"\n")
    assert [p for p, *_ in read_prompts(f, None, 32, SamplingParams())] == [[3, 4], [5]]
    f.write_bytes(b"[3, 4]\n\xef\xbb\xbf[5]\n")
    with pytest.raises(SystemExit, match="bom.jsonl:2: not JSON"):
        read_prompts(f, None, 32, SamplingParams())


def test_jsonl_task_bad_lines_and_split(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}?", "answer": f"work... #### {i}"}) for i in range(20)]
    lines += ["{not json", json.dumps({"prompt": "no answer"}), json.dumps({"prompt": "  ", "answer": "1"}),
              json.dumps({"prompt": "boxed", "answer": "it is \\boxed{7}"})]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(lines) + "\n\n")
    t = JsonlTask(f, seed=0, eval_size=4)
    assert t.bad_lines == 3
    assert len(t.eval_items()) == 4 and len(t.items) == 17
    assert {it.answer for it in t.items + t.eval_items()} == {str(i) for i in range(20)} | {"7"}
    assert not {it.prompt for it in t.eval_items()} & {it.prompt for it in t.items}
    first = [it.prompt for it in t.batch(40)]  # more than an epoch: every item once per epoch
    assert sorted(first[:17]) == sorted(it.prompt for it in t.items)
    with pytest.raises(ValueError, match=r"train\.jsonl:21: malformed line"):
        JsonlTask(f, strict=True)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        JsonlTask(tmp_path / "missing.jsonl")
    with pytest.raises(OSError, match=r": cannot read the dataset \(IsADirectoryError"):  # was "[Errno 21] ..." alone
        JsonlTask(tmp_path)


def test_hf_tokenizer_trained_here_with_chat_template(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", "<user>", "<assistant>"])
    tok.train_from_iterator(["what is two plus two", "the answer is four", "how many apples are left"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path, template="<user> {prompt} <assistant>", bos="<s>", eos="</s>")
    ids = hf.apply_chat("what is two plus two")
    assert ids[0] == hf.bos_id and hf.eos_id == tok.token_to_id("</s>")
    assert tok.token_to_id("<assistant>") == ids[-1]
    assert hf.decode(hf.encode("the answer is four")).replace(" ", "") == "theansweris" + "four"
    with pytest.raises(ValueError, match="eos token"):
        HFTokenizer(tmp_path, eos="<nope>")
    with pytest.raises(ValueError, match="placeholder"):
        HFTokenizer(tmp_path, template="no slot")
    # "{{prompt}}" is a literal brace pair, not a placeholder: every prompt came out the same text
    with pytest.raises(ValueError, match="has no {prompt} placeholder"):
        HFTokenizer(tmp_path, template="<user> {{prompt}} <assistant>")
    assert HFTokenizer(tmp_path, template="{prompt:>3}").apply_chat("two") == hf.encode("two")
    assert hf.decode([hf.vocab_size, 10 ** 6]) == ""  # a model's vocabulary padded past the tokenizer's
    with pytest.raises(ValueError, match="negative token id -1"):  # was a bare OverflowError
        hf.decode([5, -1])


def test_char_tokenizer():
    t = CharTokenizer("0123456789:")
    assert t.vocab_size == 14 and t.apply_chat("12:") == [1, 4, 5, 13]
    assert t.decode([4, 5, 2, 13]) == "12:"
    with pytest.raises(ValueError, match="negative token id -2"):
        t.decode([4, -2])
    assert CharTokenizer("01", vocab_size=8).decode([3, 7, 99]) == "0"  # ids past the alphabet: nothing
    with pytest.raises(ValueError, match="not in the built-in alphabet"):
        t.encode("a")
