"""The Gradio front-end (`difftune ui`): configure, launch, watch, sample and export.

`app` (the blocks and their handlers), `form` (the config schema as form fields, and back), `jobs` (runs started as
subprocesses, their progress and stop requests) and `request_filters` (which hosts and uploads are allowed).

A shell like the CLI: it may import any library layer, and nothing imports it but the CLI.
"""
