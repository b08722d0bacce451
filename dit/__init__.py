"""The video DiT: model, objective, sampler and single-process training loop."""

from data.quiet_imports import hide_bitsandbytes

hide_bitsandbytes()  # before diffusers or peft can import it: see data/quiet_imports.py
