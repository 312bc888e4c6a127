"""Course machinery: GPU flag, notebook helpers, Colab setup, lab generation,
grading."""

from .gpu import bf16_supported, choose_device, gpu_cell, gpu_mode  # noqa: F401
from .nb import glue, measured, setup  # noqa: F401
