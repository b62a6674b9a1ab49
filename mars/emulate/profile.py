"""A calibrated device profile: the step-time model fitted to an engine measured on real hardware.

The shipped GPU profiles (:mod:`mars.emulate.specs`) are built from spec sheets and published
coefficients. A *profile file* instead records one engine measured where it runs
(``mars emulate calibrate``): the device's measured peaks (a :class:`GpuSpec`), the served
model's ``config.json`` fields (a :class:`ModelSpec`), the :class:`StepCoefficients` fitted to
the measured steps, the engine settings the measurement ran with (the emulation must schedule
with the same block size, token budget and KV pool to predict the same thing) and the fit's
own error. ``mars-vllm serve --emulate FILE``, ``mars sim run --profile FILE`` and ``mars bench
--sim FILE`` run on it, so
the simulator's predictions can be checked against the real engine on this machine.

Framework-free: reading, validating and writing JSON only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from mars.emulate.specs import GpuSpec, ModelSpec, model_from_hf_config
from mars.emulate.step_time import StepCoefficients

FORMAT = "mars-device-profile/1"


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM settings the profile was measured with (and the emulation must use)."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    #: bytes of the KV cache pool (vLLM's ``--kv-cache-memory-bytes`` on CPU)
    kv_cache_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"engine.{f.name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class DeviceProfile:
    """One measured device and model: what the emulated executor needs to stand in for it
    (device, model shapes, coefficients, engine settings) and the evidence (fit, host)."""

    name: str
    gpu: GpuSpec
    #: the served model's config.json fields (the ones :func:`model_from_hf_config` reads)
    model_config: dict[str, Any]
    coefficients: StepCoefficients
    engine: EngineSettings
    #: how well the coefficients fit the measured steps (free-form, reported as is)
    fit: dict[str, Any] = field(default_factory=dict)
    #: where and when it was measured (free-form)
    host: dict[str, Any] = field(default_factory=dict)
    #: the name the measured server served the model under (the emulation serves the same)
    served_model_name: str = ""

    @property
    def model(self) -> ModelSpec:
        return model_from_hf_config(self.name, self.model_config)

    def slowed(self, factor: float) -> "DeviceProfile":
        """The same device ``factor`` times slower (> 1) or faster: every step takes exactly
        ``factor`` x its time (peaks divided, fixed overheads multiplied; the fitted shape is
        kept). For a run measured while the machine ran at another speed than when it was
        calibrated (:func:`mars.emulate.step_log.speed_factor`)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"speed factor must be a positive number, got {factor!r}")
        g, c = self.gpu, self.coefficients
        gpu = replace(g, bf16_tflops=g.bf16_tflops / factor, fp8_tflops=g.fp8_tflops / factor,
                      hbm_tb_s=g.hbm_tb_s / factor)
        coef = replace(c, step_overhead_s=c.step_overhead_s * factor,
                       layer_overhead_s=c.layer_overhead_s * factor,
                       request_overhead_s=c.request_overhead_s * factor)
        return replace(self, gpu=gpu, coefficients=coef,
                       fit={**self.fit, "slowed_by": factor * self.fit.get("slowed_by", 1.0)})

    # ------------------------------------------------------------------ JSON
    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "device": asdict(self.gpu),
                "model_config": self.model_config, "coefficients": asdict(self.coefficients),
                "engine": asdict(self.engine), "fit": self.fit, "host": self.host,
                "served_model_name": self.served_model_name}

    def essentials(self) -> dict[str, Any]:
        """What the engine needs (no measured points, no host facts): vLLM logs and hashes
        its additional_config, so the served engine gets this, not the whole file."""
        d = self.as_dict()
        d["fit"] = {k: v for k, v in self.fit.items() if k != "points"}
        d["host"] = {}
        return d

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceProfile":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a device profile (expected \"format\": \"{FORMAT}\"; "
                             "make one with `mars emulate calibrate`)")
        try:
            dev = dict(d["device"])
            gpu = GpuSpec(**dev)
            for k in ("bf16_tflops", "hbm_tb_s", "memory_gib", "host_link_gb_s"):
                v = getattr(gpu, k)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise ValueError(f"device.{k} must be a positive number, got {v!r}")
            coef = StepCoefficients(**d["coefficients"])
            engine = EngineSettings(**d["engine"])
            prof = cls(name=str(d["name"]), gpu=gpu, model_config=dict(d["model_config"]),
                       coefficients=coef, engine=engine, fit=dict(d.get("fit") or {}),
                       host=dict(d.get("host") or {}),
                       served_model_name=str(d.get("served_model_name") or ""))
            prof.model  # the model config must be one the step-time model can price
        except KeyError as exc:
            raise ValueError(f"device profile lacks {exc}") from None
        except TypeError as exc:
            raise ValueError(f"device profile: {exc}") from None
        return prof

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read device profile {p}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"device profile {p} is not JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None


def profile_digest(path: str | Path) -> str:
    """The file's content hash: results and cached ideal latencies are keyed by it, since a
    profile re-calibrated at the same path predicts different times."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def is_profile_path(spec: str) -> bool:
    """``--emulate`` takes ``GPU:MODEL`` or a profile file: a file is named by its path."""
    return spec.endswith(".json") or Path(spec).is_file()
