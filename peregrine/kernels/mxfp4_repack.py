"""MXFP4 expert weights repacked at load time for the v4 expert kernels (kernels/moe_mxfp4_v4.py).

torch only. The checkpoint layout (kernels/mxfp4_format.py) keeps a row's codes in element order, element 2j in
the low nibble of byte j, and its E8M0 scales beside them [R, C/32]. v4 decodes a 32-bit word (8 values) into four
BF16x2 registers, register j holding elements (2j, 2j+1), and stores them as one 16-byte shared-memory write; the
repack places each pair's two codes 16 bits apart so that register j's codes are one shift and one mask away:

    word bits 4j .. 4j+3   = element 2j     (j = 0..3; the low 16-bit half)
    word bits 16+4j .. +3  = element 2j + 1 (the high half)

A word is stored little-endian as 4 bytes, so codes stay [.., R, C/2] uint8 (same bytes per row, same row order).
Scales move to [.., C/32, R] (group-major): one tile's scales for a group are R contiguous bytes, which the
kernel copies 16 at a time instead of one byte per row. repack and unpack are exact inverses (tested).
"""
from __future__ import annotations

import torch

from . import mxfp4_format
from .mxfp4_format import GROUP, pack_codes, unpack_codes

VALUES_PER_WORD = 8  # E2M1 codes in one 32-bit word
# source element of each nibble slot of a repacked word: slot s (bits 4s..4s+3) holds element ORDER[s]
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def repack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint codes [..., C/2] uint8 (C % 8 == 0) -> v4 codes [..., C/2] uint8."""
    codes = unpack_codes(packed).unflatten(-1, (-1, VALUES_PER_WORD))  # [..., C/8, 8] element order
    return pack_codes(codes[..., list(ORDER)].flatten(-2))


def unpack_repacked_codes(repacked: torch.Tensor) -> torch.Tensor:
    """Inverse of repack_codes: v4 codes -> the checkpoint's bytes."""
    slots = unpack_codes(repacked).unflatten(-1, (-1, VALUES_PER_WORD))  # [..., C/8, 8] slot order
    inverse = [ORDER.index(i) for i in range(VALUES_PER_WORD)]
    return pack_codes(slots[..., inverse].flatten(-2))


def repack_scales(scale: torch.Tensor) -> torch.Tensor:
    """[..., R, C/32] -> [..., C/32, R] contiguous."""
    return scale.transpose(-1, -2).contiguous()


def unpack_repacked_scales(scale_t: torch.Tensor) -> torch.Tensor:
    return scale_t.transpose(-1, -2).contiguous()


def repack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., R, C/2], scales [..., R, C/32]) in the checkpoint layout -> the v4 layout."""
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    assert (packed.shape[-1] * 2) % VALUES_PER_WORD == 0 and scale.shape[-1] * GROUP == packed.shape[-1] * 2
    return repack_codes(packed), repack_scales(scale)


def unpack(codes: torch.Tensor, scale_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The v4 layout -> (codes, scales) exactly as the checkpoint stored them."""
    return unpack_repacked_codes(codes), unpack_repacked_scales(scale_t)


def dequantize(codes: torch.Tensor, scale_t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """mxfp4_format.dequantize over the v4 layout: [..., R, C/2] codes + [..., C/32, R] scales -> [..., R, C]."""
    return mxfp4_format.dequantize(unpack_repacked_codes(codes), scale_t.transpose(-1, -2), dtype)
