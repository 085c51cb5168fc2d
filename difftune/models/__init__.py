"""A base's parts as modules: found, loaded in the dtype each is kept in, and handed to a family.

`components` (`Components`, a base's parts: loading helpers and placement), `dtypes` (the dtypes a run keeps its
parts in, decided once), `autoencoders` (VAEs and TAESD: loading, encoding, latent normalization), `single_file` (the
LDM / SGM single-file layouts of the UNet families) and `denoiser_files` (a denoiser's own file, safetensors or GGUF,
read where it lies).

May import: memory, the config schema and the leaf modules. What is particular to a family (which parts, which
classes, which layout) is the family's: this layer takes a family as an argument and never imports one.
"""
