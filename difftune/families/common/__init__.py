"""What families share: the `Family` base and its parts (objective, drawing, conditioning, loading, layouts, targets),
the flow-matching families' base, and the pieces a few related families share (Hunyuan's text encoders and original
layouts, Wan 2.2's paired experts). A family's own code is in its folder beside this one."""
