"""The video DiT: model, objective, sampler and single-process training loop."""

from dit.quiet_imports import hide_bitsandbytes

hide_bitsandbytes()  # before diffusers or peft can import it: see dit/quiet_imports.py
