"""Llama (Llama-3 family): a model file following autopar's model-file convention.

The model code is plain PyTorch in autopar/zoo/llama.py (RMSNorm, SwiGLU, RoPE,
grouped-query attention, as the common reference implementations write them);
this file only names it, with one factory per preset:

    autopar plan examples/llama.py:llama3_70b --gpus 256 --device h100-sxm --batch-size 512
"""
from autopar.zoo.llama import *  # noqa: F401,F403  (Llama, LlamaConfig, PRESETS, a factory per preset, ...)
