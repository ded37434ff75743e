"""StepInput: what one forward step needs, built by the scheduler, read by both runners.

Tokens of all scheduled sequences are flattened: sequence i contributes q_lens[i]
new tokens (a prefill chunk, or 1 in decode), at positions
context_lens[i] - q_lens[i] ... context_lens[i] - 1.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

LOOP_TOKENS = 256  # rows up to this long build their positions in Python; longer ones with tensor ops


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small CPU tensor on the device through pinned memory, without blocking: a pageable host-to-device
    copy makes the host wait for every kernel already queued, so it could no longer run ahead of the GPU."""
    return host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)


def _long(xs: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of a list of ints through array.array, several times faster than torch.tensor on a
    long list: a cold 32K prompt's step pays this conversion on the host before its first kernel."""
    return torch.frombuffer(array.array("q", xs), dtype=torch.long) if xs else torch.empty(0, dtype=torch.long)


@dataclass
class StepInput:
    input_ids: torch.Tensor      # [N] long, new tokens of every sequence back to back
    positions: torch.Tensor      # [N] long
    slot_mapping: torch.Tensor   # [N] long, flat MLA cache position (block * block_size + offset)
    q_lens: list[int]            # [S] new tokens per sequence
    context_lens: list[int]      # [S] tokens in the cache after this step
    kda_slots: torch.Tensor      # [S] long, KDA state slot of each sequence
    block_tables: torch.Tensor   # [S, max_blocks] long, padded with 0
    context_lens_t: torch.Tensor  # [S] int32 on device (for kernels)
    max_context: int = 0         # bound on context_lens read by decode attention (graphs fix it per capture)
    host: torch.Tensor | None = None  # the CPU int64 tensor build() copied to the device (sent to other TP ranks)
    ids_from_greedy: bool = False  # decode lookahead: input_ids are the runner's last on-device argmax (host: placeholders)
    # speculative verify steps (peregrine/spec): which tokens need logits (default: each sequence's last),
    # T when every sequence verifies T tokens (the specialized path serves only those), and the buffers
    # where KDA layers write the state after each position: (state [n_kda, R, Tmax, H, K, V],
    # conv [n_kda, R, Tmax, W-1, C]), R indexing the step's sequences
    logits_idx: torch.Tensor | None = None
    spec_tokens: int = 0
    kda_ckpt: tuple | None = None
    # prefix caching: {row: [(offset, snapshot)]} KDA state snapshots the KDA layers take inside a prefill
    # row, after its first `offset` new tokens (a chunk's own end is copied by the engine after the step)
    kda_snapshots: dict | None = None
    # sampling inside the step (#41): (temperature f32, top_k i32, top_p f32, min_p f32, seed i64), [S] each on the
    # device, for a pure decode step whose rows all sample on the device; the runner's tokens are then drawn by
    # kernels/sampling.sample with key (seed, context_lens: the new token's index) instead of the argmax
    sampling: tuple | None = None
    # whether some row of .sampling uses top-k (host-known): without, the sampler skips top-k's descent levels
    # and the step replays a graph captured without them
    sample_top_k: bool = False
    # logprobs inside the step (#41): the runner also returns each row's chosen-token logprob and the top
    # LOGPROBS_TOP (token id, logprob) of the raw logits, read back with the tokens
    logprobs: bool = False
    # penalties inside the step (#41): (counts, seen, slots, repetition, frequency, presence, ban ids, ban until)
    # from engine/penalties.DevicePenalties; the runner applies them (apply_device) before drawing
    penalties: tuple | None = None
    # structured output / logit_bias inside the step (#66, engine/guided.py): each row's token bitmask [S, V/32] int32
    # (every bit set for an unconstrained row) and (bias ids [S, n] int64, values [S, n] FP32), applied before drawing
    logit_mask: torch.Tensor | None = None
    logit_bias: tuple | None = None
    # the step returns its logits undrawn: the engine fills the grammar masks on the host while the forward runs and
    # then draws (decode/head.py draw) itself, so the fill hides behind the step instead of preceding it
    defer_draw: bool = False

    def decode_rows(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Rows of a mixed step that add one token: (rows, their token index in the flat list, the
        same rows as an index), on the device, made once per step and shared by every layer (copied
        without blocking: _to_device)."""
        if getattr(self, "_decode_rows", None) is None:
            rows = [i for i, q in enumerate(self.q_lens) if q == 1]
            offs = [0]
            for q in self.q_lens:
                offs.append(offs[-1] + q)
            t = _to_device(torch.tensor([offs[i] for i in rows] + rows, dtype=torch.long), self.input_ids.device)
            self._decode_rows = (rows, t[:len(rows)], t[len(rows):])
        return self._decode_rows

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the specialized path may serve it."""
        return all(q == 1 for q in self.q_lens)

    @property
    def logits_indices(self) -> torch.Tensor:
        """Index of each sequence's last new token in the flat token list (or the verify step's choice), made
        once per step. Copied without blocking (_to_device): it is needed after the last layer is queued, and
        a blocking copy there made the host wait for the whole forward before the engine's bookkeeping after
        it (the GPU idle ~4 ms at the end of a cold 32K prompt's step)."""
        if self.logits_idx is not None:
            return self.logits_idx
        if getattr(self, "_last_rows", None) is None:
            idx, acc = [], 0
            for q in self.q_lens:
                acc += q
                idx.append(acc - 1)
            self._last_rows = _to_device(torch.tensor(idx, dtype=torch.long), self.input_ids.device)
        return self._last_rows

    @staticmethod
    def build(seqs: list[tuple[list[int], int, int, list[int]]], block_size: int, device,
              non_blocking: bool = False) -> "StepInput":
        """seqs: (new_token_ids, start_position, kda_slot, block_table) per sequence.
        non_blocking: copy through pinned memory without waiting for the device (a blocking
        copy from pageable memory synchronises the stream: decode lookahead must not)."""
        ids, q_lens, ctx, kslots, tables = [], [], [], [], []
        pos_rows, slot_rows = [], []  # per row: a list (short rows) or a tensor (long prefill chunks)
        max_blocks = max(1, max(len(s[3]) for s in seqs))
        for toks, start, kslot, table in seqs:
            n = len(toks)
            if n == 0:
                raise ValueError("a scheduled sequence must add at least one token")
            need = (start + n + block_size - 1) // block_size
            if len(table) < need:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {start + n} tokens")
            ids.extend(toks)
            if n <= LOOP_TOKENS:
                r = range(start, start + n)
                pos_rows.append(list(r))
                slot_rows.append([table[p // block_size] * block_size + p % block_size for p in r])
            else:  # tensor ops instead of a Python loop per token: each block's slots, then the row's span of them
                b0 = start // block_size  # no per-token int64 // and % (slow on the host at 32K tokens)
                base = torch.tensor(table[b0:need], dtype=torch.long) * block_size
                pos_rows.append(torch.arange(start, start + n))
                off = start - b0 * block_size
                slot_rows.append((base[:, None] + torch.arange(block_size)).flatten()[off:off + n])
            q_lens.append(n)
            ctx.append(start + n)
            kslots.append(kslot)
            tables.extend(table)
            tables.extend([0] * (max_blocks - len(table)))
        # one host-to-device copy for every index tensor of the step
        N, S = len(ids), len(seqs)
        if all(isinstance(r, list) for r in pos_rows):
            flat_rows = [x for rs in (pos_rows, slot_rows) for r in rs for x in r]
            host = torch.tensor(ids + flat_rows + kslots + ctx + tables, dtype=torch.long)
        else:
            rows = lambda rs: [r if isinstance(r, torch.Tensor) else _long(r) for r in rs]  # noqa: E731
            host = torch.cat([_long(ids), *rows(pos_rows), *rows(slot_rows), _long(kslots + ctx + tables)])
        flat = _to_device(host, torch.device(device)) if non_blocking else host.to(device)
        a = flat[:N], flat[N:2 * N], flat[2 * N:3 * N]
        kst, ctt = flat[3 * N:3 * N + S], flat[3 * N + S:3 * N + 2 * S]
        bt = flat[3 * N + 2 * S:].view(S, max_blocks)
        return StepInput(a[0], a[1], a[2], q_lens, ctx, kst, bt, ctt.to(torch.int32), max(ctx), host)
