"""CLIP image tokens for Wan2.1 I2V / FLF2V, through transformers' CLIPVisionModel from a local folder.

    encoder = load_image_encoder("/ckpt/Wan2.1-I2V-14B-480P-Diffusers")   # or its image_encoder/ folder
    tokens = encoder.encode(frames)   # (k, 3, H, W) in [-1, 1] -> (k, 257, 1280) for ViT-H/14

Exactly what ``WanImageToVideoPipeline.encode_image`` computes: the folder's CLIPImageProcessor
(resize, crop, normalize; the ``image_processor/`` subfolder of a pipeline, else the encoder's own
folder), then the vision tower's second-to-last hidden states.
"""

from __future__ import annotations

import os

import torch


class ClipImageEncoder:
    def __init__(self, model, processor, device: str | torch.device = "cpu"):
        self.model = model.to(device).eval().requires_grad_(False)
        self.processor, self.device = processor, torch.device(device)
        self.dim = model.config.hidden_size

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """(k, 3, H, W) in [-1, 1] -> (k, tokens, hidden): hidden_states[-2] of the vision tower."""
        import PIL.Image

        # As 8-bit images, what the pipeline's users hand it (and what video frames were): the processor
        # resizes and crops uint8 and float input differently.
        pixels = ((frames.float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (k, 3, H, W)
        images = [PIL.Image.fromarray(x.permute(1, 2, 0).numpy()) for x in pixels]
        inputs = self.processor(images=images, return_tensors="pt").to(self.device)
        return self.model(**inputs, output_hidden_states=True).hidden_states[-2].float()


def load_image_encoder(path: str | os.PathLike | None, device: str = "cpu") -> ClipImageEncoder:
    """A CLIP vision encoder and its processor from a local folder (or a Wan I2V pipeline folder)."""
    if path is None or not os.path.isdir(path):
        raise ValueError(
            f"an image-to-video model with image_dim needs CLIP image embeddings: set data.image_encoder_path "
            f"to a local CLIPVisionModel folder (e.g. Wan2.1-I2V-14B-480P-Diffusers/image_encoder); got {path!r}"
        )
    model_dir, processor_dir = str(path), str(path)
    if os.path.isdir(os.path.join(path, "image_encoder")):  # a whole pipeline folder
        model_dir = os.path.join(path, "image_encoder")
        processor_dir = os.path.join(path, "image_processor")
    import importlib.util

    from transformers import CLIPVisionModel

    if importlib.util.find_spec("torchvision") is not None:
        from transformers import CLIPImageProcessor as Processor
    else:  # what CLIPImageProcessor falls back to without torchvision, minus its warning on stderr
        from transformers import CLIPImageProcessorPil as Processor

    model = CLIPVisionModel.from_pretrained(model_dir)
    processor = Processor.from_pretrained(processor_dir if os.path.isdir(processor_dir) else model_dir)
    return ClipImageEncoder(model, processor, device)


def read_image(path: str | os.PathLike) -> torch.Tensor:
    """An image file -> (3, H, W) float in [-1, 1] (RGB), for ``sample.py --image``."""
    import numpy as np
    import PIL.Image

    if not os.path.isfile(path):
        raise ValueError(f"image {path} does not exist; pass the path of a PNG or JPEG file")
    try:
        with PIL.Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
    except PIL.UnidentifiedImageError:
        raise ValueError(f"{path} is not an image PIL can read; pass a PNG or JPEG file") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 127.5 - 1
