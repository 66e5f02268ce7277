"""GPT (GPT-2 / GPT-3 family): a model file following autopar's model-file convention.

The model code is plain PyTorch in autopar/zoo/gpt.py (a fused qkv projection split
by the full hidden size, learned position embeddings, the head tied to the token
embedding); this file only names it, with one factory per preset:

    autopar inspect examples/gpt.py:gpt_tiny
    autopar plan examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g --batch-size 1536
"""
from autopar.zoo.gpt import *  # noqa: F401,F403  (GPT, GPTConfig, PRESETS, a factory per preset, build_model, ...)
