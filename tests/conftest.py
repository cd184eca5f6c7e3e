import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Every test starts from the same global RNG state, whatever ran before it (module fixtures that draw from
    the global generator included)."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def bpe(tmp_path):
    """make(texts) trains a small BPE tokenizer.json in tmp_path (the tokenizers extra) and returns the tokenizer;
    tmp_path is then a tokenizer directory for task.tokenizer."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def make(texts, vocab_size=120, specials=("<unk>", "<s>", "</s>", "<user>", "<bot>")):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials)))
        tok.save(str(tmp_path / "tokenizer.json"))
        return tok
    return make
