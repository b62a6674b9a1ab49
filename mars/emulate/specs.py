"""Model and GPU descriptions for the step-time model, and the shipped profiles.

Sources (docs/emulation.md has the full table):

* GPUs: NVIDIA's H100 and H200 datasheets; the headline Tensor Core numbers there include 2:4
  sparsity, so dense = half. Cross-checked against copies in inference-sim
  (``hardware_config.json``) and simllm (``simllm/compute/transformer.py``).
* Models: the official Hugging Face ``config.json`` of Qwen/Qwen3-Coder-30B-A3B-Instruct and
  openai/gpt-oss-120b (field names quoted next to each spec below).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


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

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    # Qwen/Qwen3-Coder-30B-A3B-Instruct config.json: hidden_size 2048, num_hidden_layers 48,
    # num_attention_heads 32, num_key_value_heads 4, head_dim 128, moe_intermediate_size 768,
    # num_experts 128, num_experts_per_tok 8, decoder_sparse_step 1 / mlp_only_layers [] (every
    # layer MoE), vocab_size 151936, max_position_embeddings 262144, tie_word_embeddings
    # false, torch_dtype bfloat16
    ModelSpec("qwen3-coder-30b-a3b", num_layers=48, hidden=2048, num_heads=32,
              num_kv_heads=4, head_dim=128, vocab=151936, max_model_len=262144,
              num_experts=128, experts_per_token=8, expert_intermediate=768),
    # openai/gpt-oss-120b config.json: hidden_size 2880, num_hidden_layers 36,
    # num_attention_heads 64, num_key_value_heads 8, head_dim 64, intermediate_size 2880 (per
    # expert), num_local_experts 128, num_experts_per_tok 4, sliding_window 128, layer_types
    # alternating sliding_attention / full_attention (18 + 18), vocab_size 201088,
    # max_position_embeddings 131072, quantization_config mxfp4 except self_attn, router,
    # embed_tokens and lm_head
    ModelSpec("gpt-oss-120b", num_layers=36, hidden=2880, num_heads=64, num_kv_heads=8,
              head_dim=64, vocab=201088, max_model_len=131072, num_experts=128,
              experts_per_token=4, expert_intermediate=2880, sliding_window=128,
              sliding_layers=18, expert_weight_bytes=0.53125),
)}


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
