"""Where weights live and in what dtype: the host and device memory a part takes.

`storage` (frozen weights kept in fp8 or 16 bits and computed in another dtype, memory-mapped files' pages),
`offload` (blocks streamed to the device as they run), `quantize` (nf4 / int8 / fp8 layers through bitsandbytes
and torchao), `checkpointing` (blocks' activations recomputed in the backward pass) and `transfer` (a step's inputs
copied to the device without making the host wait).

May import only difftune's leaf modules (errors). The plan, which predicts a whole job's peaks from a family's parts and
its adapter, reads every layer below training and so lives there (`training/plan.py`).
"""
