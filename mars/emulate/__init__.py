"""Paper-scale serving without the GPU: everything but the matrix multiplications.

:mod:`~mars.emulate.specs` describes a model (the layer shapes that set a step's work and its
KV layout) and a GPU (peak compute, memory bandwidth, memory), with shipped profiles for the
paper's set-ups; :mod:`~mars.emulate.step_time` turns one engine step's batch into the time
the GPU would take (roofline terms plus fixed overheads). Framework-free: no vLLM, no torch.
Every number that comes from here is an *emulated* GPU's, and is named so wherever it is shown.
"""

from mars.emulate.specs import GPUS, MODELS, GpuSpec, ModelSpec, get_gpu, get_model
from mars.emulate.step_time import BatchEntry, StepCoefficients, StepTimeModel, StepWork

__all__ = ["BatchEntry", "GPUS", "GpuSpec", "MODELS", "ModelSpec", "StepCoefficients",
           "StepTimeModel", "StepWork", "get_gpu", "get_model"]
