import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Every test starts from the same global RNG state, whatever ran before it. (Module-scoped fixtures are set
    up before this one: they draw from their own seeded generators, as `input_dependent` does.)"""
    random.seed(0)
    torch.manual_seed(0)


def input_dependent(model, seed: int = 0):
    """The model with its matrices (the hyper-connection ones aside) redrawn at 1/sqrt(fan-in), larger than the
    training init so that attention, the indexer and routing depend on the input; the same weights in every run."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "hc_" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (FP8 tensors too, which torch.equal does not take everywhere)."""
    def raw(t):
        return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
    return a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def all_tensors(path) -> dict:
    """Every tensor of a checkpoint directory's safetensors files, by its stored name."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite_checkpoint(path, tensors: dict):
    """The checkpoint directory's tensors replaced by `tensors`, one file and its index (config.json kept)."""
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in tensors}}))


def saved_activation_bytes(model, B: int, T: int) -> int:
    """Bytes of the tensors autograd saves in one training forward of (B, T) random tokens through model (scored at
    every position), each storage once, parameters and buffers aside: what model.plan's activations model."""
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            seen[st.data_ptr()] = st.nbytes()
        return t
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.cfg.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, targets_mask=torch.ones(B, T - 1, device=dev))
    return sum(seen.values())


@pytest.fixture
def locked_dir(tmp_path) -> Path:
    """A directory no file can be made in: a read-only one, or /proc where the tests run as root (who writes in
    any mode)."""
    if os.geteuid() == 0 and Path("/proc/self").is_dir():
        return Path("/proc")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return locked


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
