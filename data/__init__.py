"""Video data: readers, manifests, the clip policy, VAEs and text encoders, and the latent cache."""

from data.quiet_imports import hide_bitsandbytes

hide_bitsandbytes()  # before diffusers, peft or transformers can import it: see data/quiet_imports.py
