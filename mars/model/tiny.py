"""The embedded default model: a tiny Qwen2-architecture model we generate ourselves.

No model hub is reachable from the machines this project runs on, so tests, the demo and the
replay harness need a model that the project can make from nothing. It has random (seeded)
weights, so what it says is noise; what matters is that vLLM loads it through its normal path
(config.json + safetensors + a fast tokenizer + a chat template), that it is cheap enough to
serve on two CPU cores, and that its context is long enough (64K) for agent-sized prompts
(the OpenHands system prompt plus tool schemas alone is ~6.6K tokens).

The chat template supports tools in the Hermes format, so vLLM's ``hermes`` tool parser and
``tool_choice="required"`` (guided JSON) produce valid tool calls from it. Guided decoding only
restricts *which* tokens may follow; with purely random weights a greedy model can wander inside
a JSON string forever. So the weights carry one deliberate, documented structure: every token
embedding shares a constant component, and the (untied) output head maps that component to a
fixed preference ``"`` > ``}`` > ``]`` > ``<|im_end|>`` > everything else. Under a JSON grammar
the model therefore closes strings, objects and arrays as soon as the grammar allows, and then
stops; unconstrained, it emits ``"`` tokens (the replay harness forces lengths with
``ignore_eos``, so this is irrelevant there). All other weights are seeded noise.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. head_dim 32 because vLLM's CPU attention supports 32..512."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 65536
    seed: int = 0
    #: bump when the generator changes, so cached copies are rebuilt
    version: int = 2


def _data(name: str) -> str:
    return resources.files("mars.model").joinpath("data", name).read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the corpus shipped in ``mars/model/data``: deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_data("corpus.txt").splitlines(), trainer=trainer)
    return tok


def write_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model to ``out_dir`` (created); returns the path. Idempotent for a given spec."""
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "mars_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out

    tok = build_tokenizer(spec.vocab_size)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    hf_tok.chat_template = _data("chat_template.jinja")
    hf_tok.model_max_length = spec.max_position_embeddings
    hf_tok.save_pretrained(out)
    # Some tokenizer loaders only read the template from its own file.
    (out / "chat_template.jinja").write_text(_data("chat_template.jinja"))

    vocab = len(tok.get_vocab())
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        torch_dtype="bfloat16",
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    _add_closing_preference(model, tok)
    model = model.to(torch.bfloat16)
    config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
    }))
    marker.write_text(json.dumps(asdict(spec)))
    return out


#: output-head weights on the shared embedding component: higher = preferred when allowed
CLOSING_PREFERENCE = {'"': 3.0, "}": 2.5, "]": 2.0, "<|im_end|>": 1.5}


def _add_closing_preference(model, tok) -> None:
    """See the module docstring: a constant residual component read by the output head."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        head = model.lm_head.weight
        head[:, 0] = 0.0
        for token in SPECIAL_TOKENS:
            head[tok.token_to_id(token), 0] = -3.0
        for token, weight in CLOSING_PREFERENCE.items():
            head[tok.token_to_id(token), 0] = weight


def default_model_dir() -> Path:
    """Where ``mars-vllm serve`` puts the embedded model when no model is named."""
    base = os.environ.get("MARS_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mars")
    return Path(base) / "tiny-qwen2"
