import pytest
import torch

from dit.packing import check_divisible, grid_positions, pack, patchify, unpack, unpatchify


@pytest.mark.parametrize(
    "shape,patch",
    [
        ((3, 5, 6, 10), (1, 2, 2)),
        ((4, 6, 9, 3), (2, 3, 1)),
        ((1, 1, 4, 4), (1, 4, 4)),
        ((5, 7, 2, 2), (7, 1, 2)),
    ],
)
def test_patchify_round_trip_odd_shapes(shape, patch):
    x = torch.randn(shape)
    tokens = patchify(x, patch)
    c, f, h, w = shape
    assert tokens.shape == (
        (f // patch[0]) * (h // patch[1]) * (w // patch[2]),
        c * patch[0] * patch[1] * patch[2],
    )
    grid = (f // patch[0], h // patch[1], w // patch[2])
    assert torch.equal(unpatchify(tokens, grid, patch), x)


def test_patch_layout_is_channels_last_within_a_patch():
    x = torch.arange(2 * 1 * 2 * 2, dtype=torch.float32).reshape(2, 1, 2, 2)
    # one patch of (pt=1, ph=2, pw=2) over 2 channels: values ordered (ph, pw, c)
    assert patchify(x, (1, 2, 2)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_pack_unpack_mixed_shapes_and_positions():
    clips = [torch.randn(3, 5, 6, 10), torch.randn(3, 1, 4, 4), torch.randn(3, 3, 2, 8)]
    packed = pack(clips, (1, 2, 2))
    assert packed.seq_lens.tolist() == [75, 4, 12]
    assert packed.tokens.shape[0] == packed.positions.shape[0] == 91
    for clip, back in zip(clips, unpack(packed, packed.tokens, (1, 2, 2))):
        assert torch.equal(clip, back)
    # positions restart at 0 for each clip and follow (t, h, w) row-major order
    first, second = packed.split(packed.positions)[:2]
    assert first[0].tolist() == [0, 0, 0] and first[-1].tolist() == [4, 2, 4]
    assert second.tolist() == grid_positions((1, 2, 2)).tolist()


def test_indivisible_shape_error_names_axis_and_fix():
    with pytest.raises(ValueError, match="height=7 is not divisible by the patch size 2"):
        check_divisible((5, 7, 8), (1, 2, 2))
    with pytest.raises(ValueError, match="empty"):
        pack([], (1, 2, 2))


def test_local_seq_lens_counts_each_clips_tokens_inside_a_range():
    """What a CP shard [start, end) holds of each clip: partial clips at both ends, empty clips, zeros."""
    from dit.packing import local_seq_lens

    lens = [3, 0, 5, 2]  # clips at [0, 3), [3, 3), [3, 8), [8, 10)
    assert local_seq_lens(lens, 2, 9).tolist() == [1, 0, 5, 1]
    assert local_seq_lens(torch.tensor(lens), 0, 10).tolist() == lens
    assert local_seq_lens(lens, 4, 4).tolist() == [0, 0, 0, 0]
    assert local_seq_lens(lens, 8, 10).tolist() == [0, 0, 0, 2]


def test_interleave_index_makes_each_clips_parts_contiguous():
    """Parts packed clip by clip, concatenated part-major, become one segment per clip; empty runs too."""
    from dit.packing import interleave_index, inverse_index

    lens = torch.tensor([[2, 0, 1], [1, 3, 0]])  # part 0: clips of 2, 0, 1 rows; part 1: 1, 3, 0
    rows = torch.cat([torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22, 23])])  # 1x: part 0, 2x: part 1
    index = interleave_index(lens)
    assert rows[index].tolist() == [10, 11, 20, 21, 22, 23, 12]
    assert torch.equal(rows[index][inverse_index(index)], rows)
    assert interleave_index(torch.zeros(2, 3, dtype=torch.long)).tolist() == []
