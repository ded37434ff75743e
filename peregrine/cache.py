"""The caches both decode paths read and write.

Layouts (the kernels index these directly; change them only with the kernels):
  MLA latent cache  latent[m, block, offset, :]  [n_mla, num_blocks, block_size, kv_lora + rope]
                    model dtype (BF16/FP32) or float8_e4m3fn; with FP8 a per-token
                    FP32 scale scale[m, block, offset] (value = fp8 * scale).
                    A sequence's token t lives at block_table[t // block_size], offset t % block_size.
  KDA recurrent     state[k, slot, h, K, V]  FP32  (o = Sᵀq: row index = key channel)
  KDA conv          conv[k, slot, j, c]      model dtype, j = 0..conv_size-2 oldest first,
                    c over the concatenated q|k|v channels (3·H·d).
  KDA snapshots     snap_state[k, n, ...], snap_conv[k, n, ...]: copies of a slot's state and conv
                    window at a block end, for prefix caching (peregrine/prefix_cache.py).
m / k index the MLA / KDA layers in model order (ModelConfig.mla_layers / kda_layers).
"""
from __future__ import annotations

import torch

from .config import ModelConfig

FP8_MAX = 448.0        # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # keeps an all-zero entry from dividing by zero


class CacheFull(Exception):
    """Not enough free blocks or slots right now; the scheduler keeps the request waiting."""


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation: returns (fp8 values, FP32 scale per row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFull(f"need {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class ModelCache:
    def __init__(self, cfg: ModelConfig, *, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device, kv_cache_dtype: str = "auto", num_snapshots: int = 0):
        self.cfg, self.block_size, self.num_blocks, self.num_slots = cfg, block_size, num_blocks, num_slots
        self.fp8 = kv_cache_dtype == "fp8"
        lat_dtype = torch.float8_e4m3fn if self.fp8 else (torch.bfloat16 if kv_cache_dtype == "bf16" else dtype)
        n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
        # one extra block and slot past the allocatable ones: scratch for graph warm-up/capture
        self.scratch_block, self.scratch_slot = num_blocks, num_slots
        num_blocks, num_slots = num_blocks + 1, num_slots + 1
        self.latent = torch.zeros(n_mla, num_blocks, block_size, cfg.latent_dim, dtype=lat_dtype, device=device)
        self.scale = (torch.ones(n_mla, num_blocks, block_size, dtype=torch.float32, device=device)
                      if self.fp8 else None)
        H, d = cfg.kda_num_heads, cfg.kda_head_dim
        self.state = torch.zeros(n_kda, num_slots, H, d, d, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_kda, num_slots, cfg.kda_conv_size - 1, 3 * H * d, dtype=dtype, device=device)
        self.num_snapshots = num_snapshots
        self.snap_state = torch.zeros(n_kda, num_snapshots, H, d, d, dtype=torch.float32, device=device)
        self.snap_conv = torch.zeros(n_kda, num_snapshots, cfg.kda_conv_size - 1, 3 * H * d, dtype=dtype, device=device)
        self.blocks = BlockAllocator(self.num_blocks)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.mla_index = {layer: i for i, layer in enumerate(cfg.mla_layers)}
        self.kda_index = {layer: i for i, layer in enumerate(cfg.kda_layers)}

    # ---- sizes ----
    @staticmethod
    def bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype) -> int:
        per = cfg.latent_dim + 4 if kv_cache_dtype == "fp8" else cfg.latent_dim * (2 if kv_cache_dtype == "bf16" else dtype.itemsize)
        return per * len(cfg.mla_layers)

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        H, d = cfg.kda_num_heads, cfg.kda_head_dim
        return len(cfg.kda_layers) * (H * d * d * 4 + (cfg.kda_conv_size - 1) * 3 * H * d * dtype.itemsize)

    def nbytes(self) -> int:
        t = [self.latent, self.state, self.conv, self.snap_state, self.snap_conv] + ([self.scale] if self.scale is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    # ---- slots ----
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise CacheFull("no free KDA state slot")
        s = self._free_slots.pop()
        self.state[:, s].zero_()  # a new sequence starts from the zero state
        self.conv[:, s].zero_()
        return s

    def free_slot(self, s: int) -> None:
        self._free_slots.append(s)

    # ---- prefix-cache snapshots ----
    def apply(self, ops: list[tuple[str, int, int]]) -> None:
        """("save", slot, snap): snapshot := the slot's state and conv window (every KDA layer);
        ("load", snap, slot): the slot := the snapshot. In stream order with the steps around them."""
        for kind, a, b in ops:
            if kind == "save":
                self.snap_state[:, b] = self.state[:, a]
                self.snap_conv[:, b] = self.conv[:, a]
            elif kind == "load":
                self.state[:, b] = self.snap_state[:, a]
                self.conv[:, b] = self.snap_conv[:, a]
            else:
                raise ValueError(f"unknown cache op {kind!r}")

    def save_checkpoint(self, ckpt, row: int, position: int, snap: int) -> None:
        """Snapshot snap := a verify step's state and conv window of step row `row` after `position` (restore_kda's
        checkpoint layout): a block end passed inside the step. One rank only (speculation runs without TP)."""
        self.snap_state[:, snap] = ckpt[0][:, row, position]
        self.snap_conv[:, snap] = ckpt[1][:, row, position]

    # ---- speculative rollback ----
    def restore_kda(self, slots: list[int], ckpt, rows: list[int], positions: list[int]) -> None:
        """Every KDA layer's state and conv window of slots[j] := the checkpoint of step row rows[j]
        after verify position positions[j]; ckpt = (state [n_kda, R, T, H, K, V], conv [n_kda, R, T, W-1, C])."""
        dev = self.state.device
        s, r, p = (torch.tensor(x, dtype=torch.long, device=dev) for x in (slots, rows, positions))
        self.state[:, s] = ckpt[0][:, r, p]
        self.conv[:, s] = ckpt[1][:, r, p]

    def clear_latent(self, flat_positions: list[int]) -> None:
        """Zero the MLA entries at these flat positions in every layer (rejected draft tokens)."""
        idx = torch.tensor(flat_positions, dtype=torch.long, device=self.latent.device)
        self.latent.view(self.latent.shape[0], -1, self.cfg.latent_dim)[:, idx] = 0
        if self.scale is not None:
            self.scale.view(self.scale.shape[0], -1)[:, idx] = 1.0

    # ---- MLA entries ----
    def write_latent(self, layer: int, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
        """Store [N, latent_dim] entries at flat positions block*block_size + offset."""
        m = self.mla_index[layer]
        flat = self.latent[m].view(-1, self.cfg.latent_dim)
        if self.fp8:
            q, s = quantize_fp8(entries)
            flat[slot_mapping] = q
            self.scale[m].view(-1)[slot_mapping] = s
        else:
            flat[slot_mapping] = entries.to(flat.dtype)

    def gather_latent(self, layer: int, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` entries of one sequence, dequantised: [length, latent_dim] float32."""
        m = self.mla_index[layer]
        nb = (length + self.block_size - 1) // self.block_size
        blocks = block_table[:nb]
        x = self.latent[m, blocks].reshape(-1, self.cfg.latent_dim)[:length].float()
        if self.fp8:
            x = x * self.scale[m, blocks].reshape(-1)[:length, None]
        return x

    def gather_latent_batch(self, layer: int, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
        """[S, max_len, latent_dim] float32 for S sequences (entries past a sequence's length are junk)."""
        m = self.mla_index[layer]
        nb = (max_len + self.block_size - 1) // self.block_size
        blocks = block_tables[:, :nb]
        S = blocks.shape[0]
        x = self.latent[m, blocks].reshape(S, -1, self.cfg.latent_dim)[:, :max_len].float()
        if self.fp8:
            x = x * self.scale[m, blocks].reshape(S, -1)[:, :max_len, None]
        return x
