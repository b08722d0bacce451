"""The image-conditioning inputs of a sampling request: its first (and last) frame checked against
the model, then turned into what the DiT takes (the I2V/FLF2V condition and CLIP tokens, or Wan2.2
TI2V's first-frame latent).

Legend: n = tokens of one clip, p = patch values.
"""

from __future__ import annotations

import torch

from data.image_cond import image_condition
from dit.image_cond import conditioning_of
from dit.packing import patchify
from dit.sample_requests import SampleRequest
from dit.ti2v import check_first_frame_patch


def model_stride(model, vae) -> tuple[int, int, int]:
    return (1, 1, 1) if vae is None else tuple(vae.stride)


def data_channels(model) -> int:
    """Channels of the latent being denoised: the output's (an image-to-video model takes more in)."""
    return getattr(model.config, "out_channels", None) or model.config.in_channels


def ti2v_first_frame(model, vae, request: SampleRequest, image, last_image, positions):
    """(image latent tokens (n, p), clean (n,)) of a TI2V image-to-video request; None for text-to-video.

    The image alone goes through the VAE (normalized, as the pipeline's ``latent_condition``) and
    stands in for latent frame 0; ``positions`` say which tokens lie there."""
    checked_conditioning(model, vae, request, image, last_image)
    if image is None:
        return None
    device = positions.device
    if vae is None:
        from data.vaes import IdentityVAE

        vae = IdentityVAE(image.shape[0])
    latent = vae.encode(image.to(device, torch.float32)[None, :, None])[0].float()  # (c, 1, h, w)
    grid_f = int(positions[:, 0].max()) + 1
    tokens = patchify(latent.expand(-1, grid_f, -1, -1), tuple(model.config.patch_size))  # (n, p)
    return tokens, positions[:, 0] == 0


def request_images(request: SampleRequest) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The request's first and last frames read from its ``image`` / ``last_image`` files."""
    from data.image_encoders import read_image

    return tuple(read_image(path) if path else None for path in (request.image, request.last_image))


def checked_conditioning(model, vae, request: SampleRequest, image, last_image):
    """The model's ``ImageConditioning`` (None: text-to-video) once the request's frames fit it; a
    ValueError naming the request and the fix when they do not."""
    where = request.label()
    temporal = model_stride(model, vae)[0]
    if getattr(model.config, "expand_timesteps", False):  # TI2V: text-to-video, or --image as frame 0
        check_first_frame_patch(model.config.patch_size)
        if last_image is not None:
            raise ValueError(f"{where}: Wan2.2 TI2V takes a first frame only; drop --last-image")
        check_frame_sizes(request, image, last_image)
        return None
    conditioning = conditioning_of(model.config, data_channels(model), temporal)
    if conditioning is None:
        if image is not None or last_image is not None:
            raise ValueError(f"{where}: an image was given but this is a text-to-video model; drop --image")
        return None
    if image is None:
        raise ValueError(
            f"{where}: this is an image-to-video model: pass the first frame with --image PATH"
            + (" and the last with --last-image PATH" if conditioning.last_frame else "")
            + ' (or "image" in the queue line)'
        )
    if conditioning.last_frame != (last_image is not None):
        need = (
            "needs --last-image PATH (FLF2V: first and last frame)"
            if conditioning.last_frame
            else "takes no --last-image (only FLF2V models do)"
        )
        raise ValueError(f"{where}: this model {need}")
    check_frame_sizes(request, image, last_image)
    return conditioning


def check_frame_sizes(request: SampleRequest, image, last_image) -> None:
    """ValueError naming the request when a given frame's size is not the clip's."""
    where = request.label()
    for name, frame in (("--image", image), ("--last-image", last_image)):
        if frame is not None and tuple(frame.shape[1:]) != (request.height, request.width):
            raise ValueError(
                f"{where}: {name} is {frame.shape[2]}x{frame.shape[1]} but the clip is {request.width}x"
                f"{request.height} (width x height); resize the image or pass --width {frame.shape[2]} "
                f"--height {frame.shape[1]}"
            )


def image_inputs(model, vae, request: SampleRequest, image, last_image, image_encoder):
    """-> the condition tokens (n, P*cc) and the CLIP tokens (m, image_dim) of an image-to-video model,
    (None, None) for a text-to-video one."""
    conditioning = checked_conditioning(model, vae, request, image, last_image)
    if conditioning is None:
        return None, None
    device = next(model.parameters()).device
    image = image.to(device, torch.float32)
    last = None if last_image is None else last_image.to(device, torch.float32)
    if vae is None:
        from data.vaes import IdentityVAE

        vae = IdentityVAE(image.shape[0])
    patch = tuple(model.config.patch_size)
    condition = patchify(image_condition(vae, image, request.frames, last), patch)  # (n, P*cc)
    if not conditioning.clip_tokens:
        return condition, None
    if image_encoder is None:
        raise ValueError(
            f"{request.label()}: this model has image_dim: pass an image encoder (data.image_encoder_path)"
        )
    frames = torch.stack([image] if last is None else [image, last])
    return condition, image_encoder.encode(frames).flatten(0, 1).to(device, torch.float32)  # (m, image_dim)
