"""The data a job trains on: where it lies and how it is read, before any model sees it.

`sources` (a folder, a glob, `.tar` shards, parquet files or a saved Hugging Face dataset, local or on object storage),
`cache_folders` (the caches' folders, wherever they lie), `clips` (video: probing, frame windows, decoding, writing),
`dataset` (examples, captions, bucketed sizes and crops, the per-sample order and seeds), `sharding` (which process
reads what) and `cache` (latents and text embeddings, keyed by what made them).

May import: the config schema and difftune's leaf modules (errors, files, progress). Never a model family, an adapter
or the training loop: the cache is handed the encoders it runs.
"""
