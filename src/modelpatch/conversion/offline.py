"""Offline conversion of a checkpoint folder (``modelpatch convert SRC DST``)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .compose import layout_settled, settle_layouts
from .errors import ConversionError, NothingToConvertError
from .io import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, checkpoint_files
from .plan import ConversionRow, build_plan, load_tensor
from .reference import ReferenceShapes, state_shapes
from .registry import get_checkpoint_conversion_mapping
from .rules import as_modelpatch_rule

__all__ = ["convert_checkpoint", "rules_matching"]

logger = logging.get_logger("modelpatch.conversion")


def _config_reference_shapes(src: str) -> dict:
    """Shapes of the vanilla model described by ``src/config.json`` (``architectures[0]``), built on meta."""
    import transformers

    result: dict = {}

    def build():
        try:
            # never the checkpoint's own code (and never a prompt): explicit Chunk sizes are then required
            config = transformers.AutoConfig.from_pretrained(src, trust_remote_code=False)
            cls = getattr(transformers, (config.architectures or [""])[0])
            with torch.device("meta"):
                model = cls(copy.deepcopy(config))
            result.update(state_shapes(((k, v.shape) for k, v in model.state_dict().items()), model.base_model_prefix))
        except Exception:  # noqa: BLE001 - explicit Chunk sizes are then required
            pass

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    return result


def _rules_for(name, rules, reverse):
    if rules is None:
        if name is None:
            raise ConversionError("convert_checkpoint needs model_type_or_class_name or rules")
        rules = get_checkpoint_conversion_mapping(name)
        if not rules:
            raise ConversionError(
                f"No conversion rules in effect for '{name}' (registered or built in): nothing to convert. A recipe "
                "without rules for it expects checkpoints already in the model's layout"
            )
    try:
        rules = [as_modelpatch_rule(rule) for rule in rules]
    except TypeError as exc:
        raise ConversionError(f"Cannot convert offline with rules of '{name}': {exc}") from None
    if reverse:
        # a converted checkpoint does not say which of a recipe's alternative source layouts it came from: the
        # reverse writes each layout group's default (the layout Transformers' own save_pretrained writes)
        kept = settle_layouts(rules, {id(rule) for rule in rules}, set())
        rules = [rule.reverse_transform() for rule in rules[::-1] if id(rule) in kept]
    return rules


def _check_matched(plan, rules: list, src: str) -> None:
    """No rule matched any key: refuse (the output would be a copy); some rules matched nothing: warn."""
    if not plan.fired:
        raise NothingToConvertError(
            f"No conversion rule matched any key of '{src}' (rules: {rules!r}); nothing was written. Is the "
            "checkpoint already in the target layout, or should --reverse be used?",
            source=src,
            rules=rules,
        )
    for rule in rules:
        if id(rule) not in plan.fired and not layout_settled(rule, rules, plan.fired):
            logger.warning(f"Conversion rule {rule!r} matched no key of '{src}'")


def rules_matching(
    src: str | os.PathLike, model_type_or_class_name: str | None = None, *, rules: list | None = None, reverse: bool
) -> list:
    """The rules :func:`convert_checkpoint` would apply to ``src`` (same arguments) that match at least one of its
    keys; reads the files' headers only. ``[]``: the conversion would write nothing.

    Raises:
        ConversionError: as :func:`convert_checkpoint` for missing rules or an unreadable checkpoint.
    """
    rules = _rules_for(model_type_or_class_name, rules, reverse)
    with ExitStack() as stack:
        items: dict[str, object] = {}
        for file in checkpoint_files(os.fspath(src)):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            items.update((key, handle.get_slice(key)) for key in handle.keys())
        plan = build_plan(items.items(), rules, reverse=reverse)
    return [rule for rule in rules if id(rule) in plan.fired]


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    model_type_or_class_name: str | None = None,
    *,
    rules: list | None = None,
    reverse: bool = False,
    progress: bool | None = None,
) -> list[ConversionRow]:
    """Write a converted copy of a safetensors checkpoint, streaming shard by shard.

    Args:
        src: checkpoint folder (``model.safetensors`` or sharded with ``model.safetensors.index.json``) or a
            ``.safetensors`` file. Other files of the folder (config, tokenizer) are copied to ``dst``.
        dst: output folder (created; must not be ``src`` nor a non-empty folder). One output shard per input shard that still holds a
            tensor (a converted group goes to the shard of its last source), plus an index with ``total_size``
            when sharded; dtypes are preserved.
        model_type_or_class_name: registry name whose effective rules (user rules and the built-ins they do not
            replace, see :func:`get_checkpoint_conversion_mapping`) are applied.
        rules: explicit rules instead of a registry name.
        reverse: apply the inverse rules (converted layout → original layout). Fused tensors are split with the
            sizes of the vanilla model described by ``src/config.json``, or explicit ``Chunk(sizes=...)``.
        progress: show a tqdm bar (default: when the input has several shards).

    Returns:
        Report rows (direction ``"offline"``).

    Raises:
        ConversionError: no checkpoint, no rules, no rule matching any key, incomplete groups or undeterminable
            split sizes. Raised before any file is written when detected from shapes alone.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ConversionError("convert_checkpoint: dst must differ from src")
    if os.path.isdir(dst) and os.listdir(dst):
        raise ConversionError(
            f"convert_checkpoint: destination '{dst}' exists and is not empty (stale shards of an "
            "earlier run would mix with the new ones); remove it or choose another"
        )
    rules = _rules_for(model_type_or_class_name, rules, reverse)
    files = checkpoint_files(src)
    src_dir = src if os.path.isdir(src) else os.path.dirname(src)
    references = ReferenceShapes(_config_reference_shapes(src_dir) if reverse else {})
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in files]
        items, file_of = {}, {}
        for index, handle in enumerate(handles):
            for key in handle.keys():
                items[key], file_of[key] = handle.get_slice(key), index
        plan = build_plan(items.items(), rules, reverse=reverse)
        _check_matched(plan, rules, src)
        dry = plan.dry_run(references)  # validates every group before writing
        # A group is written with the shard holding its last source key; passthrough keys stay in their shard.
        groups_by_file: dict[int, list] = {}
        for group in plan.groups.values():
            last = max(file_of[k] for k in group.source_keys())
            groups_by_file.setdefault(last, []).append(group)
        passthrough_by_file: dict[int, list] = {}
        original_of = {id(obj): key for key, obj in items.items()}
        for name, obj in plan.passthrough.items():
            passthrough_by_file.setdefault(file_of[original_of[id(obj)]], []).append((name, obj))
        os.makedirs(dst, exist_ok=True)
        written = [i for i in range(len(files)) if i in passthrough_by_file or i in groups_by_file]  # no empty shard
        n = len(written)
        show = progress if progress is not None else len(files) > 1
        weight_map: dict[str, str] = {}
        produced: dict = {}
        total_size = 0
        for number, index in enumerate(tqdm(written, desc="Converting shards", disable=not show), start=1):
            out_name = SAFE_WEIGHTS_NAME if n == 1 else f"model-{number:05d}-of-{n:05d}.safetensors"
            tensors = {name: load_tensor(obj) for name, obj in passthrough_by_file.get(index, [])}
            for group in groups_by_file.get(index, []):
                sub = type(plan)({group.key: group}, {}, [], set(), plan.reverse, plan.renamings)
                for name, tensor in sub.convert_all(references).items():
                    tensors[name] = tensor
                    produced[name] = dry[name]
            save_file(
                {k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, out_name), metadata={"format": "pt"}
            )
            weight_map.update(dict.fromkeys(tensors, out_name))
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
    if n > 1:
        with open(os.path.join(dst, SAFE_WEIGHTS_INDEX_NAME), "w") as fh:
            index_json = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            json.dump(index_json, fh, indent=2)
    if os.path.isdir(src):
        for entry in os.listdir(src):
            path = os.path.join(src, entry)
            if os.path.isfile(path) and not entry.endswith(".safetensors") and entry != SAFE_WEIGHTS_INDEX_NAME:
                shutil.copy2(path, os.path.join(dst, entry))
    owner = {id(rule): model_type_or_class_name for rule in rules}
    return plan.rows("offline", owner, produced)
