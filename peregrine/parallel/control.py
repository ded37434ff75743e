"""Rank 0's messages to the other ranks, over a CPU (gloo) group.

Every message is a fixed header tensor; a step carries its StepInput as the one
int64 tensor StepInput.build made (so no device round trip on rank 0), other
commands a pickled object. The other ranks rebuild the StepInput from it exactly
as build() lays it out.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..decode.batch import StepInput

HEADER = 8          # kind, N, S, max_blocks, max_context, flags, payload length, spare
STEP, OBJ = 1, 2    # message kinds
RECORD_ROUTING = 1  # flag bit: count routed experts this step (runs eagerly on every rank)


def _bcast(tp, t: torch.Tensor) -> None:
    dist.broadcast(t, src=0, group=tp.ctrl)


def send_step(tp, step: StepInput, flags: int = 0) -> None:
    N, S = step.input_ids.shape[0], step.num_seqs
    MB = step.block_tables.shape[1]
    host = step.host
    if host is None:  # a step not made by build(): one device-to-host copy
        host = torch.cat([step.input_ids, step.positions, step.slot_mapping, step.kda_slots,
                          step.context_lens_t.long(), step.block_tables.flatten()]).cpu()
    payload = torch.cat([torch.tensor(step.q_lens, dtype=torch.long), host])
    _bcast(tp, torch.tensor([STEP, N, S, MB, step.max_context, flags, payload.numel(), 0], dtype=torch.long))
    _bcast(tp, payload)


def send_obj(tp, obj) -> None:
    _bcast(tp, torch.tensor([OBJ] + [0] * (HEADER - 1), dtype=torch.long))
    dist.broadcast_object_list([obj], src=0, group=tp.ctrl)


def recv(tp, device) -> tuple[str, object]:
    """-> ("step", (StepInput, flags)) or ("obj", object)."""
    h = torch.empty(HEADER, dtype=torch.long)
    _bcast(tp, h)
    kind, N, S, MB, max_context, flags, n, _ = h.tolist()
    if kind == OBJ:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=tp.ctrl)
        return "obj", box[0]
    if kind != STEP:
        raise RuntimeError(f"rank {tp.rank}: unknown control message kind {kind}")
    payload = torch.empty(n, dtype=torch.long)
    _bcast(tp, payload)
    q_lens, host = payload[:S].tolist(), payload[S:]
    ctx = host[3 * N + S:3 * N + 2 * S].tolist()
    d = host.to(device)
    step = StepInput(d[:N], d[N:2 * N], d[2 * N:3 * N], q_lens, ctx, d[3 * N:3 * N + S],
                     d[3 * N + 2 * S:].view(S, MB), d[3 * N + S:3 * N + 2 * S].to(torch.int32), max_context, host)
    return "step", (step, flags)


def new_sequences(step: StepInput) -> list[int]:
    """KDA slots of sequences that start in this step (position 0): they begin from the zero state."""
    N, S = step.input_ids.shape[0], step.num_seqs
    slots = step.host[3 * N:3 * N + S].tolist()
    return [s for s, q, c in zip(slots, step.q_lens, step.context_lens) if q == c]
