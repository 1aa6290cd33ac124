"""The input both models get, and the output compared.

Input: text through the model's own tokenizer when its folder has one (two sentences of different lengths, padded),
else fixed token ids ``(2, 12)`` long, ``(7 * i + 3) % vocab_size``. Output: ``logits`` when the model returns them
(float32 ``(B, T, V)``), else the mean-pooled ``last_hidden_state`` over the attention mask (float32 ``(B, H)``, the
sentence embedding of sentence-transformers' mean pooling).
"""

from __future__ import annotations

import os

import torch

__all__ = ["SENTENCES", "has_tokenizer", "model_inputs", "model_output"]

SENTENCES = (
    "modelpatch checks that a patched model still computes the same thing.",
    "A shorter second sentence.",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "spiece.model")


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def model_inputs(model_dir: str, config) -> tuple[dict, str]:
    """``(inputs for model(**inputs), description)``."""
    if has_tokenizer(model_dir):
        from transformers import AutoTokenizer

        from .checkpoint import remote_code_kwargs

        tokenizer = AutoTokenizer.from_pretrained(model_dir, **remote_code_kwargs())
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        encoded = tokenizer(list(SENTENCES), padding=True, return_tensors="pt")
        return dict(encoded), f"{len(SENTENCES)} sentences through the model's tokenizer"
    vocab = int(getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", None) or 100)
    ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % vocab
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "fixed token ids (2, 12)"


@torch.no_grad()
def model_output(model, inputs: dict) -> tuple[torch.Tensor, str]:
    """``(float32 tensor, kind)`` where kind is ``"logits"`` or ``"mean-pooled embeddings"``."""
    out = model(**inputs)
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits.float(), "logits"
    hidden = out.last_hidden_state.float()
    mask = inputs.get("attention_mask")
    mask = torch.ones(hidden.shape[:2]) if mask is None else mask.to(hidden.dtype)
    summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
    return summed / mask.sum(dim=1, keepdim=True).clamp(min=1e-9), "mean-pooled embeddings"
