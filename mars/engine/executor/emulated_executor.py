"""An emulated GPU inside unmodified vLLM: a V1 executor with no model and a step-time model.

vLLM picks its executor from ``--distributed-executor-backend``, which accepts the qualified
name of any ``Executor`` subclass; ``mars-vllm serve --emulate GPU:MODEL`` passes
:class:`EmulatedExecutor` there, with the profile in ``additional_config["mars_emulate"]``.
Everything else is vLLM's own: its scheduler (or ours through ``--scheduler-cls``), its KV
cache manager and block pool, the API server, the detokenizer.

What the executor does in place of a GPU worker:

* **KV cache specs** of the *target* model (from its shipped ``config.json``,
  :mod:`mars.emulate.specs`): one attention spec per layer with the target's KV heads, head
  size and KV dtype; sliding-window layers (GPT-OSS) get vLLM's sliding-window spec, so vLLM
  builds its hybrid KV cache groups as for the real model.
* **Memory** as the real card would leave it for KV: ``memory x --gpu-memory-utilization -
  weights - activation reserve``; vLLM turns it into the block pool. The resulting token
  capacity is logged at start-up.
* **Each step** returns sampled tokens (:class:`mars.emulate.batch.RequestTable`) once the
  step-time model's time for the batch has passed (:class:`mars.emulate.pacing.WallPacer`).
* **Async scheduling**, as vLLM runs it on the card by default: the executor says it supports
  it, and :mod:`mars.engine.executor.emulated_platform` keeps vLLM's decision where the CPU
  platform would drop it. Then, as vLLM's GPU worker does, ``execute_model`` returns nothing,
  ``sample_tokens`` returns an :class:`~vllm.v1.outputs.AsyncModelRunnerOutput`, and its
  ``get_output`` (what vLLM's ``UniProcExecutor`` future calls when the engine pops the step
  from its batch queue) returns when the step is done on the device's timeline
  (:meth:`~mars.emulate.pacing.StepPacer.launch` / ``wait``).

The tokenizer, and so the text, is the embedded tiny model's: vLLM is started on its directory
with the target's served name and context limit, and never loads its weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import AsyncModelRunnerOutput

from mars.emulate.batch import NATURAL_TOKENS, EmulatedOutput, RequestTable, Scheduled
from mars.emulate.pacing import StepPacer, WallPacer, set_active
from mars.emulate.profile import DeviceProfile
from mars.emulate.specs import (ACTIVATION_RESERVE_GIB, GpuSpec, ModelSpec, get_gpu, get_model,
                                kv_budget_bytes)
from mars.emulate.measured import step_model_for
from mars.emulate.step_time import StepCoefficients, StepTimer

logger = logging.getLogger("mars.emulate")

CONFIG_KEY = "mars_emulate"
QUALNAME = "mars.engine.executor.emulated_executor.EmulatedExecutor"


@dataclass(frozen=True)
class EmulationConfig:
    """What ``additional_config["mars_emulate"]`` carries to the engine process."""

    gpu: str
    model: str
    #: StepCoefficients field overrides (fitted profiles, tests)
    coefficients: dict[str, float] = field(default_factory=dict)
    reserve_gib: float = ACTIVATION_RESERVE_GIB
    natural_tokens: int = NATURAL_TOKENS
    #: a calibrated device profile (:mod:`mars.emulate.profile`, as a dict): its device,
    #: model, coefficients and KV pool replace the shipped GPU x model
    profile: dict[str, Any] | None = None
    #: "measured": the operator tables timed on the GPU where they exist (H100, H200 and the
    #: NVL cards derived from them), else the roofline; "roofline": the roofline always (the
    #: model every result before the measured tables came from)
    step_model: str = "measured"
    #: host <-> device bandwidth each way, GB/s, in place of the card's
    #: (:data:`mars.emulate.specs.PCIE_GEN5_X16_GB_S`); used only with --kv-offloading-size
    host_link_gb_s: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmulationConfig":
        return cls(gpu=d["gpu"], model=d["model"], coefficients=dict(d.get("coefficients") or {}),
                   reserve_gib=float(d.get("reserve_gib", ACTIVATION_RESERVE_GIB)),
                   natural_tokens=int(d.get("natural_tokens", NATURAL_TOKENS)),
                   profile=d.get("profile"), step_model=str(d.get("step_model", "measured")),
                   host_link_gb_s=d.get("host_link_gb_s"))

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "model": self.model, "coefficients": self.coefficients,
                "reserve_gib": self.reserve_gib, "natural_tokens": self.natural_tokens,
                "profile": self.profile, "step_model": self.step_model,
                "host_link_gb_s": self.host_link_gb_s}

    def device_profile(self) -> DeviceProfile | None:
        return DeviceProfile.from_dict(self.profile) if self.profile is not None else None

    def specs(self, kv_cache_dtype: str = "auto") -> tuple[ModelSpec, GpuSpec]:
        prof = self.device_profile()
        model = prof.model if prof else get_model(self.model)
        if kv_cache_dtype.startswith("fp8"):
            model = model.with_kv_bytes(1)
        return model, prof.gpu if prof else get_gpu(self.gpu)

    def host_link(self, gpu: GpuSpec):
        """The card's host link (:class:`~mars.policy.engine.host_tier.HostLink`), the
        configured bandwidth in place of the card's when one is given."""
        from mars.policy.engine.host_tier import HostLink

        gb_s = self.host_link_gb_s if self.host_link_gb_s is not None else gpu.host_link_gb_s
        if isinstance(gb_s, bool) or not isinstance(gb_s, (int, float)) \
                or not (math.isfinite(gb_s) and gb_s > 0):
            raise ValueError(f"the host link's bandwidth (--emulate-config host_link_gb_s) "
                             f"must be a positive number of GB/s, got {gb_s!r}")
        return HostLink(d2h_bytes_per_s=gb_s * 1e9, h2d_bytes_per_s=gb_s * 1e9)

    def step_coefficients(self) -> StepCoefficients:
        """The profile's fitted coefficients (or the defaults), with any overrides applied."""
        prof = self.device_profile()
        return replace(prof.coefficients if prof else StepCoefficients(), **self.coefficients)

    def step_timer(self, model: ModelSpec, gpu: GpuSpec) -> StepTimer:
        """The step-time model: a device profile's fitted roofline, the roofline with the
        coefficients overridden, or (by default) the measured tables where the GPU has them
        (:func:`mars.emulate.measured.step_model_for`)."""
        if self.device_profile() is not None or self.coefficients:
            return step_model_for(model, gpu, self.step_coefficients(), kind="roofline")
        return step_model_for(model, gpu, kind=self.step_model)

    def kv_cache_bytes(self, model: ModelSpec, gpu: GpuSpec, utilization: float) -> int:
        """The KV pool: the profile's measured pool, or what the card leaves
        (:func:`~mars.emulate.specs.kv_budget_bytes`)."""
        prof = self.device_profile()
        if prof is not None:
            return prof.engine.kv_cache_bytes
        return kv_budget_bytes(model, gpu, utilization, self.reserve_gib)


def emulated_host_link(vllm_config):
    """The emulated card's host link (:meth:`EmulationConfig.host_link`), or None when the
    engine is not emulated."""
    raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if not raw:
        return None
    cfg = EmulationConfig.from_dict(raw)
    return cfg.host_link(cfg.specs(str(vllm_config.cache_config.cache_dtype))[1])


def tokenizer_size(model_config) -> int:
    """Ids the served tokenizer knows (vLLM rejects a prompt with any other, and the replay
    feeds sampled tokens back as prompt ids); the model config's vocab can be larger."""
    from pathlib import Path

    path = Path(str(model_config.tokenizer)) / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab_size()
    return model_config.get_vocab_size()


class EmulatedWorker:
    """The worker methods vLLM's EngineCore calls, without a device or a model."""

    def __init__(self, vllm_config, pacer: StepPacer | None = None) -> None:
        self.vllm_config = vllm_config
        raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if not raw:
            raise ValueError(f"{QUALNAME} needs additional_config[{CONFIG_KEY!r}] "
                             "(start it with `mars-vllm serve --emulate GPU:MODEL`)")
        self.config = EmulationConfig.from_dict(raw)
        cache = vllm_config.cache_config
        self.model, self.gpu = self.config.specs(str(cache.cache_dtype))
        self.step_model = self.config.step_timer(self.model, self.gpu)
        self.table = RequestTable(EmulatedOutput(
            token_hi=tokenizer_size(vllm_config.model_config),
            natural_tokens=self.config.natural_tokens))
        self.pacer = pacer or WallPacer()
        set_active(self.pacer)
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        #: async: the step execute_model ran, for sample_tokens to launch
        self._executed: tuple[Any, float] | None = None
        #: vLLM's KV offloading on the emulated host link (``--kv-offloading-size``)
        self.offload = None

    # ------------------------------------------------------------------ start-up
    def get_kv_cache_spec(self) -> dict:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        m = self.model
        block = self.vllm_config.cache_config.block_size
        dtype = torch.float8_e4m3fn if m.kv_bytes == 1 else torch.bfloat16
        sliding = set(m.sliding_layer_ids)
        specs = {}
        for i in range(m.num_layers):
            name = f"model.layers.{i}.self_attn.attn"
            if i in sliding:
                specs[name] = SlidingWindowSpec(block_size=block, num_kv_heads=m.num_kv_heads,
                                                head_size=m.head_dim, dtype=dtype,
                                                sliding_window=m.sliding_window)
            else:
                specs[name] = FullAttentionSpec(block_size=block, num_kv_heads=m.num_kv_heads,
                                                head_size=m.head_dim, dtype=dtype)
        return specs

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # FlashAttention's NHD

    def set_kv_cache_layout(self, layout_name: str) -> None:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(self.vllm_config.cache_config, layout_name)

    def determine_available_memory(self) -> int:
        return self.config.kv_cache_bytes(
            self.model, self.gpu, self.vllm_config.cache_config.gpu_memory_utilization)

    def initialize_from_config(self, kv_cache_config) -> None:
        cfg = kv_cache_config[0] if isinstance(kv_cache_config, list) else kv_cache_config
        if self.vllm_config.kv_transfer_config is not None:
            from mars.engine.executor.offload import EmulatedOffload

            # the pacer is read when a transfer is timed: the simulator swaps in its own
            self.offload = EmulatedOffload(
                self.vllm_config, cfg, self.config.host_link(self.gpu),
                now=lambda: self.pacer.now(), wait_until=lambda t: self.pacer.until(t))
            logger.warning("mars: vLLM's KV offloading on the EMULATED host link: %.1f GB/s "
                           "each way", self.offload.link.link.h2d_bytes_per_s / 1e9)
        block = self.vllm_config.cache_config.block_size
        tokens = getattr(self.vllm_config.cache_config, "kv_cache_size_tokens", None)
        logger.warning(
            "mars: EMULATED GPU %s serving %s (no weights; step-time model: %s; %s "
            "scheduling): %.1f GiB of KV cache = %d blocks of %d tokens; vLLM's capacity %s "
            "tokens at max_model_len %d",
            self.gpu.name, self.model.name, self.step_model.kind,
            "async" if self.async_scheduling else "sync",
            self.determine_available_memory() / 2**30,
            cfg.num_blocks, block, f"{tokens:,}" if tokens else "?",
            self.vllm_config.model_config.max_model_len)

    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        so = scheduler_output
        # a preempted request keeps its entry: when resumed, the scheduler restates its length
        self.table.finish(so.finished_req_ids)
        if not so.total_num_scheduled_tokens:
            if self.offload is not None:
                # vLLM's kv_connector_no_forward: transfers start once queued compute is done
                now = self.pacer.now()
                free = max(now, self.pacer.busy_until())
                return ModelRunnerOutput.with_kv_conn_output_only(self._connector_step(
                    so, free, free))
            return EMPTY_MODEL_RUNNER_OUTPUT
        if not self.async_scheduling:
            self.pacer.begin()
        n_sched = so.num_scheduled_tokens
        batch: list[Scheduled] = []
        for r in so.scheduled_new_reqs:
            sp = r.sampling_params
            stop = None
            if sp is not None and not sp.ignore_eos and sp.all_stop_token_ids:
                stop = min(sp.all_stop_token_ids)
            self.table.add(r.req_id, r.prompt_len, stop)
            batch.append(Scheduled(r.req_id, r.num_computed_tokens, n_sched[r.req_id]))
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            restated = c.all_token_ids.get(rid) if rid in c.resumed_req_ids else None
            batch.append(Scheduled(rid, c.num_computed_tokens[i], n_sched[rid],
                                   len(restated) if restated is not None else None))
        entries, sampled = self.table.step(batch)
        req_ids = [s.req_id for s in batch]
        modeled = self.step_model.step_time(entries)
        kv_out = None
        if self.offload is not None:
            # the device runs this step after what it has queued (async) or now (sync); the
            # step's copies wait for its forward, as vLLM's copy stream waits for compute
            now = self.pacer.now()
            free = max(now, self.pacer.busy_until()) if self.async_scheduling else now
            kv_out = self._connector_step(so, free, free + modeled)
        out = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                sampled_token_ids=[sampled[rid] for rid in req_ids],
                                kv_connector_output=kv_out)
        if self.async_scheduling:
            # as the GPU worker under async scheduling: the outputs come from sample_tokens
            self._executed = (out, modeled)
            return None
        self.pacer.end(modeled)
        return out

    def _connector_step(self, so, device_free: float, step_end: float):
        """The connector's whole step, at launch, as vLLM's GPU runner runs it on the host
        thread: transfers the link finished by now are reported, later ones at a later step.
        A preempted request's stores flush after the compute already queued
        (``device_free``); this step's loads and the last step's stores after its forward
        (``step_end``)."""
        self.offload.begin(so, device_free, step_end)
        return self.offload.end(so)

    def sample_tokens(self, grammar_output):
        if self._executed is None:
            raise RuntimeError("sample_tokens without a step executed (the emulated executor "
                               "samples in execute_model unless scheduling is async)")
        out, modeled = self._executed
        self._executed = None
        return _LaunchedStep(out, self.pacer, self.pacer.launch(modeled))

    def take_draft_token_ids(self):
        return None

    def execute_dummy_batch(self) -> None:
        pass

    # ------------------------------------------------------------------ housekeeping
    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.offload is not None:
            self.offload.shutdown()
        set_active(None)

    def supports_draft_weight_updates(self) -> bool:
        return False

    def update_max_model_len(self, max_model_len: int) -> None:
        pass

    def synchronize_device(self) -> None:
        pass

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def get_kv_connector_handshake_metadata(self):
        return None

    def list_loras(self) -> set[int]:
        return set()


class _LaunchedStep(AsyncModelRunnerOutput):
    """A step on the emulated device: its outputs once the device has finished it."""

    def __init__(self, out, pacer: StepPacer, done_at: float) -> None:
        self._out, self._pacer, self._done_at = out, pacer, done_at

    def get_output(self):
        self._pacer.wait(self._done_at)
        return self._out


class EmulatedExecutor(UniProcExecutor):
    """vLLM's single-process executor with :class:`EmulatedWorker` as its worker."""

    def _init_executor(self) -> None:
        self.driver_worker = EmulatedWorker(self.vllm_config)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        # as vLLM's GPU executors; the worker launches steps on the pacer's device timeline
        return True
