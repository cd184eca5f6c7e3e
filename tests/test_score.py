"""python -m model.score: per-token NLL of token sequences under a checkpoint, and its input checks."""
import dataclasses
import json

import pytest
import torch

from model import build_model, load_pretrained
from model.config import ModelConfig, load_yaml
from model.score import main


def test_score_equals_the_models_own_nll_and_survives_the_release_round_trip(tmp_path, capsys):
    seqs = [[1, 5, 7, 2, 9], [3, 3], [13, 0, 4, 8, 8, 12, 6, 1, 2, 10, 11]]
    f = tmp_path / "t.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(s) + "\n\n" for s in seqs).encode())  # a BOM, blank lines
    r = main(["--init", "configs/tiny.yaml", "--tokens", str(f), "--seed", "3", "--device", "cpu"])
    m = build_model(ModelConfig.from_dict(load_yaml("configs/tiny.yaml")["model"]), "cpu", torch.float32, seed=3)
    nll = 0.0
    with torch.no_grad():
        for s in seqs:
            lp = m(torch.tensor([s]))[0].float().log_softmax(-1)
            nll -= sum(lp[i, s[i + 1]].item() for i in range(len(s) - 1))
    n = sum(len(s) - 1 for s in seqs)
    assert (r["sequences"], r["tokens"]) == (3, n)
    assert r["nll_per_token"] == pytest.approx(nll / n, rel=1e-5)
    assert f"3 sequences, {n} predicted tokens: nll/token {nll / n:.4f}" in capsys.readouterr().out
    # --save writes the release layout (FP8 linears with block scales) and scores what it reads back, as --model does
    saved = main(["--init", "configs/tiny.yaml", "--save", str(tmp_path / "m"), "--tokens", str(f), "--seed", "3",
                  "--device", "cpu"])
    again = main(["--model", str(tmp_path / "m"), "--tokens", str(f), "--device", "cpu"])
    assert again["nll_per_token"] == saved["nll_per_token"]
    assert saved["nll_per_token"] == pytest.approx(r["nll_per_token"], rel=1e-3)  # FP8 rounding of the weights
    # (no MTP weights are written, so the saved config.json says 0 of them)
    assert load_pretrained(tmp_path / "m").cfg == dataclasses.replace(m.cfg, num_nextn_predict_layers=0)


def test_bad_token_files_and_arguments_are_named(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    base = ["--init", "configs/tiny.yaml", "--device", "cpu", "--tokens", str(f)]
    for text, said in [("[1, 2]\n[4]\n", "t.jsonl:2: expected a list of >= 2 token ids in [0, 14)"),
                       ("[1, 2]\n[4, 14]\n", "t.jsonl:2: expected a list of >= 2 token ids in [0, 14)"),
                       ("[1, true]\n", "t.jsonl:1: expected a list of >= 2 token ids"),
                       ('{"ids": [1, 2]}\n', "t.jsonl:1: expected a list of >= 2 token ids"),
                       ("[1, 2\n", "t.jsonl:1: not JSON"),
                       ("\n\n", "t.jsonl: no sequences")]:
        f.write_text(text)
        with pytest.raises(SystemExit) as e:
            main(base)
        assert said in str(e.value.code), (text, e.value.code)
    f.write_bytes(b"[1, 2]\n\xff\n")
    with pytest.raises(SystemExit) as e:
        main(base)
    assert "t.jsonl: not UTF-8 text" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        main(["--init", "configs/tiny.yaml", "--device", "cpu", "--tokens", str(tmp_path / "none.jsonl")])
    assert "none.jsonl: cannot read (FileNotFoundError" in str(e.value.code)
    with pytest.raises(SystemExit):
        main(["--init", "configs/tiny.yaml", "--device", "cpu", "--seq-len", "1"])
    assert "--seq-len 1 / --num-seqs 8: at least 2 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "nowhere"), "--device", "cpu"])
    assert "nowhere" in str(e.value.code)
