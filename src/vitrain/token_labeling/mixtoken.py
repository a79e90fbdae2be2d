"""MixToken (Jiang et al. 2021, "All Tokens Matter", sec. 3.3): CutMix on the token grid.

After the patch embedding, a box of each image's tokens is replaced by the same box of its partner's,
the batch flipped (image ``B - 1 - i``). The class token then learns the mix ``lam * own + (1 - lam) *
partner`` (:func:`vitrain.token_labeling.token_labeling_loss`), and the auxiliary outputs are put back in
place (:func:`unmix_tokens`: the box swapped back) so that every output token lines up with its own
image's dense target; the targets themselves are never mixed. The box rule is the reference's
``rand_bbox`` (LV-ViT ``tlt/models/lvvit.py``; timm's ``volo.py``): ``lam ~ Beta(alpha, alpha)``, sides
``sqrt(1 - lam)`` of the grid's, centre uniform, ``cut // 2`` each side, clipped; then ``lam = 1 -
box area / grid area``. VOLO draws the box on its final (1/16) grid and mixes the stage-1 (1/8) grid
at twice the coordinates (timm's ``pooling_scale``).

The model stays plain: :class:`MixTokenHook` mixes from outside through a forward hook on the model's
patch embedding, active only while a box is set (``hook.set_box`` before a training forward, cleared
after); with no box it does nothing. The box reaches the forward as a boolean mask tensor on the
device, so a compiled model sees one graph for every box, and nothing waits on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

Grid = tuple[int, int]


class TokenBox(NamedTuple):
    """A box of the token grid: rows ``top:bottom``, columns ``left:right`` (the reference's
    ``bbx1:bbx2``, ``bby1:bby2``)."""

    top: int
    bottom: int
    left: int
    right: int

    @property
    def area(self) -> int:
        return max(self.bottom - self.top, 0) * max(self.right - self.left, 0)


def draw_token_box(
    grid_hw: Grid, alpha: float = 1.0, generator: np.random.Generator | None = None, *, lam: float | None = None
) -> tuple[TokenBox, float]:
    """A MixToken box on a ``(rows, cols)`` token grid and its ``lam = 1 - box area / grid area``.

    ``lam`` (the share of own tokens asked for) is drawn from ``Beta(alpha, alpha)`` unless given; the box
    has sides ``int(side * sqrt(1 - lam))``, a uniform centre and ``cut // 2`` cells on each side of it,
    clipped to the grid, so the returned ``lam`` is that of the box actually cut. Draws (lam, centre row,
    centre column) come from ``generator`` (a fresh unseeded one when None) on the host.
    """
    rows, cols = grid_hw
    rng = generator if generator is not None else np.random.default_rng()
    if lam is None:
        lam = float(rng.beta(alpha, alpha))
    cut_ratio = np.sqrt(1.0 - lam)
    cut_rows, cut_cols = int(rows * cut_ratio), int(cols * cut_ratio)
    centre_row, centre_col = int(rng.integers(rows)), int(rng.integers(cols))
    box = TokenBox(
        int(np.clip(centre_row - cut_rows // 2, 0, rows)),
        int(np.clip(centre_row + cut_rows // 2, 0, rows)),
        int(np.clip(centre_col - cut_cols // 2, 0, cols)),
        int(np.clip(centre_col + cut_cols // 2, 0, cols)),
    )
    return box, 1.0 - box.area / (rows * cols)


def token_box_mask(box: TokenBox, grid_hw: Grid, scale: int = 1, device: torch.device | str | None = None):
    """Bool ``(rows * scale, cols * scale)`` mask of ``box`` (drawn on the ``(rows, cols)`` grid) on the grid
    ``scale`` times finer; built on ``device`` without a host copy."""
    rows = torch.arange(grid_hw[0] * scale, device=device)
    cols = torch.arange(grid_hw[1] * scale, device=device)
    in_rows = (rows >= box.top * scale) & (rows < box.bottom * scale)
    in_cols = (cols >= box.left * scale) & (cols < box.right * scale)
    return in_rows[:, None] & in_cols[None, :]


def _swap_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Tokens under ``mask`` (a bool grid) taken from the batch-flipped partner; ``x`` is ``(B, H, W, C)``
    or ``(B, H*W, C)``."""
    if x.ndim == 4:
        if tuple(x.shape[1:3]) != tuple(mask.shape):
            raise ValueError(f"a {tuple(mask.shape)} box mask does not fit a {tuple(x.shape[1:3])} token grid")
        where = mask[None, :, :, None]
    elif x.ndim == 3:
        if x.shape[1] != mask.numel():
            raise ValueError(f"a {tuple(mask.shape)} box mask does not fit {x.shape[1]} tokens")
        where = mask.reshape(1, -1, 1)
    else:
        raise ValueError(f"tokens must be (B, H, W, C) or (B, N, C), got {tuple(x.shape)}")
    return torch.where(where, x.flip(0), x)


def _grid_of(x: torch.Tensor, grid_hw: Grid | None) -> Grid:
    if x.ndim == 4:
        return (x.shape[1], x.shape[2])
    if grid_hw is None:
        raise ValueError("(B, N, C) tokens need grid_hw, their (rows, cols) grid")
    return tuple(grid_hw)


def mix_tokens(x: torch.Tensor, box: TokenBox, scale: int = 1, grid_hw: Grid | None = None) -> torch.Tensor:
    """MixToken: each image's tokens in ``box`` replaced by its partner's (the batch flipped).

    ``x``: ``(B, H, W, C)`` or ``(B, N, C)`` with ``grid_hw = (H, W)``. ``box`` was drawn on the grid ``scale``
    times coarser than ``x``'s (VOLO: the final grid, ``x`` the stage-1 grid at ``scale=2``) and covers
    ``scale`` times its coordinates here. A new tensor; ``x`` is left as it is.
    """
    rows, cols = _grid_of(x, grid_hw)
    if rows % scale or cols % scale:
        raise ValueError(f"a {rows}x{cols} token grid is not divisible by the mixing scale {scale}")
    return _swap_masked(x, token_box_mask(box, (rows // scale, cols // scale), scale, x.device))


def unmix_tokens(aux: torch.Tensor, box: TokenBox, grid_hw: Grid | None = None) -> torch.Tensor:
    """The auxiliary outputs of a MixToken forward put back in their own images' order: the box swapped
    back with the batch-flipped partner (the same swap again), so output token ``(i, t)`` is the one
    computed from image ``i``'s token ``t`` and lines up with image ``i``'s own dense target.
    ``aux``: ``(B, N, C)`` with ``grid_hw`` (the grid the box was drawn on) or ``(B, H, W, C)``."""
    return mix_tokens(aux, box, 1, grid_hw)


def mix_token_scale(model: nn.Module) -> int:
    """How many times finer the patch embedding's grid is than the auxiliary head's: 1 for a ViT, the
    downsampling after VOLO's first stage (2 for every VOLO variant)."""
    from vitrain.models.vit import VisionTransformer
    from vitrain.models.volo import VOLO

    if isinstance(model, VOLO):
        return model.args.total_stride // model.args.patch_size
    if isinstance(model, VisionTransformer):
        return 1
    raise TypeError(f"MixToken needs a ViT-family model or VOLO (a patch embedding), got {type(model).__name__}")


class MixTokenHook:
    """MixToken from outside the model: a forward hook on ``model.patch_embed`` that mixes its output while a
    box is set. ``set_box(box, grid_hw)`` (the box drawn on the auxiliary grid ``grid_hw``) before a training
    forward, ``clear()`` after (or ``with hook.mixing(box, grid_hw):``); :meth:`unmix` puts the auxiliary
    outputs back. Install it on the plain model, before DDP/FSDP/compile wrap it."""

    def __init__(self, model: nn.Module):
        self.scale = mix_token_scale(model)
        self._embed = model.patch_embed
        self._mask: torch.Tensor | None = None
        self._aux_mask: torch.Tensor | None = None
        self.box: TokenBox | None = None
        self._handle = self._embed.register_forward_hook(self._hook)

    def set_box(self, box: TokenBox, grid_hw: Grid, device: torch.device | str | None = None) -> None:
        """Mix the next forwards with ``box``, drawn on the auxiliary grid ``grid_hw``; the masks are built on
        ``device`` (the patch embedding's when None)."""
        rows, cols = grid_hw
        if not (0 <= box.top <= box.bottom <= rows and 0 <= box.left <= box.right <= cols):
            raise ValueError(f"{box} does not lie on the {rows}x{cols} token grid it was said to be drawn on")
        if device is None:
            device = next(self._embed.parameters()).device
        self.box = box
        self._aux_mask = token_box_mask(box, grid_hw, 1, device)
        self._mask = token_box_mask(box, grid_hw, self.scale, device) if self.scale != 1 else self._aux_mask

    def clear(self) -> None:
        self.box, self._mask, self._aux_mask = None, None, None

    @contextlib.contextmanager
    def mixing(self, box: TokenBox | None, grid_hw: Grid) -> Iterator[MixTokenHook]:
        """Mix the forwards inside the block with ``box`` (None: no mixing)."""
        if box is not None:
            self.set_box(box, grid_hw)
        try:
            yield self
        finally:
            self.clear()

    def unmix(self, aux: torch.Tensor) -> torch.Tensor:
        """:func:`unmix_tokens` with the box set; ``aux`` unchanged when none is."""
        return aux if self._aux_mask is None else _swap_masked(aux, self._aux_mask)

    def remove(self) -> None:
        """Take the hook off the model."""
        self.clear()
        self._handle.remove()

    def _hook(self, module: nn.Module, inputs: tuple, output):
        if self._mask is None:
            return None
        if isinstance(output, tuple):  # ViT stems return (tokens, grid)
            tokens, grid = output
            return _swap_masked(tokens, self._mask), grid
        return _swap_masked(output, self._mask)


def apply_mix_token(model: nn.Module) -> MixTokenHook:
    """Install MixToken on ``model`` (in place): the returned hook mixes while a box is set."""
    return MixTokenHook(model)
