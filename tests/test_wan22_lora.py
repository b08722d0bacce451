"""A LoRA trained on one Wan2.2 A14B expert loads into diffusers' two-expert WanPipeline: the high
expert's with ``load_lora_weights(dir)`` into ``transformer``, the low expert's with
``load_into_transformer_2=True`` into ``transformer_2``, with no missing or unexpected keys (diffusers
warns of either; none is logged), every trained adapter weight landing on its layer and the other
expert left without adapters (musubi-tuner #621, DiffSynth #750: LoRAs with no effect on one expert).

Planted and caught: saving the adapters under a ``transformer_2.`` prefix (what one might write for
the low expert): diffusers finds none of its layers and the load fails.

``sample.py --checkpoint`` of that run samples its trained low expert beside the folder's high one
(planted: the trained expert put in the high slot: the high expert's weights differ).
"""

from __future__ import annotations

import logging

import torch
from test_lora import WAN, lora_overrides, make_wan

from dit import lora
from dit.config import load_config
from dit.trainer import Trainer


def test_expert_lora_loads_into_its_transformer_of_the_pipeline(tmp_path):
    import json

    from diffusers import WanPipeline

    root = tmp_path / "a14b"
    make_wan(1).save_pretrained(root / "transformer")
    make_wan(2).save_pretrained(root / "transformer_2")
    index = {"_class_name": "WanPipeline", "boundary_ratio": 0.875, "transformer_2": ["diffusers", "X"]}
    (root / "model_index.json").write_text(json.dumps(index))
    overrides = lora_overrides(
        tmp_path, "run", **{"model.pretrained": str(root), "model.expert": "low", "flow.val_sigmas": "[0.5, 0.95]",
                            "train.max_steps": 2, "train.sample_every": 0, "train.checkpoint_every": 100},
    )  # fmt: skip
    trainer = Trainer(load_config(lora.__file__.replace("dit/lora.py", "configs/tiny.yaml"), overrides))
    trainer.train()
    trained = {n: p for n, p in trainer.ema.state.items() if "lora_B" in n}
    assert trained and all(float(p.abs().max()) > 0 for p in trained.values())

    for expert in ("low", "high"):  # the low expert's file, and the same file as a high expert's
        high, low = make_wan(1), make_wan(2)
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=high,
                           transformer_2=low, boundary_ratio=0.875)  # fmt: skip
        messages = load_logging(pipe, str(tmp_path / "run"), load_into_transformer_2=expert == "low")
        assert not [m for m in messages if "unexpected keys" in m or "missing keys" in m], messages
        target, other = (high, low) if expert == "high" else (low, high)
        assert not any(".lora_" in n for n, _ in other.named_parameters())  # the other expert untouched
        loaded = {n: p for n, p in target.named_parameters() if "lora_B" in n}
        assert len(loaded) == len(trained)
        for name, value in trained.items():  # ours: ...lora_B.default.weight; theirs: ...default_0.weight
            theirs = loaded[name.replace(".lora_B.default.", ".lora_B.default_0.")]
            assert torch.equal(theirs.detach().reshape(value.shape), value), name  # Conv3d: (D, r, 1, 1, 1)
    assert WAN["in_channels"] == target.config.in_channels

    # sample.py --checkpoint of the run: its low expert (base + adapters) beside the folder's high one
    from dit.experts import ExpertPair
    from dit.sampler_setup import load_checkpoint_sampler

    sampler = load_checkpoint_sampler(str(tmp_path / "run"), "ema", None, 1.0, "cpu")
    assert isinstance(sampler.model, ExpertPair) and sampler.model.boundary_ratio == 0.875
    high_want = make_wan(1).state_dict()
    high_got = sampler.model.high.state_dict()
    assert all(torch.equal(high_got[k], high_want[k]) for k in high_want if k != "patch_embedding.weight")
    lora_merged = sampler.model.low.state_dict()["blocks.0.attn1.to_q.weight"]
    assert not torch.equal(lora_merged, make_wan(2).state_dict()["blocks.0.attn1.to_q.weight"])


def load_logging(pipe, path: str, **kwargs) -> list[str]:
    """``pipe.load_lora_weights(path, **kwargs)``; -> what diffusers logged meanwhile (it warns of
    missing and unexpected keys)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        pipe.load_lora_weights(path, **kwargs)
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    return [r.getMessage() for r in records]
