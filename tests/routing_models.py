"""Tiny MoE models for the routing tests, built from configs only (no hub access)."""

from __future__ import annotations

import re

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from helpers import TINY
from modelpatch.routing.sites import experts_count

# Twelve representative MoE families, with the per-family config keys that make a tiny model exercise routing.
REQUIRED_FAMILIES = [
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "granitemoe",
    "jamba",
    "minimax",
    "phimoe",
]

# Every family's name for each size, set to one tiny value (a config ignores the names it does not have): the shared
# decoder sizes of helpers.TINY, narrower dense MLPs, 8 experts, top-2.
_TINY = dict(
    TINY,
    intermediate_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    head_dim=16,
    max_position_embeddings=256,
    expert_ffn_hidden_size=32,
    ffn_hidden_size=64,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k=2,
    moe_k=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    qk_head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=None,
    use_cache=True,
)
_PER_FAMILY = {
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        mamba_d_state=4,
        mamba_d_conv=2,
        mamba_expand=2,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_expand=2,
    ),
    "flint": dict(mlp_only_layers=[0]),
    "beam": dict(mlp_layer_types=["dense", "sparse"]),
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4),
    "mistral4": dict(head_dim=16, num_key_value_heads=4),
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=16),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "qwen2_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    # a hash-routed layer (experts looked up by token id), then a learned top-k one
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),
    # attribute_map names n_group `num_expert_group`: with 8 groups of one expert its top-2 per group has no room
    "bailing_hybrid": dict(
        num_expert_group=2,
        topk_group=1,
        expert_swiglu_limit_list=[0.5, 0.5],
        share_expert_swiglu_limit_list=[0.5, 0.5],
    ),
    # the multimodal RoPE splits the rotary half (head_dim 16 * partial 0.5 / 2 = 4) into time, height, width
    "glm4v_moe_text": dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        }
    ),
    "hy_v4_vl_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    # text and vision experts have their own widths
    # and the 3-D RoPE splits the 8 rotary frequencies (head_dim 16 / 2) into height + width, then time
    "ernie4_5_vl_moe_text": dict(
        moe_intermediate_size=[32, 32],
        mlp_layer_types=["dense", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    ),
    # DSA attention is NoPE; the indexer selects tokens in blocks of index_kpool
    "glm5_next_text": dict(
        qk_rope_head_dim=0,
        index_topk=8,
        index_kpool=4,
        index_head_dim=16,
        index_n_heads=2,
        linear_head_dim=16,
        linear_num_heads=4,
        mlp_layer_types=["dense", "sparse"],
    ),
    # one convolution layer, one attention layer; the first num_dense_layers layers have a dense MLP
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # the QSA indexer of indexed-attention layers
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2
    ),
    # per-layer SwiGLU clipping on (routed and shared experts): the linear experts must clip as the fused ones do
    "step3p5": dict(
        mlp_layer_types=["dense", "sparse"],
        share_expert_dim=32,
        sliding_window=16,
        swiglu_limits=[0.5, 0.5],
        swiglu_limits_shared=[0.5, 0.5],
    ),
    # its eager attention has no key/value head repetition: as many key/value heads as query heads
    "unlimited_ocr_text": dict(num_key_value_heads=4),
    # a top-1 router (over the experts and a compute-free skip expert)
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=32),
    "dots3_note_vision_encoder": dict(adapter_in_dim=64, adapter_out_dim=64),
    # 2 compute-free ("zero") experts beside the 8 routed ones (the default 256 would take nearly every route)
    "longcat_flash": dict(zero_expert_num=2),
    # one MoE layer (the default makes the first two dense); the indexer scores keys with at most the query heads
    # of one key head (4 / 2)
    "kolibri1_1": dict(
        mlp_only_layers=[0],
        index_num_heads=2,
        index_topk=8,
        index_pool_size=16,
        index_compression=4,
        index_num_local_tokens=4,
        index_num_sink_tokens=1,
    ),
}

# Keyword arguments passed as they are, whether or not the default config has them as fields: arguments its
# __post_init__ reads and does not keep, and attributes its modeling code reads that the config class does not
# declare (real checkpoints carry them in config.json).
_UNDECLARED = {
    # experts per layer come from the pyramid of routed-expert counts (-1: dense layer)
    "dots3_note_vision_encoder": dict(pyramid_num_routed=[-1, 8]),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=32),
}


# Models fed hidden states rather than token ids: Qwen3-Omni's talker reads the thinker's (its forward embeds
# input_ids with an `embed_tokens` it does not have; its token embedding is `codec_embedding`).
EMBEDS_INPUT = {"qwen3_omni_moe_talker_text"}


def tiny_config(model_type: str, **overrides):
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = {k: v for k, v in {**_TINY, **_PER_FAMILY.get(model_type, {})}.items() if k in default.to_dict()}
    if isinstance(getattr(default, "sliding_window", None), int):
        kwargs["sliding_window"] = 16
    types = getattr(default, "layer_types", None)
    if (
        isinstance(types, (list, tuple))
        and types
        and "layer_types" not in kwargs
        and "layer_types" in default.to_dict()
    ):
        # keep the family's mix of layer types, with at least one full-attention layer last
        n = kwargs.get("num_hidden_layers", 2)
        kinds = list(dict.fromkeys(types))
        full = next((t for t in kinds if "full" in t or t == "attention"), kinds[-1])
        other = next((t for t in kinds if t != full), full)
        kwargs["layer_types"] = [other] * (n - 1) + [full]
    if "qk_rope_head_dim" in kwargs and "head_dim" not in _PER_FAMILY.get(model_type, {}):  # MLA attention
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(
        {k: v for k, v in _PER_FAMILY.get(model_type, {}).items() if k in default.to_dict() or k == "layer_types"}
    )
    kwargs.update(_UNDECLARED.get(model_type, {}))
    kwargs.update(overrides)
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # routers start near uniform: spread their logits so routing is clear-cut
        for module in model.modules():
            if type(module).__name__.endswith("Router"):
                router_weight(module).normal_(0, 0.5)
    return model.eval()


class ExpertsObserver:
    """Independent witness: a forward pre-hook on every experts module records the expert indices and weights
    the experts were actually called with, keyed by decoder layer index (list of calls per layer)."""

    def __init__(self, model: torch.nn.Module):
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.sizes: dict[int, int | None] = {}  # experts of each layer's experts module (None: not read)
        self._handles = []
        for name, module in model.named_modules():
            cls = type(module).__name__
            layer = re.search(r"\.(\d+)\.", f".{name}")  # index in the stack of decoder layers (or blocks)
            if cls.endswith("Experts") and not name.rsplit(".", 1)[-1].startswith("shared") and layer:
                layer = int(layer.group(1))
                self.sizes[layer] = experts_count(module)
                self._handles.append(module.register_forward_pre_hook(self._hook(layer), with_kwargs=True))

    def _hook(self, layer):
        def hook(module, args, kwargs):
            vals = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
            idx = next((v for v in vals if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
            w = next((v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            if idx is None and len(args) == 1 and hasattr(module, "num_experts"):
                # dense dispatch (Llama 4): input (num_experts * tokens, hidden), rows of unused experts are 0
                x = args[0].reshape(module.num_experts, -1, args[0].shape[-1])
                used = (x != 0).any(-1).T  # (tokens, num_experts)
                k = int(used.sum(-1).max())
                idx = used.float().topk(k, dim=-1).indices.sort(dim=-1).values
                w = used.float()
            if idx is None or w is None:  # not a routed-experts call
                return
            self.calls.setdefault(layer, []).append((idx.detach().clone(), w.detach().clone()))

        return hook

    def indices(self, layer: int, call: int = -1) -> torch.Tensor:
        return self.calls[layer][call][0]

    def routes(self, layer: int, traced: torch.Tensor, call: int = -1) -> bool:
        """Whether the experts of ``layer`` were called with the routes ``traced`` (tokens, top_k): the same experts
        per token (in any order); a route to a compute-free expert (an id >= the experts module's count, e.g.
        LongCat's zero experts) reaches the experts with weight 0, under whatever id the family maps it to."""
        index, weights = self.calls[layer][call]
        size = self.sizes.get(layer)
        if index.shape != traced.shape:
            return False
        if size is None or not bool((traced >= size).any()):
            return torch.equal(index.sort(dim=-1).values, traced.sort(dim=-1).values)
        real = traced < size
        return torch.equal(index[real], traced[real]) and bool((weights[~real] == 0).all())

    def close(self):
        for h in self._handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def router_weight(module: torch.nn.Module) -> torch.Tensor:
    """The projection weight of a router (``weight``, or the first 2-D parameter, e.g. ``classifier.weight``)."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w
    return next(p for p in module.parameters() if p.dim() == 2)


def fill_hash_table(router: torch.nn.Module, seed: int = 0) -> None:
    """Give a hash router (DeepSeek-V4) what a checkpoint gives it: ``tid2eid`` rows of distinct expert ids (a
    new model has zeros)."""
    g = torch.Generator().manual_seed(seed)
    vocab, k = router.tid2eid.shape
    rows = [torch.randperm(router.num_experts, generator=g)[:k] for _ in range(vocab)]
    router.tid2eid.copy_(torch.stack(rows))


def perturb_routers(model: torch.nn.Module, seed: int = 1, scale: float = 2.0) -> None:
    """Move every router's weights (and shift the expert ids of hash routers' tables) so natural routing differs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("Router", "Gate", "Gating")) and hasattr(module, "top_k"):
                w = router_weight(module)
                w.add_(torch.randn(w.shape, generator=g) * scale)
                if isinstance(getattr(module, "tid2eid", None), torch.Tensor):
                    module.tid2eid.copy_((module.tid2eid + 1) % module.num_experts)
