"""Parity with diffusers' Wan: our imported VideoDiT against WanTransformer3DModel (outputs and
gradients, tolerances derived once for every Wan variant), and the fixed inputs the pipeline parity
tests share (text embeddings, images)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch

TEXT_DIM = 16


class FixedText:
    """The prompt's and the negative prompt's embeddings, unpadded (a text encoder stub)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(5)
        self.rows = {
            "a prompt": torch.randn(5, TEXT_DIM, generator=gen),
            "": torch.randn(3, TEXT_DIM, generator=gen),
        }

    def encode(self, captions):
        return [self.rows[c] for c in captions]

    def padded(self, caption):  # (1, 512, d), as the Wan pipelines pad umT5 output
        rows = self.rows[caption]
        return torch.cat([rows, rows.new_zeros(512 - len(rows), TEXT_DIM)])[None]


def pil_image(seed: int, height: int, width: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def as_tensor(image: PIL.Image.Image) -> torch.Tensor:  # (3, H, W) in [-1, 1]
    return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 127.5 - 1


def assert_outputs_and_gradients_match(model, wan, ours, refs, weights) -> dict:
    """``ours`` and ``refs``: each clip's output from ``model`` and from ``wan`` on the same inputs.
    Checks the outputs, then back-propagates the same weighted sum through both and checks every
    parameter's gradient; -> {diffusers key: (our grad in diffusers' layout, diffusers' grad)}.

    Outputs: fp32, O(1) after 2 blocks; both sides compute the same sums in different orders (fused
    vs separate projections, packed vs padded attention, one time embedding per distinct t vs one per
    token), ~1e-7 relative per op over a few dozen ops in sequence, so 1e-5 absolute leaves a 10x
    margin and still catches a wrong weight, mask, image routing or per-token t (>1e-2).

    Gradients: backward rounds at the size of the signals flowing through it, not of each result: a
    parameter's gradient may be a small difference of large terms summed over all text rows (the
    text to_k bias: softmax nearly cancels a shift of all keys), so the allowance is 1e-5 of the
    largest gradient entry G of the model (~1e-7 relative per op stays ~1e-6 G after a few dozen
    ops; G ~ 50 here). A mis-routed input moves gradients by >1e-2 G."""
    for got, want in zip(ours, refs):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-5

    sum((o * w).sum() for o, w in zip(ours, weights)).backward()
    sum((r * w).sum() for r, w in zip(refs, weights)).backward()
    ours_params = dict(model.named_parameters())
    grads = {}
    for key, p in wan.named_parameters():
        grad = ours_params[key].grad
        if key == "patch_embedding.weight":  # (D, pt*ph*pw*c) -> (D, c, pt, ph, pw)
            grad = grad.reshape(grad.shape[0], *model.patch_size, -1).permute(0, 4, 1, 2, 3)
        grads[key] = (grad, p.grad)
    largest = max(float(ref.abs().max()) for _, ref in grads.values())
    for key, (grad, ref) in grads.items():
        assert float((grad - ref).abs().max()) <= 1e-5 * largest, key
    return grads
