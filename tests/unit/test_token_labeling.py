"""Token labeling: dense targets, the loss and MixToken against the reference formulas, and the
auxiliary head of the ViT family."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from torchvision.ops import roi_align

from tests.conftest import make_config
from vitrain.config import ConfigError, DatasetInfo, Hardware, resolve
from vitrain.models import VOLO, VOLOArgs, build_model, model_facts
from vitrain.models.flops import model_flops
from vitrain.models.timm_weights import inferred_model_args, to_timm
from vitrain.token_labeling import (
    TokenBox,
    apply_mix_token,
    dense_targets,
    draw_token_box,
    mix_tokens,
    token_labeling_loss,
    unmix_tokens,
)

DATA = DatasetInfo(num_train=600, num_eval=100, num_classes=10, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3)
CPU = Hardware(cuda_available=False, bf16_supported=False)


# --- the reference's formulas, written out (tlt/data/mixup.py, tlt/loss/cross_entropy.py) ----------


def reference_dense_targets(label_maps, coords, label_size, num_classes, smoothing=0.0):
    """``get_labelmaps_with_coords`` without its ground-truth column: per-sample scatter, RoIAlign with
    default arguments on ``coords * W - 0.5``, class cell first, softmax over dim 1, label smoothing."""
    batch = label_maps.shape[0]
    full = torch.zeros(batch, num_classes, *label_maps.shape[-2:])
    for sample_map, sample_topk in zip(full, label_maps, strict=True):
        sample_map.scatter_(0, sample_topk[1].long(), sample_topk[0].float())
    rois = torch.cat([torch.arange(batch).view(batch, 1).float(), coords.float() * full.size(3) - 0.5], 1)
    target = roi_align(input=full, boxes=rois, output_size=(label_size, label_size))
    cls = roi_align(input=full, boxes=rois, output_size=(1, 1))
    target = torch.cat([cls.view(batch, num_classes, 1), target.view(batch, num_classes, -1)], dim=2)
    target = torch.nn.functional.softmax(target, 1)
    off_value = smoothing / num_classes
    return target * (1.0 - smoothing + off_value) + off_value


def reference_loss(output, aux_output, box, target, dense_weight, cls_weight):
    """``TokenLabelCrossEntropy.forward`` with ``target`` laid out (B, C, 2 + N): ground truth, class, tokens."""
    bbx1, bby1, bbx2, bby2 = box
    batch, tokens, classes = aux_output.shape
    target_cls = target[:, :, 1]
    target_aux = target[:, :, 2:].transpose(1, 2).reshape(-1, classes)
    lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / tokens)
    if lam < 1:
        target_cls = lam * target_cls + (1 - lam) * target_cls.flip(0)

    def soft_ce(x, t):
        return torch.sum(-t * F.log_softmax(x, dim=-1), dim=-1).mean()

    return cls_weight * soft_ce(output, target_cls) + dense_weight * soft_ce(
        aux_output.reshape(-1, classes), target_aux
    )


def reference_rand_bbox(grid_hw, lam, rng):
    """LV-ViT's / timm VOLO's ``rand_bbox`` on a (B, H, W, C) grid with its ``np.random`` calls on ``rng``."""
    rows, cols = grid_hw
    cut_rat = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(rows * cut_rat), int(cols * cut_rat)
    cx, cy = rng.integers(rows), rng.integers(cols)
    return (
        np.clip(cx - cut_w // 2, 0, rows),
        np.clip(cy - cut_h // 2, 0, cols),
        np.clip(cx + cut_w // 2, 0, rows),
        np.clip(cy + cut_h // 2, 0, cols),
    )


def random_label_maps(batch, classes, k, height, width, generator):
    scores = torch.rand(batch, k, height, width, generator=generator) * 6 - 2
    indices = torch.stack(
        [torch.randperm(classes, generator=generator)[:k] for _ in range(batch * height * width)]
    ).reshape(batch, height, width, k)
    return torch.stack([scores, indices.permute(0, 3, 1, 2).float()], dim=1)


# --- dense targets ------------------------------------------------------------------------------


def _two_by_two_map():
    """k=2 of 4 classes on a 2x2 map; returns the label maps and the scattered (4, 2, 2) map."""
    scores = torch.tensor([[[3.0, 1.0], [0.5, 2.0]], [[1.0, 0.5], [0.25, 1.5]]])  # (k, H, W)
    indices = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]]).float()
    full = torch.zeros(4, 2, 2)
    for rank in range(2):
        for row in range(2):
            for col in range(2):
                full[int(indices[rank, row, col]), row, col] = scores[rank, row, col]
    return torch.stack([scores, indices])[None], full


def test_dense_targets_hand_case_full_box_border_box_and_flip():
    label_maps, full = _two_by_two_map()
    whole = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    targets = dense_targets(label_maps, whole, grid_size=2, num_classes=4)
    assert targets.shape == (1, 4, 5)
    # the whole map on one cell: the mean of the four pixels (two samples per axis at the pixel centres)
    assert torch.allclose(targets[0, :, 0], full.mean(dim=(1, 2)).softmax(0), atol=1e-6)
    # the whole map on a 2x2 grid: each token reads its own pixel, row-major; absent classes count as 0
    assert torch.allclose(targets[0, :, 1:], full.flatten(1).softmax(0), atol=1e-6)
    assert full[3, 0, 0] == 0 and targets[0, 3, 1] == pytest.approx(1 / full[:, 0, 0].exp().sum().item())
    flipped = dense_targets(label_maps, whole, grid_size=2, num_classes=4, flips=torch.tensor([True]))
    assert torch.allclose(flipped[0, :, 1:], full.flip(-1).flatten(1).softmax(0), atol=1e-6)
    assert torch.allclose(flipped[0, :, 0], targets[0, :, 0])
    # the top-right quarter (x from 0.5, y up to 0.5) on a 1x1 grid: pixel (row 0, column 1) alone
    corner = dense_targets(label_maps, torch.tensor([[0.5, 0.0, 1.0, 0.5]]), grid_size=1, num_classes=4)
    assert corner.shape == (1, 4, 2)
    assert torch.allclose(corner[0, :, 0], full[:, 0, 1].softmax(0), atol=1e-6)
    assert torch.allclose(corner[0, :, 1], corner[0, :, 0])


def test_dense_target_boxes_are_x_then_y():
    """Class 0 scores on the left half of a 4x4 map, class 1 on the bottom half: a box over the left half
    (x up to 0.5) reads class 0 alone in its top cells."""
    scores = torch.zeros(2, 4, 4)
    scores[0, :, :2] = 5.0
    scores[1, 2:, :] = 5.0
    indices = torch.stack([torch.zeros(4, 4), torch.ones(4, 4)])
    label_maps = torch.stack([scores, indices])[None]
    left = dense_targets(label_maps, torch.tensor([[0.0, 0.0, 0.5, 1.0]]), (4, 2), num_classes=3)
    grid = left[0, :, 1:].unflatten(1, (4, 2))
    assert (grid[0, :2] > 0.9).all() and (grid[1, :2] < 0.01).all()  # rows 0-1: class 0 only
    assert (grid[1, 2:] > 0.4).all()  # rows 2-3: class 1 as strong as class 0


@pytest.mark.parametrize(("grid", "smoothing"), [(1, 0.0), (3, 0.0), (4, 0.1)])
def test_dense_targets_equal_the_reference_formula_on_random_maps(grid, smoothing):
    generator = torch.Generator().manual_seed(grid)
    label_maps = random_label_maps(4, 10, 3, 6, 6, generator)
    corner = torch.rand(4, 2, generator=generator) * 0.6
    size = torch.rand(4, 2, generator=generator) * (1 - corner).clamp(max=0.4) + 0.05
    boxes = torch.cat([corner, corner + size], dim=1)
    ours = dense_targets(label_maps, boxes, grid, 10, smoothing=smoothing)
    assert torch.allclose(ours, reference_dense_targets(label_maps, boxes, grid, 10, smoothing), atol=1e-6)
    flips = torch.tensor([True, False, True, False])
    flipped = dense_targets(label_maps, boxes, grid, 10, flips=flips, smoothing=smoothing)
    by_hand = ours[:, :, 1:].unflatten(2, (grid, grid))
    by_hand = torch.where(flips.view(-1, 1, 1, 1), by_hand.flip(-1), by_hand)
    assert torch.allclose(flipped[:, :, 1:], by_hand.flatten(2)) and torch.equal(flipped[:, :, 0], ours[:, :, 0])


def test_dense_targets_take_a_non_square_grid_and_refuse_bad_shapes():
    generator = torch.Generator().manual_seed(0)
    label_maps = random_label_maps(2, 5, 2, 4, 4, generator)
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.25, 0.0, 0.75, 0.5]])
    targets = dense_targets(label_maps, boxes, (2, 3), 5)
    assert targets.shape == (2, 5, 7)
    assert torch.allclose(targets.sum(dim=1), torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"boxes must be \(B, 4\)"):
        dense_targets(label_maps, boxes[:1], 2, 5)
    with pytest.raises(ValueError, match=r"\(B, 2, k, H, W\)"):
        dense_targets(label_maps[:, :1], boxes, 2, 5)


# --- the loss -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("box", "dense_weight", "cls_weight"), [((0, 0, 0, 0), 0.5, 1.0), ((1, 0, 3, 2), 1.0, 0.5)])
def test_loss_equals_the_reference_formula_on_random_tensors(box, dense_weight, cls_weight):
    generator = torch.Generator().manual_seed(sum(box))
    batch, tokens, classes = 4, 9, 7
    cls_logits = torch.randn(batch, classes, generator=generator)
    aux_logits = torch.randn(batch, tokens, classes, generator=generator)
    target = torch.rand(batch, classes, 2 + tokens, generator=generator).softmax(dim=1)
    lam = 1 - (box[2] - box[0]) * (box[3] - box[1]) / tokens
    ours = token_labeling_loss(
        cls_logits, aux_logits, target[:, :, 1], target[:, :, 2:], lam, dense_weight=dense_weight, cls_weight=cls_weight
    )
    expected = reference_loss(cls_logits, aux_logits, box, target, dense_weight, cls_weight)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)


def test_loss_hand_cases():
    # uniform logits: every soft cross-entropy is log C, whatever the targets
    target = torch.rand(2, 3, 4).softmax(dim=1)
    uniform = token_labeling_loss(torch.zeros(2, 3), torch.zeros(2, 4, 3), target[:, :, 0], target, lam=1.0)
    assert uniform.item() == pytest.approx(1.5 * math.log(3))
    # lam = 0.75: image 0 (one-hot class 0) learns 0.75 / 0.25, its logits predict exactly that
    cls_logits = torch.tensor([[math.log(3), 0.0], [0.0, math.log(3)]])
    one_hot = torch.eye(2)
    aux_logits, aux_target = torch.zeros(2, 1, 2), torch.full((2, 2, 1), 0.5)
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    mixed = token_labeling_loss(cls_logits, aux_logits, one_hot, aux_target, lam=0.75, dense_weight=0.0)
    assert mixed.item() == pytest.approx(entropy)
    unmixed = token_labeling_loss(cls_logits, aux_logits, one_hot, aux_target, lam=1.0, dense_weight=0.0)
    assert unmixed.item() == pytest.approx(-math.log(0.75))
    dense_only = token_labeling_loss(
        cls_logits, aux_logits, one_hot, aux_target, lam=1.0, dense_weight=2.0, cls_weight=0
    )
    assert dense_only.item() == pytest.approx(2 * math.log(2))


# --- MixToken -----------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(14, 14), (7, 5), (2, 2)])
def test_token_box_is_the_reference_rand_bbox_and_lam_its_area(grid):
    for seed in range(20):
        box, lam = draw_token_box(grid, 1.0, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        drawn = rng.beta(1.0, 1.0)
        assert (box.top, box.left, box.bottom, box.right) == reference_rand_bbox(grid, drawn, rng)
        assert lam == pytest.approx(1 - box.area / (grid[0] * grid[1]))
        assert 0 <= box.top <= box.bottom <= grid[0] and 0 <= box.left <= box.right <= grid[1]
    for seed in range(5):  # a given lam: the generator draws only the centre
        box, lam = draw_token_box((8, 8), generator=np.random.default_rng(seed), lam=0.75)
        reference = reference_rand_bbox((8, 8), 0.75, np.random.default_rng(seed))
        assert (box.top, box.left, box.bottom, box.right) == reference and lam >= 0.75


def _tagged_tokens(batch, rows, cols):
    """Every token holds (image, row, column): where it came from is readable after any shuffle."""
    image, row, col = torch.meshgrid(torch.arange(batch), torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([image, row, col], dim=-1).float()


def test_mix_swaps_exactly_the_box_with_the_flipped_image_and_unmix_restores():
    batch, rows, cols = 4, 5, 6
    tokens = _tagged_tokens(batch, rows, cols)
    box = TokenBox(top=1, bottom=4, left=2, right=6)
    mixed = mix_tokens(tokens, box)
    inside = torch.zeros(rows, cols, dtype=torch.bool)
    inside[1:4, 2:6] = True
    for image in range(batch):
        assert torch.equal(mixed[image][inside], tokens[batch - 1 - image][inside])
        assert torch.equal(mixed[image][~inside], tokens[image][~inside])
    assert torch.equal(unmix_tokens(mixed, box), tokens)
    flat = mix_tokens(tokens.flatten(1, 2), box, grid_hw=(rows, cols))
    assert torch.equal(flat, mixed.flatten(1, 2))
    assert torch.equal(unmix_tokens(flat, box, (rows, cols)), tokens.flatten(1, 2))
    with pytest.raises(ValueError, match="need grid_hw"):
        mix_tokens(tokens.flatten(1, 2), box)


def _tiny_vit(**overrides):
    torch.manual_seed(0)
    args = {"depth": 2, "img_size": 32, "patch_size": 8, "num_classes": 5, "aux_head": True, **overrides}
    return build_model("vit_tiny_patch16", **args).eval()


def _mixed_by_hand(model, images, box):
    """The ViT forward with the patch embedding's output mixed by the reference's slicing."""
    tokens, grid = model.patch_embed(images)
    grid_tokens = tokens.unflatten(1, grid)
    mixed = grid_tokens.clone()
    mixed[:, box.top : box.bottom, box.left : box.right] = grid_tokens.flip(0)[
        :, box.top : box.bottom, box.left : box.right
    ]
    x = torch.cat([model.cls_token.expand(len(images), -1, -1), mixed.flatten(1, 2)], dim=1) + model.pos_embed
    return model.forward_head_with_tokens(model.norm(model.blocks(x, grid)))


def test_hook_mixes_the_box_in_a_vit_forward_and_does_nothing_without_one():
    model = _tiny_vit()
    images = torch.randn(4, 3, 32, 32)
    plain = model.forward_head_with_tokens(model.forward_features(images))
    box = TokenBox(top=1, bottom=3, left=0, right=2)
    with torch.no_grad():
        hook = apply_mix_token(model)
        unset = model.forward_head_with_tokens(model.forward_features(images))
        with hook.mixing(box, (4, 4)):
            mixed = model.forward_head_with_tokens(model.forward_features(images))
            unmixed_aux = hook.unmix(mixed[1])
        after = model(images)
        expected = _mixed_by_hand(model, images, box)
    assert all(torch.equal(a, b) for a, b in zip(unset, plain, strict=True))
    assert torch.allclose(mixed[0], expected[0], atol=1e-5) and torch.allclose(mixed[1], expected[1], atol=1e-5)
    assert not torch.allclose(mixed[0], plain[0], atol=1e-3)
    assert torch.equal(unmixed_aux, unmix_tokens(mixed[1], box, (4, 4)))
    assert torch.allclose(after, plain[0] + 0.5 * plain[1].amax(dim=1), atol=1e-6)
    with pytest.raises(ValueError, match="does not lie on the 4x4 token grid"):
        hook.set_box(TokenBox(0, 5, 0, 2), (4, 4))
    hook.remove()
    assert hook.box is None


def test_hook_under_compile_follows_each_new_box():
    model = _tiny_vit(head="gap")
    hook = apply_mix_token(model)
    compiled = torch.compile(model, backend="eager")
    images = torch.randn(4, 3, 32, 32)
    outputs = []
    for box in (TokenBox(0, 2, 0, 2), TokenBox(1, 4, 2, 4), None):
        with torch.no_grad(), hook.mixing(box, (4, 4)):
            expected = model(images)
            outputs.append(compiled(images))
            assert torch.allclose(outputs[-1], expected, atol=1e-5)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-4) and not torch.allclose(
        outputs[1], outputs[2], atol=1e-4
    )


def test_volo_mixes_its_stage_one_grid_at_twice_the_box():
    args = VOLOArgs(
        layers=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16), num_heads=(1, 2, 2, 2), stem_hidden_dim=4, img_size=32
    )
    model = VOLO(args).eval()
    hook = apply_mix_token(model)
    assert hook.scale == 2
    seen = []
    model.patch_embed.register_forward_hook(lambda module, inputs, output: seen.append(output))
    images = torch.randn(2, 3, 32, 32)
    box = TokenBox(top=0, bottom=1, left=1, right=2)  # on VOLO's final 2x2 grid
    with torch.no_grad():
        model(images)
        with hook.mixing(box, (2, 2)):
            model(images)
    raw, mixed = seen
    by_hand = raw.clone()
    by_hand[:, 0:2, 2:4] = raw.flip(0)[:, 0:2, 2:4]
    assert torch.equal(mixed, by_hand) and torch.equal(mixed, mix_tokens(raw, box, scale=2))
    with pytest.raises(ValueError, match="does not fit"), torch.no_grad(), hook.mixing(box, (4, 4)):
        model(images)


# --- the auxiliary head -------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_aux_head_shapes_inference_rule_and_unchanged_class_path(head):
    model = _tiny_vit(head=head)
    without = build_model("vit_tiny_patch16", depth=2, img_size=32, patch_size=8, num_classes=5, head=head).eval()
    missing = without.load_state_dict(model.state_dict(), strict=False)
    assert missing.unexpected_keys == ["aux_head.weight", "aux_head.bias"]
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        cls_logits, aux_logits = model.forward_head_with_tokens(model.forward_features(images))
        assert cls_logits.shape == (3, 5) and aux_logits.shape == (3, 16, 5)
        assert torch.allclose(model(images), cls_logits + 0.5 * aux_logits.amax(dim=1), atol=1e-6)
        assert torch.allclose(cls_logits, without(images), atol=1e-6)
    dim = model.args.embed_dim
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in without.parameters()) == dim * 5 + 5
    assert model.layer_id("aux_head.weight") == model.num_layers + 1
    with pytest.raises(ValueError, match="no auxiliary head"):
        without.forward_head_with_tokens(without.forward_features(images))


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_aux_head_flops_match_the_measured_count(head):
    model = build_model("vit_tiny_patch16", device="meta", img_size=64, attn_impl="matmul", aux_head=True, head=head)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, 64, 64, device="meta"))
    measured = counter.get_total_flops()
    assert abs(model_flops(model, 64) - measured) <= 0.05 * measured
    plain = build_model("vit_tiny_patch16", device="meta", img_size=64, head=head)
    assert model_flops(model, 64) - model_flops(plain, 64) == 16 * 2 * 192 * 1000


def test_aux_head_config_maps_to_each_family_and_refuses_what_does_not_combine():
    plan = resolve(make_config("model.name=vit_tiny6_patch7", "model.aux_head=true"), DATA, CPU, model_facts)
    assert plan.model.options["aux_head"] is True
    volo = resolve(
        make_config("model.name=volo_d1", "data.image_size=32", "model.aux_head=false"), DATA, CPU, model_facts
    )
    assert volo.model.options["use_aux_head"] is False and "aux_head" not in volo.model.options
    assert build_model(volo.model.name, device="meta", **volo.model.arguments).aux_head is None
    with pytest.raises(ConfigError, match="model.aux_head=true with a distillation token"):
        resolve(
            make_config("model.name=deit_tiny_distilled_patch16", "data.image_size=32", "model.aux_head=true"),
            DATA,
            CPU,
            model_facts,
        )
    with pytest.raises(ConfigError, match="not an option of resnet50"):
        resolve(make_config("model.name=resnet50", "data.image_size=32", "model.aux_head=true"), DATA, CPU, model_facts)
    with pytest.raises(ValueError, match="does not combine"):
        build_model("deit_tiny_distilled_patch16", device="meta", aux_head=True)
    with pytest.raises(ValueError, match="no token-labeling head"):
        to_timm(_tiny_vit())


def test_the_aux_head_is_read_from_weights():
    with_head = build_model("vit_tiny_patch16", device="meta", aux_head=True).state_dict()
    assert inferred_model_args(with_head, "vit_tiny_patch16")["aux_head"] is True
    without = build_model("volo_d1", device="meta", use_aux_head=False).state_dict()
    assert inferred_model_args(without, "volo_d1")["use_aux_head"] is False


@pytest.mark.parametrize("name", ["localvit_tiny6_convstem_patch8", "vit_tiny6_patch7", "volo_d1", "resnet50"])
def test_input_channels_are_read_from_the_first_layer(name):
    """The default model's convolutional stem too: its patch projection is not its first layer."""
    options = {"img_size": 32 if name != "vit_tiny6_patch7" else 28} if name != "resnet50" else {}
    weights = build_model(name, device="meta", in_chans=1, num_classes=10, **options).state_dict()
    assert inferred_model_args(weights, name)["in_chans"] == 1
