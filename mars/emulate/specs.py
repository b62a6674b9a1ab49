"""Model and GPU descriptions for the step-time model, and the shipped profiles.

Sources (docs/emulation.md has the full table):

* GPUs: NVIDIA's H100 and H200 datasheets; the headline Tensor Core numbers there include 2:4
  sparsity, so dense = half. Cross-checked against copies in inference-sim
  (``hardware_config.json``) and simllm (``simllm/compute/transformer.py``).
* Models: the official Hugging Face ``config.json`` of Qwen/Qwen3-Coder-30B-A3B-Instruct and
  openai/gpt-oss-120b. The fields that shape compute and KV cache are shipped, without
  weights, in ``mars/emulate/hf_configs/`` and every :class:`ModelSpec` is read from there
  (:func:`model_from_hf_config`): the step-time model and the emulated executor's KV cache
  specs come from the same file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

GIB = 1 << 30

#: host <-> device copy bandwidth each way, GB/s (10^9 bytes/s). All four cards attach to the
#: host by PCIe Gen5 x16: 64 GB/s each way on paper (NVIDIA's H100 and H200 datasheets give
#: 128 GB/s, both ways together); a copy engine moving pinned host memory measures 55.6 GB/s
#: (nvbandwidth ``host_to_device_memcpy_ce``, the example output in NVIDIA's NVbandwidth post).
#: The emulated link uses the measured figure both ways. ``--emulate-config host_link_gb_s``
#: replaces it with a measurement of one's own.
PCIE_GEN5_X16_GB_S = 55.6


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    #: dense BF16 Tensor Core peak, TFLOP/s
    bf16_tflops: float
    #: dense FP8 Tensor Core peak, TFLOP/s
    fp8_tflops: float
    #: HBM bandwidth, TB/s (10^12 bytes/s)
    hbm_tb_s: float
    #: memory the card reports, GiB
    memory_gib: float
    #: host <-> device copy bandwidth each way, GB/s (:data:`PCIE_GEN5_X16_GB_S`)
    host_link_gb_s: float = PCIE_GEN5_X16_GB_S

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        return self.hbm_tb_s * 1e12


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shapes that set one step's work and the KV layout (decoder-only transformer)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    max_model_len: int
    #: dense FFN width of every layer (0: the MLP is a mixture of experts)
    dense_intermediate: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    #: FFN width of one expert (gated: gate, up and down projections)
    expert_intermediate: int = 0
    #: sliding-window attention: the window (tokens) and how many layers use it
    sliding_window: int | None = None
    sliding_layers: int = 0
    tie_embeddings: bool = False
    #: bytes per parameter of attention, dense, router and embedding weights
    weight_bytes: float = 2.0
    #: bytes per expert parameter (bf16 2.0; MXFP4 4 bits + one 8-bit scale per 32 = 0.53125)
    expert_weight_bytes: float = 2.0
    #: bytes per KV cache element (bf16 2, fp8 1)
    kv_bytes: float = 2.0
    #: the model's Hugging Face id (the emulated server's default served name)
    hf_id: str = ""
    #: indices of the sliding-window layers (``layer_types`` in config.json)
    sliding_layer_ids: tuple[int, ...] = field(default=(), repr=False)

    # ------------------------------------------------------------------ derived shapes
    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    @property
    def attn_params(self) -> int:
        """Q, K, V and O projections of one layer."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        per_layer = (self.attn_params + self.dense_mlp_params + self.router_params
                     + self.num_experts * self.expert_params)
        return self.num_layers * per_layer + self.embedding_params

    @property
    def active_params(self) -> int:
        per_layer = (self.attn_params + self.dense_mlp_params + self.router_params
                     + self.experts_per_token * self.expert_params)
        return self.num_layers * per_layer + self.vocab * self.hidden

    @property
    def weight_memory_bytes(self) -> float:
        per_layer_plain = self.attn_params + self.dense_mlp_params + self.router_params
        experts = self.num_layers * self.num_experts * self.expert_params
        return ((self.num_layers * per_layer_plain + self.embedding_params) * self.weight_bytes
                + experts * self.expert_weight_bytes)

    def kv_bytes_per_token_layer(self) -> float:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes

    def kv_bytes_per_token(self) -> float:
        """KV of one context token over the full-attention layers (sliding layers keep at most
        the window per sequence, see :meth:`kv_bytes_per_sequence`)."""
        return self.full_layers * self.kv_bytes_per_token_layer()

    def kv_bytes_per_sequence(self, tokens: int) -> float:
        sliding = min(tokens, self.sliding_window or 0) * self.sliding_layers
        return (tokens * self.full_layers + sliding) * self.kv_bytes_per_token_layer()

    def max_sequence_tokens(self, budget_bytes: float, block_size: int = 1,
                            in_flight_tokens: int = 0) -> int:
        """The longest sequence vLLM will accept with ``budget_bytes`` of KV pool, as its
        start-up check counts it (``vllm/v1/core/kv_cache_utils.py``, ``get_kv_cache_configs``
        and ``_max_memory_usage_bytes_from_groups``): the layers are grouped (hybrid models
        padded to groups of equal size), one pool block holds one page of every layer of a
        group, the null block the pool holds back does not count, and a request needs
        ``ceil(len / block_size)`` blocks per full-attention group and
        ``ceil((window - 1 + in_flight_tokens) / block_size) + 1`` per sliding-window group.
        So the answer is a whole number of blocks: a limit one token past a block boundary
        needs one block more than the pool has, and vLLM refuses to start."""
        bs = max(1, int(block_size))
        page = bs * self.kv_bytes_per_token_layer()
        F, S = self.full_layers, self.sliding_layers
        group = max(F, S) if S else F
        pool_block = group * page
        full_groups = -(-F // group)
        sliding_blocks = 0
        if S:
            window_tokens = (self.sliding_window or 0) - 1 + max(0, int(in_flight_tokens))
            sliding_blocks = -(-S // group) * (-(-window_tokens // bs) + 1)
        usable = int(budget_bytes // pool_block) - 1  # the null block
        blocks = (usable - sliding_blocks) // full_groups
        return max(0, blocks) * bs

    def with_kv_bytes(self, kv_bytes: float) -> "ModelSpec":
        from dataclasses import replace

        return replace(self, kv_bytes=kv_bytes)


# --------------------------------------------------------------------------- profiles
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # H100 SXM5 80 GB: 989.5 dense BF16 (1,979 sparse), 1,979 dense FP8, 3.35 TB/s HBM3
    GpuSpec("h100", 989.5, 1979.0, 3.35, 80.0),
    # H100 NVL 94 GB: ~835 dense BF16 (1,671 sparse), ~1,671 dense FP8, 3.9 TB/s HBM3
    GpuSpec("h100-nvl", 835.0, 1671.0, 3.9, 94.0),
    # H200 SXM 141 GB: H100 SXM compute, 4.8 TB/s HBM3e
    GpuSpec("h200", 989.5, 1979.0, 4.8, 141.0),
    # H200 NVL 141 GB (the paper's "H200 NVL (144 GiB)"): H100 NVL compute, 4.8 TB/s
    GpuSpec("h200-nvl", 835.0, 1671.0, 4.8, 141.0),
)}

#: bytes per parameter of MXFP4: 4-bit values plus one 8-bit scale per 32 (OCP MX spec)
MXFP4_BYTES = 0.53125
_WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


def model_from_hf_config(name: str, cfg: dict) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (decoder-only, dense or MoE,
    optionally with sliding-window layers). Raises ValueError on a layout it cannot price
    (e.g. MoE on only some layers) rather than pricing it wrongly."""
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        vocab = int(cfg["vocab_size"])
        max_len = int(cfg["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: config.json lacks a usable {exc}") from None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
        raise ValueError(f"{name}: MoE on only some layers is not modelled")
    expert_width = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) \
        if experts else 0
    kinds = cfg.get("layer_types") or ["full_attention"] * layers
    if len(kinds) != layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{name}: layer_types must name {layers} full/sliding attention layers")
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    window = int(cfg["sliding_window"]) if sliding else None
    weight_bytes = _WEIGHT_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2.0)
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"{name}: quantization {quant!r} is not modelled")
    return ModelSpec(
        name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab=vocab, max_model_len=max_len,
        dense_intermediate=0 if experts else int(cfg.get("intermediate_size", 0)),
        num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok", 0)),
        expert_intermediate=expert_width, sliding_window=window,
        sliding_layers=len(sliding), tie_embeddings=bool(cfg.get("tie_word_embeddings")),
        weight_bytes=weight_bytes,
        # MXFP4 covers the experts only (modules_to_not_convert: attention, router,
        # embeddings, lm_head)
        expert_weight_bytes=MXFP4_BYTES if quant == "mxfp4" else weight_bytes,
        hf_id=str(cfg.get("_name_or_path", "")), sliding_layer_ids=sliding)


def hf_config(name: str) -> dict:
    """The shipped ``config.json`` fields of model ``name``."""
    text = resources.files("mars.emulate").joinpath("hf_configs", f"{name}.json").read_text()
    return json.loads(text)


#: Qwen/Qwen3-Coder-30B-A3B-Instruct: 48 layers, hidden 2048, 32 heads / 4 KV heads x 128,
#: every layer MoE (128 experts, 8 active, 768 wide), vocab 151936, 262144 positions, bf16.
#: openai/gpt-oss-120b: 36 layers, hidden 2880, 64 heads / 8 KV heads x 64, 128 experts
#: (4 active, 2880 wide, MXFP4), sliding window 128 on the 18 even layers, vocab 201088,
#: 131072 positions.
MODELS: dict[str, ModelSpec] = {
    n: model_from_hf_config(n, hf_config(n)) for n in ("qwen3-coder-30b-a3b", "gpt-oss-120b")}


#: GiB the real engine keeps out of the KV pool for activations, CUDA graphs and the
#: allocator (what vLLM's profiling run measures on the card; our choice, docs/emulation.md)
ACTIVATION_RESERVE_GIB = 2.0


def kv_budget_bytes(model: ModelSpec, gpu: GpuSpec, utilization: float,
                    reserve_gib: float = ACTIVATION_RESERVE_GIB) -> int:
    """Bytes the real card leaves for the KV cache, as vLLM's memory profiling finds them:
    memory x utilization - reserve - weights. Raises ValueError when the weights do not fit."""
    free = (gpu.memory_gib * utilization - reserve_gib) * 2**30 - model.weight_memory_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name} ({model.weight_memory_bytes / 2**30:.1f} GiB of weights) does not "
            f"fit on {gpu.name} at --gpu-memory-utilization {utilization}")
    return int(free)


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
