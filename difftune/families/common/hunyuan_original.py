"""The original (Tencent's) layout that HunyuanImage 2.1's and HunyuanVideo 1.5's single files use, as diffusers'
converters map them (scripts/convert_hunyuan_image_to_diffusers.py, scripts/convert_hunyuan_video1_5_to_diffusers.py):
the double-stream blocks and the caption's token refiner are named alike in both models, and so are the caption
embedders, the image input and the output layer. Each stream's q, k and v are one layer (`img_attn_qkv`,
`FUSED_DOUBLE_BLOCK`) in Tencent's HunyuanImage 2.1 file and in ComfyUI's files of both models (Comfy-Org's
repackaged ones), three (`img_attn_q`, `ORIGINAL_IN_BLOCK`) in Tencent's HunyuanVideo 1.5 files. Tables in
`OriginalFileLayout`'s form, inverted from the converters.
"""

from __future__ import annotations

# diffusers' module in a double-stream block -> the original model's (Tencent's, musubi-tuner's, ComfyUI's).
ORIGINAL_IN_BLOCK = {
    "attn.to_q": "img_attn_q",
    "attn.to_k": "img_attn_k",
    "attn.to_v": "img_attn_v",
    "attn.to_out.0": "img_attn_proj",
    "attn.add_q_proj": "txt_attn_q",
    "attn.add_k_proj": "txt_attn_k",
    "attn.add_v_proj": "txt_attn_v",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1",
    "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1",
    "ff_context.net.2": "txt_mlp.fc2",
    "norm1.linear": "img_mod.linear",
    "norm1_context.linear": "txt_mod.linear",
}
NORMS_IN_BLOCK = {  # the query and key norms (no adapter reaches them; the single file holds them)
    "attn.norm_q": "img_attn_q_norm",
    "attn.norm_k": "img_attn_k_norm",
    "attn.norm_added_q": "txt_attn_q_norm",
    "attn.norm_added_k": "txt_attn_k_norm",
}
# The double-stream blocks and the token refiner, whose blocks fuse q, k and v (`self_attn_qkv`).
ORIGINAL_BLOCKS = {
    "transformer_blocks": (
        "double_blocks",
        {original: [module] for module, original in (ORIGINAL_IN_BLOCK | NORMS_IN_BLOCK).items()},
    ),
    "context_embedder.token_refiner.refiner_blocks": (
        "txt_in.individual_token_refiner.blocks",
        {
            "norm1": ["norm1"],
            "self_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
            "self_attn_proj": ["attn.to_out.0"],
            "norm2": ["norm2"],
            "mlp.fc1": ["ff.net.0.proj"],
            "mlp.fc2": ["ff.net.2"],
            "adaLN_modulation.1": ["norm_out.linear"],
        },
    ),
}
# Outside the blocks, what both models have. The output modulation's halves are in the other order (`SWAPPED_HALVES`).
ORIGINAL_GLOBALS = {
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder_2.norm": "byt5_in.layernorm",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "x_embedder.proj": "img_in.proj",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "proj_out": "final_layer.linear",
}
SWAPPED_HALVES = ("norm_out.linear.weight", "norm_out.linear.bias")
# A double block with each stream's q, k and v fused (see the module's docstring), in the order of its output rows.
FUSED_DOUBLE_BLOCK = {
    original: modules
    for original, modules in ORIGINAL_BLOCKS["transformer_blocks"][1].items()
    if not original.endswith(("_attn_q", "_attn_k", "_attn_v"))
} | {
    "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
}
FUSED_BLOCKS = ORIGINAL_BLOCKS | {"transformer_blocks": ("double_blocks", FUSED_DOUBLE_BLOCK)}
