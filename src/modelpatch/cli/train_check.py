"""``modelpatch verify --train``: the same optimizer steps on the unpatched and the patched model, compared per
checkpoint key.

Both models start from the same checkpoint (loaded in float32). Each of ``steps`` steps feeds both the same
generated batch (one sequence of ``tokens`` token ids drawn from a seeded generator, a new one per step), runs
forward, the loss (the model's own language-model loss with ``labels=input_ids`` for ``*ForCausalLM`` /
``*ForMaskedLM`` classes, else the mean square of the logits or of the last hidden state) and backward, then one
step of the same optimizer (:data:`OPTIMIZERS`). ``torch.manual_seed(seed + step)`` runs before each forward, so
dropout draws the same masks in both. After the last step both models are handed out in the checkpoint layout
(:func:`modelpatch.iter_original_state_dict`) and compared key by key: the max abs difference of each checkpoint
key, against the bound of the optimizer (:meth:`TrainOptimizer.bound`, fp32 rounding noise measured by
tests/test_training_parity.py):

* SGD (momentum 0.9, weight decay 0.1): ``1e-6`` at lr <= 0.05 (measured max 6e-8 after 3 steps at lr 0.05), scaled
  with lr above (an SGD step is linear in lr);
* Adam / AdamW (weight decay 0.1): ``0.05 * lr``: the update is ``lr * m / (sqrt(v) + eps)``, so a gradient element
  that is nearly zero turns rounding noise into a difference of up to ``lr`` per step (measured max 5.6e-3 * lr
  after 3 steps);
* Adafactor (torch's, weight decay 0.1, ``eps=(1e-4, 1e-3)``: the default ``eps1`` of 1.2e-7 would turn the rounding
  noise of near-zero gradients into 1e-3 of weight): ``0.05 * lr``. Adafactor's factored statistics and its RMS
  scaling are per tensor, so a tensor stored in another layout (a fused ``qkv_proj``, per-expert linears instead of
  a fused ``gate_up_proj``) legitimately takes another step; such keys are reported (``layout-dependent``), not
  judged, and the keys both models store in the same layout are judged after the first step (from the second step
  on, the other tensors' different steps reach their gradients).

A key beyond its bound is not yet a failure: both models (``float64=`` loader: fresh loads in float64, with
Transformers' eager experts) take the same steps again in float64, where rounding is ~2e-9 of fp32's. A key within
``bound x 1e-4`` there differs by fp32 rounding only (``fp32 rounding``: typically a key bias, whose gradient is zero
in exact arithmetic because softmax ignores a constant shift of every score, so Adam's ``m / sqrt(v)`` turns pure
rounding noise into steps of up to lr); a key still beyond it has ``DIVERGED``.

Also recorded: which experts got no token in which step (the top-k indices each experts module of the unpatched
model receives: a class decorated with Transformers' ``@use_experts_implementation``, or linear experts), and every
trainable parameter of the patched model left with ``grad=None`` after a backward pass while the unpatched model
gave a gradient to the same parameter (same name) or, for a parameter the unpatched model does not have, to a
parameter under the deepest module path both models share (an idle expert ``experts.3.up_proj.weight`` of linear
experts against the fused ``experts.gate_up_proj``). Such a parameter is skipped by the optimizer (no momentum, no
moment decay, no weight decay) where the original is stepped.

Memory: besides both models, the unpatched model's weights before and after training are kept once each in the
checkpoint layout (float32); the patched model's are streamed. The float64 re-run, when there is one, loads both
models again in float64 (four times the memory of one float32 model).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..conversion import iter_original_state_dict
from ..undo import UndoStack
from .errors import CliError

__all__ = [
    "TrainOptimizer",
    "OPTIMIZERS",
    "DEFAULT_STEPS",
    "DEFAULT_TOKENS",
    "KeyDiff",
    "IdleExperts",
    "MissingGrad",
    "TrainResult",
    "run_train_check",
    "render",
]

DEFAULT_STEPS = 3
DEFAULT_TOKENS = 4
"""Tokens per step: one short sequence, so that in most MoE layers some expert gets no token in some step (the case
where a replacement most easily trains differently: a gradient of ``None`` instead of zero)."""

SGD_BOUND = 1e-6
SGD_BOUND_LR = 0.05
ADAM_BOUND = 0.05
FLOAT64_FACTOR = 1e-4


@dataclass(frozen=True)
class TrainOptimizer:
    """An optimizer ``verify --train`` runs.

    Attributes:
        name: the ``--optimizer`` value.
        default_lr: the learning rate without ``--lr``.
        settings: its other settings, as shown in the report (``"weight_decay=0.1"``).
        build: ``(parameters, lr) -> torch.optim.Optimizer``.
        per_tensor: its step depends on statistics of the whole tensor (Adafactor), so tensors stored in another
            layout take other steps.
    """

    name: str
    default_lr: float
    settings: str
    build: Callable[[list[nn.Parameter], float], torch.optim.Optimizer]
    per_tensor: bool = False

    def bound(self, lr: float) -> float:
        """The largest max abs difference of a checkpoint key that fp32 rounding explains after the steps at
        ``lr`` (see the module docstring)."""
        if self.name == "sgd":
            return SGD_BOUND * max(1.0, lr / SGD_BOUND_LR)
        return ADAM_BOUND * lr

    def bound_text(self, lr: float) -> str:
        if self.name == "sgd":
            scaled = f" x lr/{SGD_BOUND_LR:g}" if lr > SGD_BOUND_LR else ""
            return f"{self.bound(lr):g} (SGD: {SGD_BOUND:g}{scaled}, fp32 rounding noise)"
        return (
            f"{self.bound(lr):g} ({ADAM_BOUND:g} x lr: near-zero gradients turn rounding noise into up to lr per step)"
        )

    def bound64(self, lr: float) -> float:
        """The bound of the same steps in float64 (fp64 rounding is ~2e-9 of fp32's: the fp32 bound times 1e-4 leaves room)."""
        return self.bound(lr) * FLOAT64_FACTOR

    def describe(self, lr: float) -> str:
        return f"{self.name} (lr={lr:g}, {self.settings})"


OPTIMIZERS: dict[str, TrainOptimizer] = {
    o.name: o
    for o in (
        TrainOptimizer(
            "sgd",
            0.05,
            "momentum=0.9, weight_decay=0.1",
            lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.1),
        ),
        TrainOptimizer("adam", 1e-3, "torch.optim.Adam defaults", lambda params, lr: torch.optim.Adam(params, lr=lr)),
        TrainOptimizer(
            "adamw", 1e-3, "weight_decay=0.1", lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
        ),
        TrainOptimizer(
            "adafactor",
            1e-2,
            "weight_decay=0.1, eps=(1e-4, 1e-3)",
            lambda params, lr: torch.optim.Adafactor(params, lr=lr, weight_decay=0.1, eps=(1e-4, 1e-3)),
            per_tensor=True,
        ),
    )
}
"""``{name: TrainOptimizer}``: SGD with momentum and weight decay, Adam, AdamW and torch's Adafactor with weight
decay (the optimizers of tests/test_training_parity.py)."""


@dataclass(frozen=True)
class KeyDiff:
    """One checkpoint key after the steps.

    Attributes:
        key: the checkpoint key (``iter_original_state_dict`` name).
        max_abs_diff: max abs difference patched vs unpatched after the last step.
        moved: max abs change of the unpatched weights over the steps (what the steps did).
        judged: the value compared with the bound (``max_abs_diff``, or for a per-tensor optimizer the difference
            after the first step), ``None`` for a key that is not judged (layout-dependent under Adafactor).
        float64: the judged difference when both models were trained again in float64 (only when some key was
            beyond the bound), compared with the float64 bound: a key beyond the fp32 bound but within that one
            differs by fp32 rounding (a gradient that is zero in exact arithmetic, e.g. a key bias, which Adam's
            ``m / sqrt(v)`` turns into steps of up to lr).
    """

    key: str
    max_abs_diff: float
    moved: float
    judged: float | None
    float64: float | None = None

    def status(self, bound: float, bound64: float) -> str:
        """``ok``, ``fp32 rounding`` (beyond ``bound``, within ``bound64`` in float64), ``DIVERGED`` or
        ``layout-dependent`` (not judged)."""
        if self.judged is None:
            return "layout-dependent"
        if self.judged <= bound:
            return "ok"
        return "fp32 rounding" if self.float64 is not None and self.float64 <= bound64 else "DIVERGED"

    def as_dict(self, bound: float, bound64: float) -> dict:
        return {
            "key": self.key,
            "max_abs_diff": self.max_abs_diff,
            "moved": self.moved,
            "judged": self.judged,
            "float64": self.float64,
            "status": self.status(bound, bound64),
        }


@dataclass(frozen=True)
class IdleExperts:
    """Experts of one experts module that got no token in one step (0-based)."""

    module: str
    step: int
    experts: tuple[int, ...]
    num_experts: int

    def as_dict(self) -> dict:
        return {"module": self.module, "step": self.step, "experts": list(self.experts), "of": self.num_experts}


@dataclass(frozen=True)
class MissingGrad:
    """A trainable parameter of the patched model with ``grad=None`` after backward in ``steps`` (0-based), whose
    counterpart in the unpatched model (``reference``: the same parameter, or the parameters under the module path
    both models share) did get a gradient."""

    parameter: str
    steps: tuple[int, ...]
    reference: str

    def as_dict(self) -> dict:
        return {"parameter": self.parameter, "steps": list(self.steps), "unpatched_gradient_on": self.reference}


@dataclass
class TrainResult:
    """What ``verify --train`` measured; ``as_dict()`` is its part of the ``--json`` document."""

    optimizer: str
    lr: float
    steps: int
    tokens: int
    seed: int
    settings: str = ""
    bound: float = 0.0
    bound_text: str = ""
    bound64: float = 0.0
    float64_note: str = ""
    loss_kind: str = ""
    batch: str = ""
    keys: list[KeyDiff] = field(default_factory=list)
    only_unpatched: list[str] = field(default_factory=list)
    only_patched: list[str] = field(default_factory=list)
    idle: list[IdleExperts] = field(default_factory=list)
    experts_modules: int = 0
    missing_grads: list[MissingGrad] = field(default_factory=list)
    losses: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def diverged(self) -> list[KeyDiff]:
        """The keys beyond the bound, largest difference first."""
        bad = [k for k in self.keys if k.status(self.bound, self.bound64) == "DIVERGED"]
        return sorted(bad, key=lambda k: -(k.judged or 0.0))

    @property
    def rounding(self) -> list[KeyDiff]:
        """The keys beyond the bound that agree in float64 (fp32 rounding), largest difference first."""
        found = [k for k in self.keys if k.status(self.bound, self.bound64) == "fp32 rounding"]
        return sorted(found, key=lambda k: -(k.judged or 0.0))

    @property
    def max_diff(self) -> float:
        """The largest judged difference of the keys not explained by fp32 rounding."""
        rounding = {k.key for k in self.rounding}
        return max((k.judged for k in self.keys if k.judged is not None and k.key not in rounding), default=0.0)

    @property
    def max_moved(self) -> float:
        return max((k.moved for k in self.keys), default=0.0)

    @property
    def compared(self) -> bool:
        """The steps moved some weight beyond the bound (else nothing could be told apart from noise)."""
        return self.max_moved > self.bound

    @property
    def nonfinite_loss(self) -> tuple[str, int, float] | None:
        """``(run, step, loss)`` of the first loss that is not finite (NaN or inf: no gradient to compare), or
        ``None``."""
        for label in ("unpatched", "patched"):
            for step, value in enumerate(self.losses.get(label, ()), start=1):
                if not math.isfinite(value):
                    return label, step, value
        return None

    @property
    def ok(self) -> bool:
        return (
            self.nonfinite_loss is None
            and not self.diverged
            and not self.only_patched
            and not self.only_unpatched
            and not self.missing_grads
            and self.compared
        )

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "nonfinite_loss": list(self.nonfinite_loss) if self.nonfinite_loss is not None else None,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "settings": self.settings,
            "steps": self.steps,
            "tokens_per_step": self.tokens,
            "seed": self.seed,
            "batch": self.batch,
            "loss": self.loss_kind,
            "bound": self.bound,
            "bound_rule": self.bound_text,
            "bound_float64": self.bound64,
            "float64_rerun": self.float64_note or None,
            "max_abs_diff": self.max_diff,
            "max_moved": self.max_moved,
            "diverged": [k.key for k in self.diverged],
            "fp32_rounding": [k.key for k in self.rounding],
            "keys": [k.as_dict(self.bound, self.bound64) for k in self.keys],
            "keys_only_unpatched": self.only_unpatched,
            "keys_only_patched": self.only_patched,
            "experts_modules": self.experts_modules,
            "idle_experts": [i.as_dict() for i in self.idle],
            "missing_gradients": [m.as_dict() for m in self.missing_grads],
            "losses": self.losses,
            "seconds": self.seconds,
        }


def _is_experts_module(module: nn.Module) -> bool:
    """A fused experts module (a class decorated with ``@use_experts_implementation``: the decorator sets these
    attributes) or linear experts."""
    from ..recipes.linear_experts import LinearExperts

    if isinstance(module, LinearExperts):
        return True
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "_is_expert_parallel"))


def _num_experts(module: nn.Module) -> int | None:
    value = getattr(module, "num_experts", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    for param in module.parameters(recurse=False):
        if param.dim() == 3:
            return int(param.shape[0])
    return None


class _ExpertsProbe:
    """Forward pre-hooks on every experts module of a model: the expert indices each one receives per step."""

    def __init__(self, model: nn.Module):
        self.modules: dict[str, int] = {}
        self.hit: dict[str, set[int]] = {}
        self.handles = []
        for name, module in model.named_modules():
            count = _num_experts(module) if _is_experts_module(module) else None
            if count is None:
                continue
            self.modules[name] = count
            self.handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            index = next(
                (
                    v
                    for v in (*args[1:], *kwargs.values())
                    if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool
                ),
                None,
            )
            if index is not None:
                self.hit.setdefault(name, set()).update(int(e) for e in index.detach().unique().tolist())

        return hook

    def take(self, step: int) -> list[IdleExperts]:
        """The idle experts of ``step`` (experts modules that did not run at all in it count as not applicable)."""
        found = []
        for name, count in self.modules.items():
            if name not in self.hit:
                continue
            idle = tuple(e for e in range(count) if e not in self.hit[name])
            if idle:
                found.append(IdleExperts(name, step, idle, count))
        self.hit = {}
        return found

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batches(model: Any, steps: int, tokens: int, seed: int) -> tuple[list[dict], str]:
    """``steps`` batches ``{"input_ids": (1, tokens) long}`` drawn from the input embedding's rows.

    Raises:
        CliError: the model's input embedding is not an ``nn.Embedding`` (no token ids to draw).
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embeddings, nn.Embedding):
        raise CliError(
            f"--train draws token ids for the model's input embedding, but {type(model).__name__}'s is "
            f"{type(embeddings).__name__}, not an nn.Embedding; verify it without --train"
        )
    generator = torch.Generator().manual_seed(seed)
    vocab = embeddings.num_embeddings
    batches = [{"input_ids": torch.randint(0, vocab, (1, tokens), generator=generator)} for _ in range(steps)]
    return batches, f"{steps} x input_ids (1, {tokens}) drawn from [0, {vocab}) with seed {seed}"


def _loss_kind(model: nn.Module, batch: dict) -> str:
    if type(model).__name__.endswith(("ForCausalLM", "ForMaskedLM")):
        return "labels"
    return "square"


def _loss(model: nn.Module, batch: dict, kind: str) -> torch.Tensor:
    if kind == "labels":
        return model(**batch, labels=batch["input_ids"]).loss
    out = model(**batch)
    logits = getattr(out, "logits", None)
    value = logits if logits is not None else out.last_hidden_state
    return value.float().pow(2).mean()


def _exact(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy in float64 (a float64 model) or float32."""
    return tensor.detach().to(torch.float64 if tensor.dtype == torch.float64 else torch.float32, copy=True)


def _state(model: nn.Module, keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    return {k: _exact(v) for k, v in iter_original_state_dict(model) if keys is None or k in keys}


def _params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


class _Run:
    """One model's steps: losses, the parameters with a gradient per step, and (optionally) the idle experts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graded: list[set[str]] = []
        self.none: list[set[str]] = []
        self.after_first: dict[str, torch.Tensor] = {}
        self.seconds = 0.0


def _train(
    model: nn.Module,
    spec: TrainOptimizer,
    lr: float,
    batches: list[dict],
    kind: str,
    seed: int,
    *,
    probe: _ExpertsProbe | None = None,
    idle: list[IdleExperts] | None = None,
    first_keys: set[str] | None = None,
) -> _Run:
    import time

    run = _Run()
    params = _params(model)
    optimizer = spec.build(list(model.parameters()), lr)
    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(seed + step)  # dropout, router jitter: the same draws in both models
        loss = _loss(model, batch, kind)
        loss.backward()
        run.losses.append(float(loss.detach()))
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        run.graded.append({n for n, p in trainable.items() if p.grad is not None})
        run.none.append({n for n, p in trainable.items() if p.grad is None})
        if probe is not None and idle is not None:
            idle += probe.take(step)
        optimizer.step()
        if step == 0 and first_keys is not None:
            run.after_first = _state(model, first_keys)
    run.seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    return run


def _counterpart(name: str, reference_names: set[str]) -> str:
    """The unpatched parameter(s) ``name`` of the patched model stands for: itself, or the deepest module path both
    models have parameters under (``""``: the whole model)."""
    if name in reference_names:
        return name
    parts = name.split(".")[:-1]
    while parts:
        prefix = ".".join(parts) + "."
        if any(n.startswith(prefix) for n in reference_names):
            return prefix + "*"
        parts.pop()
    return "*"


def _missing_grads(reference: _Run, patched: _Run, reference_names: set[str]) -> list[MissingGrad]:
    steps: dict[str, list[int]] = {}
    where: dict[str, str] = {}
    for step, names in enumerate(patched.none):
        graded = reference.graded[step]
        for name in sorted(names):
            target = _counterpart(name, reference_names)
            if target.endswith("*"):
                prefix = target[:-1]
                trained = any(n.startswith(prefix) for n in graded)
            else:
                trained = target in graded
            if trained:
                steps.setdefault(name, []).append(step)
                where[name] = target
    return [MissingGrad(name, tuple(s), where[name]) for name, s in steps.items()]


def _same_layout(reference: nn.Module, patched: nn.Module) -> set[str]:
    """Checkpoint keys both models store as a parameter of that name and shape."""
    a, b = _params(reference), _params(patched)
    return {n for n, p in a.items() if n in b and b[n].shape == p.shape}


def _compare(
    reference: nn.Module,
    patched: nn.Module,
    runs: dict[str, _Run],
    first_keys: set[str] | None,
) -> tuple[dict[str, tuple[float, float | None]], dict[str, torch.Tensor], list[str]]:
    """``({key: (max abs diff after the last step, judged value)}, the unpatched final state, keys only the patched
    model has)``; the patched model's tensors are streamed."""
    want = _state(reference)
    diffs: dict[str, tuple[float, float | None]] = {}
    extra = []
    for key, value in iter_original_state_dict(patched):
        if key not in want:
            extra.append(key)
            continue
        mine = _exact(value)
        diff = (mine - want[key]).abs().max().item() if mine.shape == want[key].shape else math.inf
        if first_keys is None:
            judged: float | None = diff
        elif key in first_keys and key in runs["patched"].after_first:
            judged = (runs["patched"].after_first[key] - runs["unpatched"].after_first[key]).abs().max().item()
        else:
            judged = None
        diffs[key] = (diff, judged)
    return diffs, want, extra


def _pair(
    reference: nn.Module,
    patched: nn.Module,
    spec: TrainOptimizer,
    lr: float,
    batches: list[dict],
    kind: str,
    seed: int,
    first_keys: set[str] | None,
    probe: _ExpertsProbe | None,
    idle: list[IdleExperts] | None,
    what: str = "",
) -> dict[str, _Run]:
    runs: dict[str, _Run] = {}
    for label, model in (("unpatched", reference), ("patched", patched)):
        try:
            runs[label] = _train(
                model,
                spec,
                lr,
                batches,
                kind,
                seed,
                probe=probe if label == "unpatched" else None,
                idle=idle,
                first_keys=first_keys,
            )
        except Exception as exc:  # noqa: BLE001 - the model's own message is the answer
            raise CliError(f"training the {label} model{what} failed: {type(exc).__name__}: {exc}") from None
    return runs


def run_train_check(
    reference: nn.Module,
    patched: nn.Module,
    *,
    optimizer: str = "adamw",
    steps: int = DEFAULT_STEPS,
    lr: float | None = None,
    tokens: int = DEFAULT_TOKENS,
    seed: int = 0,
    float64: Callable[[], tuple[nn.Module, nn.Module]] | None = None,
) -> TrainResult:
    """Train ``reference`` (the unpatched model) and ``patched`` (the same checkpoint loaded with the patch) with the
    same ``steps`` steps of ``optimizer`` and compare them in the checkpoint layout (see the module docstring).

    Both models are trained in place (``train()`` mode, float32 weights expected: the bounds are fp32 rounding
    noise); their gradients are cleared at the end.

    Args:
        optimizer: a name of :data:`OPTIMIZERS`.
        steps: optimizer steps, >= 1.
        lr: learning rate (default: the optimizer's ``default_lr``), finite and > 0.
        tokens: tokens of the one generated sequence per step, >= 1.
        seed: seeds the token ids (``torch.Generator``) and, as ``seed + step``, the global RNG before each forward.
        float64: called only when some key is beyond the bound: returns a fresh ``(unpatched, patched)`` pair of
            the same checkpoint in float64, trained the same way to tell fp32 rounding from a real difference
            (:attr:`KeyDiff.float64`).

    Raises:
        CliError: an unknown optimizer, ``steps`` or ``tokens`` < 1, a learning rate that is not finite and > 0,
            an input embedding that is not an ``nn.Embedding`` (before anything is trained); a forward, backward or optimizer step that fails (its message, naming the
            model that failed).
    """
    spec = OPTIMIZERS.get(optimizer)
    if spec is None:
        raise CliError(f"--optimizer: unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    if steps < 1:
        raise CliError(f"--steps: must be an integer >= 1, got {steps}")
    if tokens < 1:
        raise CliError(f"--tokens: must be an integer >= 1, got {tokens}")
    lr = spec.default_lr if lr is None else lr
    if not (math.isfinite(lr) and lr > 0):
        raise CliError(f"--lr: must be a finite number > 0, got {lr}")
    result = TrainResult(optimizer, lr, steps, tokens, seed, settings=spec.describe(lr))
    result.bound, result.bound_text = spec.bound(lr), spec.bound_text(lr)
    result.bound64 = spec.bound64(lr)
    batches, result.batch = _batches(reference, steps, tokens, seed)
    kind = _loss_kind(reference, batches[0])
    if kind == "labels" and tokens < 2 and type(reference).__name__.endswith("ForCausalLM"):
        raise CliError(
            f"--tokens: a causal LM's loss with labels=input_ids needs at least 2 tokens per step (the first token has "
            f"no target), got {tokens}"
        )
    result.loss_kind = (
        "the model's loss with labels=input_ids" if kind == "labels" else "mean square of the logits/last hidden state"
    )
    start = _state(reference)
    same = _same_layout(reference, patched)
    # a per-tensor optimizer is judged after its first step on the keys stored alike, when some key is not
    first_keys = same if spec.per_tensor and not set(start) <= same else None
    with UndoStack() as undo:
        probe = _ExpertsProbe(reference)
        undo.callback(probe.remove)
        result.experts_modules = len(probe.modules)
        runs = _pair(reference, patched, spec, lr, batches, kind, seed, first_keys, probe, result.idle)
    result.losses = {label: run.losses for label, run in runs.items()}
    result.seconds = {label: run.seconds for label, run in runs.items()}
    result.missing_grads = _missing_grads(runs["unpatched"], runs["patched"], set(_params(reference)))
    diffs, want, result.only_patched = _compare(reference, patched, runs, first_keys)
    result.only_unpatched = sorted(set(want) - set(diffs))
    moved = {key: (want[key] - start[key]).abs().max().item() for key in diffs if key in start}
    del want, start
    again: dict[str, float] = {}
    if float64 is not None and any(j is not None and j > result.bound for _, j in diffs.values()):
        again = _float64_rerun(float64, spec, lr, batches, kind, seed, first_keys, result)
    for key, (diff, judged) in sorted(diffs.items()):
        result.keys.append(KeyDiff(key, diff, moved.get(key, math.nan), judged, again.get(key)))
    return result


def _float64_rerun(
    load: Callable[[], tuple[nn.Module, nn.Module]],
    spec: TrainOptimizer,
    lr: float,
    batches: list[dict],
    kind: str,
    seed: int,
    first_keys: set[str] | None,
    result: TrainResult,
) -> dict[str, float]:
    """``{key: judged difference}`` of the same steps on a float64 pair (``{}`` when it cannot run: the reason goes
    to ``result.float64_note``)."""
    try:
        reference, patched = load()
        reference, patched = reference.to(torch.float64), patched.to(torch.float64)
    except CliError as exc:
        result.float64_note = f"float64 re-run not possible: {exc}"
        return {}
    try:
        runs = _pair(reference, patched, spec, lr, batches, kind, seed, first_keys, None, None, " in float64")
    except CliError as exc:
        result.float64_note = f"float64 re-run not possible: {exc}"
        return {}
    diffs, _, _ = _compare(reference, patched, runs, first_keys)
    result.float64_note = "keys beyond the bound were trained again in float64 (both models)"
    return {key: judged for key, (_, judged) in diffs.items() if judged is not None}


def _steps_text(steps: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(s) for s in steps)


def render(result: TrainResult, *, rows: int = 12) -> str:
    """The ``training`` section of the human-readable report: the settings, the keys with the largest differences
    (``rows`` of them, every diverged key first), the idle experts, the parameters without a gradient."""
    from .render import section, table

    bound, bound64 = result.bound, result.bound64
    head: list[list[Any]] = [
        ["optimizer", result.settings],
        ["steps", f"{result.steps} on {result.batch}"],
        ["loss", result.loss_kind],
        ["bound", result.bound_text],
        ["losses unpatched", ", ".join(f"{v:.6g}" for v in result.losses.get("unpatched", []))],
        ["losses patched", ", ".join(f"{v:.6g}" for v in result.losses.get("patched", []))],
        ["max weight change", f"{result.max_moved:.3g} (unpatched, over the steps)"],
    ]
    if result.float64_note:
        head.append(["float64 re-run", f"{result.float64_note} (bound {bound64:g})"])
    width = max(len(name) for name, _ in head)
    out = ["\n".join(f"  {name.ljust(width)}  {value}" for name, value in head)]
    flagged = result.diverged + result.rounding
    ordered = flagged + sorted(
        (k for k in result.keys if k not in flagged),
        key=lambda k: -(k.judged if k.judged is not None else -1.0),
    )
    shown = ordered[: max(rows, len(flagged))]
    judged_column = any(k.judged != k.max_abs_diff for k in result.keys)
    float64_column = any(k.float64 is not None for k in result.keys)
    headers = ["checkpoint key", "max abs diff"]
    headers += ["after step 1"] if judged_column else []
    headers += ["float64"] if float64_column else []
    headers += ["moved", "status"]

    def row(k: KeyDiff) -> list[Any]:
        cells: list[Any] = [k.key, f"{k.max_abs_diff:.3g}"]
        if judged_column:
            cells.append("-" if k.judged is None else f"{k.judged:.3g}")
        if float64_column:
            cells.append("-" if k.float64 is None else f"{k.float64:.3g}")
        return cells + [f"{k.moved:.3g}", k.status(bound, bound64)]

    summary = f"{len(result.keys)} checkpoint keys, {len(result.diverged)} beyond the bound"
    if result.rounding:
        summary += f" ({len(result.rounding)} more beyond it in float32 only: fp32 rounding)"
    out.append(f"\n  {summary}; largest differences:\n" + table(headers, [row(k) for k in shown]))
    if result.only_unpatched:
        out.append(f"  keys only the unpatched model has: {', '.join(result.only_unpatched[:8])}")
    if result.only_patched:
        out.append(f"  keys only the patched model has: {', '.join(result.only_patched[:8])}")
    if result.idle:
        out.append(
            f"\n  experts that got no token ({len(result.idle)} module-steps):\n"
            + table(
                ["step", "experts module", "idle experts"],
                [[i.step, i.module, f"{', '.join(map(str, i.experts))} of {i.num_experts}"] for i in result.idle],
            )
        )
    elif result.experts_modules:
        out.append(f"  every expert of the {result.experts_modules} experts module(s) got a token in every step")
    if result.missing_grads:
        out.append(
            "\n  parameters with grad=None that the unpatched model trains:\n"
            + table(
                ["parameter", "steps", "unpatched gradient on"],
                [[m.parameter, _steps_text(m.steps), m.reference] for m in result.missing_grads[:20]],
            )
        )
    return section(f"training ({result.optimizer}, {result.steps} step(s))", "\n".join(out))
