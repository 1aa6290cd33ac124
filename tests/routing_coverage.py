"""Coverage of `modelpatch.routing` over every MoE family of the installed Transformers.

Used by tests/test_routing_coverage.py, which checks the support table in README.md against it. Run directly to
print the table measured with the installed Transformers, ``--write`` to rewrite README.md's table with it.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

sys.path.insert(0, str(Path(__file__).parent))
from modelpatch.routing import find_router_sites, record_routing, replay_routing  # noqa: E402
from modelpatch.routing.kinds import UNSUPPORTED_FAMILIES  # noqa: E402
from routing_models import EMBEDS_INPUT, ExpertsObserver, perturb_routers, router_weight, tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- routing-support:start -->\n", "<!-- routing-support:end -->"
_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| (yes|no) \| (.*) \|$")


def pinned_release() -> str:
    """The Transformers release the ``test`` extra pins (what CI installs), read from pyproject.toml."""
    found = re.findall(r'"transformers==([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert len(found) == 1, f"expected one transformers==X pin in pyproject.toml, found {found}"
    return found[0]


def table_release(table: str) -> str:
    """The Transformers release a generated table names in its first line."""
    found = re.search(r"from transformers (\S+);", table.splitlines()[0])
    assert found, f"not a generated routing support table: {table.splitlines()[0]!r}"
    return found.group(1)


def table_rows(table: str) -> dict[str, tuple[bool, str, str]]:
    """``{model_type: (supported, router class, kind / reason)}`` of a generated table."""
    rows = {}
    for line in table.splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(3) == "yes", match.group(2), match.group(4))
    return rows


def save_measured_table(table: str) -> Path:
    """Write ``table`` to build/routing-support-transformers-<release>.md (ignored by git); returns the path."""
    path = ROOT / "build" / f"routing-support-transformers-{table_release(table)}.md"
    path.parent.mkdir(exist_ok=True)
    path.write_text(table, encoding="utf-8")
    return path


def readme_table() -> str:
    """The support table as it stands in README.md (between the routing-support markers)."""
    text = README.read_text(encoding="utf-8")
    return text[text.index(START) + len(START) : text.index(END)]


def write_readme_table(table: str) -> None:
    text = README.read_text(encoding="utf-8")
    README.write_text(text[: text.index(START) + len(START)] + table + text[text.index(END) :], encoding="utf-8")


_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K = ("num_experts_per_tok", "top_k", "moe_k", "moe_topk", "num_experts_per_token", "router_top_k")
_SUBS = ("text_config", "language_config", "thinker_config", "talker_config", "llm_config", "decoder_config")


def _get(cfg, name):
    try:
        v = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - per-layer (heterogeneous) attributes refuse global access
        return "per-layer"
    return v


def _has_int(cfg, names):
    return any(
        _get(cfg, n) == "per-layer" or (isinstance(_get(cfg, n), int) and not isinstance(_get(cfg, n), bool))
        for n in names
    )


_DEFAULTS: dict = {}


def _default_config(mt: str):
    if mt not in _DEFAULTS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _DEFAULTS[mt] = CONFIG_MAPPING[mt]()
    return _DEFAULTS[mt]


def moe_families() -> dict[str, str | None]:
    """``{model_type: sub-config attribute holding the MoE text model, or None for the root config}`` of every
    model type whose config has a number of experts and a top-k."""
    out = {}
    for mt in sorted(CONFIG_MAPPING_NAMES):
        try:
            cfg = _default_config(mt)
        except Exception:  # noqa: BLE001 - configs that cannot be built with defaults are not classifiable
            continue
        if _has_int(cfg, _EXPERTS) and _has_int(cfg, _TOP_K):
            out[mt] = None
            continue
        for sub in _SUBS:
            s = _get(cfg, sub)
            if s is not None and not isinstance(s, (dict, str)) and _has_int(s, _EXPERTS) and _has_int(s, _TOP_K):
                out[mt] = sub
                break
    return out


def _model_class(config_class: type) -> type:
    """The model class of a config that no auto class maps: the one model class of the config's modeling module
    declaring that exact config class (a causal LM if there is one)."""
    import importlib
    import inspect

    from transformers import PreTrainedModel

    modeling = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    found = [
        c
        for name, c in vars(modeling).items()
        if inspect.isclass(c)
        and issubclass(c, PreTrainedModel)
        and getattr(c, "config_class", None) is config_class
        and not name.endswith("PreTrainedModel")
    ]
    found.sort(key=lambda c: not c.__name__.endswith("ForCausalLM"))
    if not found:
        raise ValueError(f"no model class in {modeling.__name__} declares config {config_class.__name__}")
    return found[0]


def _build(model_type: str):
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except ValueError:
        try:
            model = AutoModel.from_config(cfg, attn_implementation="eager")
        except ValueError:  # a sub-config with no auto class (the text model of a composite): its own model class
            model = _model_class(type(cfg))._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("Router", "Gate", "Gating")) and hasattr(module, "top_k"):
                try:
                    router_weight(module).normal_(0, 0.5)
                except StopIteration:
                    pass
    return model.eval()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same experts per token (order within a token's top-k does not matter to the experts)."""
    return a.shape == b.shape and torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


def _why(e: BaseException, n: int = 120) -> str:
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:n]}"


def _inputs(model_type: str, model) -> dict:
    """A batch of 2 sequences of 6 tokens for ``model``: token ids, embeddings for the models fed hidden states,
    or image patches for a vision encoder."""
    g = torch.Generator().manual_seed(0)
    config = model.config
    if "vision" in model_type:  # (patches, channels * patch * patch) with the patch grid of each image
        grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
        width = config.num_channels * config.patch_size**2
        return {"pixel_values": torch.randn(int(grid.prod(-1).sum()), width, generator=g), "grid_thw": grid}
    if model_type in EMBEDS_INPUT:
        return {"inputs_embeds": torch.randn(2, 6, config.hidden_size, generator=g)}
    return {"input_ids": torch.randint(3, min(100, config.get_text_config().vocab_size), (2, 6), generator=g)}


def check_family(model_type: str) -> tuple[bool, str, str]:
    """Build a tiny model, record, perturb the routers, replay, and compare the experts actually used (observed
    by a hook on the experts modules) with the trace. Returns ``(supported, router class, reason)``."""
    try:
        model = _build(model_type)
    except Exception as e:  # noqa: BLE001
        return False, "?", f"tiny model not buildable here: {_why(e, 90)}"
    try:
        sites, _, _ = find_router_sites(model)
    except Exception as e:  # noqa: BLE001
        return False, "-", _why(e)
    router = type(sites[0].module).__name__
    inputs = _inputs(model_type, model)
    try:
        with torch.no_grad():
            with ExpertsObserver(model) as seen, record_routing(model) as trace:
                model(**inputs)
            if not seen.calls:
                return False, router, "no experts module taking (hidden, top_k_index, top_k_weights) to observe"
            for layer in trace.layers:
                if not _same(seen.indices(layer), torch.cat(trace[layer])):
                    return False, router, f"layer {layer}: recorded indices differ from the experts' inputs"
            perturb_routers(model)
            with ExpertsObserver(model) as seen, replay_routing(model, trace):
                model(**inputs)
            for layer in trace.layers:
                if not _same(seen.indices(layer), torch.cat(trace[layer])):
                    return False, router, f"layer {layer}: replayed experts differ from the trace"
    except Exception as e:  # noqa: BLE001
        return False, router, _why(e)
    return True, router, f"{sites[0].kind.name}"


def support_table() -> tuple[str, dict[str, bool]]:
    families = moe_families()
    rows, status, results = [], {}, {}
    for mt, sub in families.items():
        if sub is not None:
            sub_type = _get(_default_config(mt), sub).model_type
            if sub_type in families and families[sub_type] is None:
                rows.append((mt, None, f"MoE text model is `{sub_type}`", sub_type))
                continue
        family = mt if sub is None else _get(_default_config(mt), sub).model_type
        if family in UNSUPPORTED_FAMILIES:
            results[mt] = (False, "-", UNSUPPORTED_FAMILIES[family])
        else:
            results[mt] = check_family(family)
        rows.append((mt, *results[mt], None))
    lines = [
        "<!-- generated by tests/test_routing_coverage.py from transformers "
        f"{transformers.__version__}; do not edit -->",
        "| model type | router class | supported | kind / reason |",
        "|---|---|---|---|",
    ]
    for row in rows:
        mt = row[0]
        if row[-1] is not None:  # composite model: same as its text model
            ok, router, why = results.get(row[-1], (False, "?", "?"))
            status[mt] = ok
            lines.append(f"| `{mt}` | {router} | {'yes' if ok else 'no'} | via `{row[-1]}` |")
            continue
        ok, router, why = row[1], row[2], row[3]
        status[mt] = ok
        lines.append(f"| `{mt}` | {router} | {'yes' if ok else 'no'} | {why.replace('|', '/')} |")
    n_ok = sum(status.values())
    lines.append("")
    lines.append(f"{n_ok} of {len(status)} model types with experts and a top-k router are supported.")
    return "\n".join(lines) + "\n", status


if __name__ == "__main__":
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    text, status = support_table()
    if "--write" in sys.argv:
        write_readme_table(text)
    print(text)
