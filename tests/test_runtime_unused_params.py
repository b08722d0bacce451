"""A parameter no clip of the step used keeps no gradient, on every rank, as in one process.

Found by the FSDP work: with one clip per step, a dropped caption gave the hashed text encoder's
empty (zero-length) text, so the text projections got no gradient in single-process training and
AdamW skipped them. The built-in encoders now give every caption a token (an end-of-text row, as
T5's EOS), but a user's encoder or a latent cache without an empty-caption embedding can still give
zero-length text: the test uses such an encoder. The runtime's all-reduce used to hand them a zero gradient instead, so AdamW's
weight decay and moment decay moved them, and the next step's loss differed (1.72 against 1.83).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from data.hashed_text import HashedTextEncoder
from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.trainer import Trainer
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.testing import run_gloo

OVERRIDES = [
    "model.overrides={num_layers: 2, patch_size: [1, 4, 4]}",
    "data.num_clips=64",
    "data.num_val_clips=1",
    "data.frame_counts=[1, 5]",
    "data.resolutions=[[16, 16], [32, 16]]",
    "flow.val_sigmas=[0.5]",
    "train.global_batch_size=1",  # step 1's only clip has a dropped caption (seed 0)
    "train.micro_batch_tokens=200",
    "train.warmup_steps=0",
    "train.weight_decay=0.1",  # decay on a zero gradient is what moved the unused weights
    "train.grad_clip=0",
    "parallel.cap_tokens=160",
    "parallel.plan_ahead=false",
    "parallel.shard_optimizer=false",
    "parallel.hardware=h100",
    "parallel.learn_costs=false",
]
STEPS = 3
ROOT = Path(__file__).resolve().parents[1]


class NoTokenForEmptyCaption(HashedTextEncoder):
    """The hashed encoder, but an empty caption gives zero text rows (as a user's encoder may)."""

    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        return [t if c.strip() else t[:0] for c, t in zip(captions, super().encode(captions))]


def use_empty_text(trainer: Trainer) -> None:
    trainer.encoder.text_encoder = NoTokenForEmptyCaption(
        trainer.model.config.text_dim, seed=trainer.cfg.data.seed
    )


def _worker(rank: int, world_size: int, out_dir: str):
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml", OVERRIDES + [f"output_dir={out_dir}/r{rank}", "parallel.mode=dynamic"]
    )
    trainer = DistributedTrainer(cfg, dist.group.WORLD)
    use_empty_text(trainer)
    batches = trainer.data_iterator()
    losses = [trainer.train_step(next(batches))["loss"] for _ in range(STEPS)]
    batches.close()
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


def test_parameters_no_clip_used_are_skipped_like_in_one_process(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # cores shared with the spawned ranks; restored for the tests after
    try:
        cfg = load_config(ROOT / "configs" / "tiny.yaml", OVERRIDES + [f"output_dir={tmp_path}/ref"])
        ref = Trainer(cfg, device=torch.device("cpu"))
        use_empty_text(ref)
        sampler = GlobalBatchSampler(ref.train_indices, 1, cfg.data.seed)
        clips = [ref.prepare([ref.train_set[i] for i in sampler.batch(k)], k) for k in range(STEPS)]
        assert any(c.text.shape[0] == 0 for step in clips for c in step), "the case needs an empty caption"
        losses = [ref.train_step(step)["loss"] for step in clips]
        for got_losses, got_params in run_gloo(_worker, 2, str(tmp_path)):
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got_losses, losses)), (got_losses, losses)
            for p, q in zip(got_params, ref.model.parameters()):
                torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(threads)
