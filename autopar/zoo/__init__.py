"""Standard decoders in plain PyTorch (the GPT-2 / GPT-3 and Llama-3 families), written
as people write them and knowing nothing about autopar: the models `--model-size`
builds (sized.py), and the classes examples/gpt.py and examples/llama.py re-export.
Each module follows the model-file convention (autopar/model_file.py)."""
