"""What a run trains besides (or instead of) the base weights, and the files it is written to and read from.

`kinds` (LoRA, DoRA, LoHa, LoKr through peft; their targets and configs), `embeddings` (textual inversion's new
tokens), `kohya` (the kohya / A1111 / ComfyUI layout, through the family's layout), `files` (other trainers' adapter
files read) and `export` (both layouts written, loading adapters into a pipeline, merging into the base).

May import: families, data, memory, the config schema and the leaf modules. Never the training loop.
"""
