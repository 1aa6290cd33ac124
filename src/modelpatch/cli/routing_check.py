"""``modelpatch routing-check``: an inference engine's routes against a model's own routing of the same tokens.

Reads the routes (an engine's routed-experts array saved with NumPy, ``.npy``, or a safetensors file: a
:class:`~modelpatch.routing.RoutingTrace` written by ``trace.save`` or a tensor ``routed_experts``), the token ids they
were produced for, and the model; prints R3's agreement measures per layer and overall (router disagreement, token
flip rate, top-k overlap), measured as :func:`modelpatch.routing.routing_drift` measures them (so a trace recorded
around ``generate``, with its output as the token ids, is compared on every token but the last generated one, which
it never routed), then replays the routes through the model and
reports how far the replayed logits are from the natural ones. ``--plot`` writes a per-layer disagreement chart
(matplotlib: ``pip install "modelpatch[plot]"``). Exit status 0 (a measurement, not a check).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from .checkpoint import add_trust_remote_code
from .errors import CliError
from .render import emit, section, strict_json

__all__ = ["add_parser", "main"]


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "routing-check",
        help="compare an engine's MoE routes with the model's own routing of the same tokens (R3's measures)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model", required=True, help="model folder (config.json + safetensors)")
    parser.add_argument(
        "--routes",
        required=True,
        help="routes: .npy engine array (seq_len, num_layers, top_k) or a batch of them, or .safetensors (a "
        "RoutingTrace file, or a tensor 'routed_experts')",
    )
    parser.add_argument(
        "--input-ids",
        help="token ids the routes are for: .npy or .json, (seq_len,) or (batch, seq_len), or .safetensors with "
        "'input_ids' (and optionally 'attention_mask'); default: 'input_ids' stored in the routes file",
    )
    parser.add_argument("--layer-axis", choices=("auto", "all", "moe"), default="auto", help="engine array layer axis")
    parser.add_argument("--recipe", help="load the model with this recipe (e.g. qwen3_moe-linear-experts)")
    parser.add_argument("--plot", metavar="PNG", help="write a per-layer disagreement chart to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_trust_remote_code(parser)
    parser.set_defaults(handler=main)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CliError(f"{path}: not a readable safetensors file ({exc})") from None


def _read_array(path: str, what: str) -> torch.Tensor:
    import json

    import numpy as np

    if not os.path.isfile(path):
        raise CliError(f"{what}: no file {path}")
    if path.endswith(".npy"):
        try:
            return torch.from_numpy(np.load(path, allow_pickle=False))
        except (ValueError, OSError) as exc:
            raise CliError(f"{path}: not a readable .npy array ({exc})") from None
    if path.endswith(".json"):
        try:
            with open(path) as fh:
                return torch.tensor(json.load(fh))
        except (ValueError, TypeError) as exc:
            raise CliError(f"{path}: expected a JSON list of token ids ({exc})") from None
    raise CliError(f"{what}: expected a .npy, .json or .safetensors file, received {path}")


def _inputs(args: argparse.Namespace, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if args.input_ids is None:
        if "input_ids" not in stored:
            raise CliError("--input-ids is required: the routes file holds no 'input_ids'")
        ids, mask = stored["input_ids"], stored.get("attention_mask")
    elif args.input_ids.endswith(".safetensors"):
        tensors = _read_tensors(args.input_ids)
        if "input_ids" not in tensors:
            raise CliError(f"{args.input_ids}: no tensor 'input_ids' (found {sorted(tensors)})")
        ids, mask = tensors["input_ids"], tensors.get("attention_mask")
    else:
        ids, mask = _read_array(args.input_ids, "--input-ids"), None
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.is_floating_point():
        raise CliError(
            f"--input-ids: expected integer token ids (seq_len,) or (batch, seq_len), got {tuple(ids.shape)}"
        )
    mask = torch.ones_like(ids) if mask is None else mask.reshape(ids.shape)
    return ids.long(), mask.long()


def _routes(args: argparse.Namespace):
    """``(RoutingTrace or engine array, tensors stored beside it)``."""
    from ..routing import RoutingTrace, RoutingTraceError

    stored: dict[str, torch.Tensor] = {}
    if args.routes.endswith(".safetensors"):
        if not os.path.isfile(args.routes):
            raise CliError(f"--routes: no file {args.routes}")
        try:
            return RoutingTrace.load(args.routes), stored
        except RoutingTraceError:
            stored = _read_tensors(args.routes)
        if "routed_experts" not in stored:
            raise CliError(f"{args.routes}: neither a RoutingTrace file nor a tensor 'routed_experts'")
        array = stored["routed_experts"]
    else:
        array = _read_array(args.routes, "--routes")
    return array, stored


def main(args: argparse.Namespace) -> int:
    from ..routing import (
        RouterContractError,
        RoutingDiscoveryError,
        RoutingTrace,
        RoutingTraceError,
        replay_routing,
        routing_drift,
    )
    from .checkpoint import checkpoint_dir, model_class, read_config, remote_code_kwargs
    from .sources import check_recipe_fits, config_names

    # one-line errors for a folder that is not a checkpoint
    config = read_config(checkpoint_dir(args.model))
    cls: Any = model_class(config)
    recipe = None
    if args.recipe:  # before the routes are read: a recipe of another family is the first error
        from ..recipes import UnknownRecipeError, UnsupportedExpertsError, get_recipe

        try:
            recipe = get_recipe(args.recipe)
        except (UnknownRecipeError, UnsupportedExpertsError) as exc:
            raise CliError(str(exc)) from None
        check_recipe_fits(recipe, config_names(config), f"'{args.model}'")
    routes, stored = _routes(args)
    ids, mask = _inputs(args, stored)
    if recipe is not None:
        with recipe.apply():
            model = cls.from_pretrained(args.model, **remote_code_kwargs())
    else:
        model = cls.from_pretrained(args.model, **remote_code_kwargs())
    model.eval()
    try:
        if isinstance(routes, RoutingTrace):
            trace = routes
        else:
            if routes.dim() == 3 and ids.shape[0] > 1:
                raise CliError(f"--routes holds one sequence {tuple(routes.shape)}; --input-ids holds {ids.shape[0]}")
            if routes.dim() == 4 and routes.shape[0] != ids.shape[0]:
                raise CliError(
                    f"--routes holds a batch of {routes.shape[0]} sequences {tuple(routes.shape)}; --input-ids holds "
                    f"{ids.shape[0]} {tuple(ids.shape)}: give the token ids the routes were produced for"
                )
            trace = RoutingTrace.from_routed_experts(
                routes,
                model,
                attention_mask=mask.bool() if routes.dim() == 4 else None,
                seq_lens=mask.sum(dim=1).tolist(),
                layer_axis=args.layer_axis,
            )
        with torch.no_grad():
            # routing_drift's own comparison: a trace recorded around generate (one row short per sequence, the
            # last generated token never fed) is compared on every row but that last token, as in Python
            agreement = routing_drift(model, trace, ids, mask)
            plain = model(input_ids=ids, attention_mask=mask).logits
            with replay_routing(model, trace):
                replayed = model(input_ids=ids, attention_mask=mask).logits
    except (RoutingTraceError, RoutingDiscoveryError, RouterContractError) as exc:
        raise CliError(str(exc)) from None
    real = mask.bool()
    logits_diff = (replayed - plain).abs()[real].max().item() if bool(real.any()) else 0.0
    if args.plot:
        _plot(agreement, args.plot, args.routes)
    if args.json:
        emit(strict_json({**agreement.as_dict(), "replayed_logits_max_abs_diff": logits_diff, "plot": args.plot}))
        return 0
    emit(section(f"routes {args.routes} vs the natural routing of {args.model}"))
    emit(agreement.table())
    emit(section("replay", f"logits with the routes replayed vs natural: max abs diff {logits_diff:.4g}"))
    if args.plot:
        emit(f"chart written to {args.plot}")
    return 0


def _plot(agreement, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError('--plot needs matplotlib: pip install "modelpatch[plot]"') from None
    layers = [a.layer for a in agreement.layers]
    figure, axis = plt.subplots(figsize=(max(4.0, 0.35 * len(layers) + 2), 3.2))
    axis.bar([str(layer) for layer in layers], [100 * a.disagreement_rate for a in agreement.layers], color="#c44e52")
    axis.set_xlabel("MoE layer")
    axis.set_ylabel("router disagreement (% of tokens)")
    axis.set_ylim(0, 100)
    axis.set_title(
        f"{os.path.basename(title)}\n{agreement.router_disagreement_rate:.1%} of routers disagree, "
        f"{agreement.token_flip_rate:.1%} of tokens flipped",
        fontsize=8,
    )
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as exc:
        raise CliError(f"--plot: cannot write {path} ({exc})") from None
    finally:
        plt.close(figure)
