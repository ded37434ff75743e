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
IDS_FROM_GREEDY = 2  # flag bit: decode lookahead, the input ids are each rank's last on-device argmax
                     # (the gathered argmax: the same ids on every rank), the payload's are placeholders


def _bcast(tp, t: torch.Tensor) -> None:
    dist.broadcast(t, src=0, group=tp.ctrl)


def send_step(tp, step: StepInput, flags: int = 0) -> None:
    N, S = step.input_ids.shape[0], step.num_seqs
    MB = step.block_tables.shape[1]
    host = step.host
    if step.ids_from_greedy:
        flags |= IDS_FROM_GREEDY
    elif host is None:  # a step not made by build(): one device-to-host copy
        host = torch.cat([step.input_ids, step.positions, step.slot_mapping, step.kda_slots,
                          step.context_lens_t.long(), step.block_tables.flatten()]).cpu()
    payload = torch.cat([torch.tensor(step.q_lens, dtype=torch.long), host])
    _bcast(tp, torch.tensor([STEP, N, S, MB, step.max_context, flags, payload.numel(), 0], dtype=torch.long))
    _bcast(tp, payload)


def send_obj(tp, obj) -> None:
    _bcast(tp, torch.tensor([OBJ] + [0] * (HEADER - 1), dtype=torch.long))
    dist.broadcast_object_list([obj], src=0, group=tp.ctrl)


def recv(tp, device, greedy=None) -> tuple[str, object]:
    """-> ("step", (StepInput, flags)) or ("obj", object). greedy: this rank's last on-device argmax,
    the input ids of an IDS_FROM_GREEDY step."""
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
    if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the steps still running
        host = host.pin_memory()
    d = host.to(device, non_blocking=True)
    ids = d[:N]
    if flags & IDS_FROM_GREEDY:
        if greedy is None or greedy.shape[0] != N:
            raise RuntimeError(f"rank {tp.rank}: a lookahead step of {N} ids without this rank's argmax of the last step")
        ids = greedy
    step = StepInput(ids, d[N:2 * N], d[2 * N:3 * N], q_lens, ctx, d[3 * N:3 * N + S],
                     d[3 * N + 2 * S:].view(S, MB), d[3 * N + S:3 * N + 2 * S].to(torch.int32), max_context, host,
                     ids_from_greedy=bool(flags & IDS_FROM_GREEDY))
    return "step", (step, flags)


def new_sequences(step: StepInput) -> list[int]:
    """KDA slots of sequences that start in this step (position 0): they begin from the zero state."""
    N, S = step.input_ids.shape[0], step.num_seqs
    slots = step.host[3 * N:3 * N + S].tolist()
    return [s for s, q, c in zip(slots, step.q_lens, step.context_lens) if q == c]
