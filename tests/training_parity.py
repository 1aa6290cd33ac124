"""Training parity of a patched layout with the original: the same optimizer steps on the unpatched model and on the
model loaded with a layout-changing recipe give the same weights, compared in the checkpoint layout.

Used by tests/test_training_parity.py. Each pair starts from one checkpoint (a tiny model with distinct random expert
weights, saved with ``save_pretrained``): the unpatched model is that model, the patched one is the checkpoint loaded
with the recipe. Both see the same batches, run forward + backward, then one step of the same optimizer; after the
last step both are handed out in the checkpoint layout (:func:`modelpatch.iter_original_state_dict`) and compared
key for key. Batches are short (one sequence of two tokens with top-2 routing over 4 or more experts), so some
expert receives no token in some step: that expert's gradient must be zero, not ``None``, so the optimizer steps it
(momentum, Adam moments, weight decay) exactly as it steps the expert's zero-gradient slice of the fused tensor.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import linear_experts_support as les
import routing_coverage as rc
from modelpatch import iter_original_state_dict
from modelpatch.recipes import get_recipe
from modelpatch.recipes.linear_experts import LinearExperts

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.1),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
    "adafactor": lambda params, lr: torch.optim.Adafactor(params, lr=lr, weight_decay=0.1),
    # Adafactor divides by max(sqrt(v), eps1): with the default eps1 (float32 eps, 1.2e-7) a gradient element near
    # 1e-8 turns 1e-10 of rounding noise into 1e-3 of weight; a larger eps1 keeps that out of a comparison
    "adafactor-eps1e-4": lambda params, lr: torch.optim.Adafactor(params, lr=lr, weight_decay=0.1, eps=(1e-4, 1e-3)),
}
"""The optimizers of the parity suite: ``{name: (params, lr) -> optimizer}`` (SGD with momentum and weight decay,
Adam, AdamW with weight decay, torch's factored Adafactor with weight decay)."""

LEARNING_RATES = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3, "adafactor": 1e-2, "adafactor-eps1e-4": 1e-2}


@dataclass
class Parity:
    """What one patched-vs-unpatched training run measured.

    Attributes:
        diffs: ``{checkpoint key: max abs difference}`` of the weights after the last step (checkpoint layout).
        moved: ``{checkpoint key: max abs change}`` of the unpatched weights over the run (what the steps did).
        idle_expert_steps: (layer, expert, step) triples of the patched model whose expert got no token (every
            gradient of it exactly zero).
        none_grads: names of trainable patched parameters left with ``grad=None`` after a backward pass, less those
            the unpatched model leaves without a gradient too (a routing bias updated outside autograd).
        keys_equal: both models hand out the same checkpoint keys.
        expert_keys: the checkpoint keys of expert tensors (converted keys, or keys under a fused experts module).
        noise: max abs difference between two equivalent unpatched runs (``experts_implementation="batched_mm"``
            or ``attn_implementation="sdpa"`` against the eager one), when measured.
        relative: ``{checkpoint key: ||patched - unpatched|| / ||unpatched - start||}`` (L2 norms over the tensor):
            the difference as a share of what the steps did, for keys the steps moved.
        noise_relative: the largest :attr:`relative` figure of the two equivalent unpatched runs, when measured.
    """

    diffs: dict[str, float] = field(default_factory=dict)
    moved: dict[str, float] = field(default_factory=dict)
    idle_expert_steps: list[tuple[str, int, int]] = field(default_factory=list)
    none_grads: list[str] = field(default_factory=list)
    keys_equal: bool = True
    noise: float | None = None
    expert_keys: set[str] = field(default_factory=set)
    relative: dict[str, float] = field(default_factory=dict)
    noise_relative: float | None = None

    @property
    def max_diff(self) -> float:
        return max(self.diffs.values(), default=0.0)

    def worst(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.diffs.items(), key=lambda kv: -kv[1])[:n]


def original_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in the checkpoint layout, detached fp32 copies."""
    return {k: v.detach().float().clone() for k, v in iter_original_state_dict(model)}


def scalar_loss(output) -> torch.Tensor:
    """A scalar of every output position: the language-model loss where labels were given, else the mean square of
    the logits / last hidden state (every family's output, one loss)."""
    if getattr(output, "loss", None) is not None:
        return output.loss
    out = output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state
    return out.float().pow(2).mean()


def batches(model_type: str, model: torch.nn.Module, steps: int, tokens: int = 2) -> list[dict]:
    """``steps`` batches of one sequence of ``tokens`` positions (token ids, or embeddings for the models fed
    hidden states), different per step, the same for both models."""
    base = rc._inputs(model_type, model)
    out = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if "input_ids" in base:
            vocab = min(100, model.config.get_text_config().vocab_size)
            out.append({"input_ids": torch.randint(3, vocab, (1, tokens), generator=g)})
        elif "inputs_embeds" in base:
            out.append({"inputs_embeds": torch.randn(1, tokens, model.config.hidden_size, generator=g)})
        else:
            out.append(base)
    return out


def _idle(model: torch.nn.Module, step: int) -> list[tuple[str, int, int]]:
    found = []
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts):
            for e, expert in enumerate(module):
                grads = [p.grad for p in expert.parameters() if p.requires_grad]
                if grads and all(g is not None and not g.any() for g in grads):
                    found.append((name, e, step))
    return found


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[dict],
    *,
    step: Callable | None = None,
    parity: Parity | None = None,
    autocast: torch.dtype | None = None,
) -> None:
    """One optimizer step per batch of ``data`` (``step``: a compiled ``model -> loss`` to use instead of eager;
    ``autocast``: the forward under ``torch.autocast("cpu", dtype=autocast)``)."""
    model.train()
    for i, batch in enumerate(data):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(i)  # dropout, router jitter: the same draws in both models
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = step(batch) if step is not None else scalar_loss(model(**batch))
        loss.backward()
        if parity is not None:
            parity.none_grads += [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            parity.idle_expert_steps += _idle(model, i)
        optimizer.step()


def _untrained_modules(patched: torch.nn.Module, reference: torch.nn.Module, names: list[str]) -> list[str]:
    """Of the patched parameters in ``names`` (no gradient), those under an experts module whose fused original had
    no gradient either (the module never ran: a modality the batch does not have)."""
    ref = dict(reference.named_parameters())
    paths = [n for n, m in patched.named_modules() if isinstance(m, LinearExperts)]
    out = []
    for name in names:
        path = max((p for p in paths if name.startswith(p + ".")), key=len, default=None)
        under = [p for n, p in ref.items() if path is not None and n.startswith(path + ".")]
        if path is not None and under and all(p.grad is None for p in under):
            out.append(name)
    return out


def compare(patched: torch.nn.Module, reference: torch.nn.Module, start: dict[str, torch.Tensor], parity: Parity):
    got, want = original_state(patched), original_state(reference)
    parity.keys_equal = sorted(got) == sorted(want)
    own = dict(reference.named_parameters())
    fused = [name for name, _ in les._decorated(reference)]
    parity.expert_keys = {k for k in want if k not in own or any(k.startswith(f + ".") for f in fused)}
    for key, value in want.items():
        if key in got:
            parity.diffs[key] = (got[key] - value).abs().max().item()
        if key in start:
            parity.moved[key] = (value - start[key]).abs().max().item()
            if key in got:
                parity.relative[key] = _relative(got[key], value, start[key])


def _relative(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    moved = (want - start).norm().item()
    return (got - want).norm().item() / moved if moved > 0 else 0.0


def load(cls: type, path: Path, recipe: str | None, **kwargs) -> torch.nn.Module:
    """``cls.from_pretrained(path, **kwargs)`` (eager attention unless ``kwargs`` say otherwise), inside ``recipe``."""
    kwargs = {"attn_implementation": "eager"} | kwargs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if recipe is None:
            return cls.from_pretrained(path, **kwargs)
        with get_recipe(recipe).apply():
            return cls.from_pretrained(path, **kwargs)


_SMALLER = {
    # its second layer's own attention sizes (per_layer_config) are the real model's: 39M parameters, 60 s of steps
    "dots3_note_text": dict(
        per_layer_config={
            "1": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, head_dim=16)
            | dict(qk_nope_head_dim=8, v_head_dim=16, qk_rope_head_dim=8)
        },
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        shared_experts_intermediate_size=32,
    ),
}
"""Config overrides of the training pairs, beyond the routing tests' tiny configs (tests/routing_models.py)."""


def family_checkpoint(model_type: str, text_type: str, folder: Path) -> tuple[torch.nn.Module, type]:
    """A tiny model of ``text_type`` with 4 experts of distinct random weights, saved to ``folder``."""
    torch.manual_seed(0)
    model = les._build(rc.tiny_config(text_type, **les._four_experts(text_type), **_SMALLER.get(text_type, {})))
    generator = torch.Generator().manual_seed(0)
    for _, experts in les._decorated(model):
        les._randomize(experts, generator)
    model.save_pretrained(folder)
    return model, type(model)


def run_pair(
    model_type: str,
    recipe: str,
    optimizers: list[str],
    *,
    text_type: str | None = None,
    steps: int = 3,
    compiled: bool | str = False,
    checkpoint: Callable[[Path], tuple[torch.nn.Module, type]] | None = None,
    configure: Callable[[torch.nn.Module], None] | None = None,
    data: list[dict] | None = None,
    noise: dict | None = None,
    load_kwargs: dict | None = None,
    autocast: torch.dtype | None = None,
) -> dict[str, Parity]:
    """``{optimizer name: Parity}`` of ``steps`` steps of each optimizer on the unpatched model and the model
    loaded with ``recipe`` (``compiled``: the patched model's forward + loss under ``torch.compile``;
    ``configure``: called on both models before training, e.g. to enable gradient checkpointing; ``noise``: load
    arguments of an equivalent unpatched run, e.g. ``{"experts_implementation": "batched_mm"}``, whose difference
    from the eager one is :attr:`Parity.noise`; ``load_kwargs``: more ``from_pretrained`` arguments of every model, e.g.
    ``{"dtype": torch.bfloat16}``; ``autocast``: every forward under CPU autocast to that dtype)."""
    text_type = text_type or model_type
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        if checkpoint is None:
            _, cls = family_checkpoint(model_type, text_type, folder)
        else:
            _, cls = checkpoint(folder)
        load_kwargs = load_kwargs or {}
        unpatched, patched_base = load(cls, folder, None, **load_kwargs), load(cls, folder, recipe, **load_kwargs)
        start = original_state(unpatched)
        inputs = data or batches(text_type, unpatched, steps)
        for name in optimizers:
            reference, patched = copy.deepcopy(unpatched), copy.deepcopy(patched_base)
            for model in (reference, patched):
                if configure is not None:
                    configure(model)
            lr = LEARNING_RATES[name]
            parity = Parity()
            untouched = Parity()
            train(
                reference,
                OPTIMIZERS[name](list(reference.parameters()), lr),
                inputs,
                parity=untouched,
                autocast=autocast,
            )
            step = None
            if compiled:
                torch._dynamo.reset()
                step = torch.compile(
                    lambda batch, model=patched: scalar_loss(model(**batch)),
                    backend=compiled if isinstance(compiled, str) else "inductor",
                )
            train(
                patched,
                OPTIMIZERS[name](list(patched.parameters()), lr),
                inputs,
                step=step,
                parity=parity,
                autocast=autocast,
            )
            unused = set(untouched.none_grads) | set(_untrained_modules(patched, reference, parity.none_grads))
            parity.none_grads = [n for n in parity.none_grads if n not in unused]
            compare(patched, reference, start, parity)
            if noise is not None:
                other = load(cls, folder, None, **(load_kwargs | noise))
                if configure is not None:
                    configure(other)
                train(other, OPTIMIZERS[name](list(other.parameters()), lr), inputs, autocast=autocast)
                b, a = original_state(other), original_state(reference)
                parity.noise = max((b[k] - a[k]).abs().max().item() for k in a)
                parity.noise_relative = max(_relative(b[k], a[k], start[k]) for k in a if k in start)
            results[name] = parity
    return results
