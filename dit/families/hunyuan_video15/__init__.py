"""HunyuanVideo-1.5 (diffusers' ``HunyuanVideo15Transformer3DModel``) on packed variable-length clips."""
