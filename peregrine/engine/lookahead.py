"""Decode lookahead: launch the next pure-decode step before reading this step's tokens back.

In steady greedy decode the next step needs nothing the host has to wait for: its input ids are
this step's argmax (runner.greedy_tokens, still on the device) and its positions, context lengths
and cache slots are this step's plus one. So the engine launches it first and only then waits for
this step's tokens; the host work between steps (stop checks, streaming, building the next input)
overlaps the GPU running the next step. Stop checks therefore run one step late: the token a
lookahead step made for a sequence that had already stopped (or was aborted) is dropped. It wrote
only past the sequence's end, inside the blocks and slot the sequence still owned at launch; the
stream runs it before any later owner's first write, and a reused KDA slot is zeroed on allocation.

A request with a grammar (structured output) keeps it too: the step ahead is launched with its draw deferred, and
its masks are filled, and its draw queued, once this step's tokens have reached the host and the grammars.

Replay (engine.forced, benchmarks only) keeps lookahead on one GPU: a forced row's next input is its recorded
token, copied over the device's token (forced_input); under tensor parallel, where every rank takes its own
argmax as the next input, forced rows run without lookahead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode.batch import StepInput, _to_device


@dataclass
class Ahead:
    """A forward launched one step early: the next step takes its results instead of running one."""
    batch: list            # (Sequence, 1) per row, in the order of the launched step
    logits: torch.Tensor
    greedy: torch.Tensor | None  # the runner's on-device tokens of that step (argmax, or draws with sampling)
    path: str
    device: tuple = (False, None)  # (drew its sampled rows / took logprobs on the device, the logprob tensors)
    deferred: object = None  # its StepInput when its draw waits for the grammar masks (StepInput.defer_draw)


class Readback:
    """Start copying device tokens to the host now, in stream order; wait for them later.

    Queued before the next step's launch, so the wait covers only the step that made the tokens,
    and the copy happens before that launch overwrites a CUDA graph's static output buffer."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # pinned: the copy is asynchronous
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # CPU: the work is already done; a copy keeps it safe from a runner reusing its buffer
            self.host = t.clone()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def next_decode_input(seqs, greedy: torch.Tensor, block_size: int, device) -> StepInput:
    """The decode step after this one for the same sequences, built before this step's tokens reach
    the host: each sequence's token being read back becomes token_ids[p], p = len(token_ids), and is
    written at position p."""
    rows = []
    for s in seqs:
        p = len(s.token_ids)  # this step's token (not yet appended) goes to position p
        rows.append(([0], p, s.kda_slot, s.blocks[: p // block_size + 1]))  # build() checks the blocks hold p
    step = StepInput.build(rows, block_size, device, non_blocking=True)
    step.input_ids = greedy  # device to device (a graph copies it into its static input): no host sync
    step.ids_from_greedy = True  # host keeps placeholder ids: other TP ranks take their own (equal) argmax
    return step


def forced_input(greedy: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The next step's input ids: the device's tokens with rows[i] = (row, token) written over them, without a
    host sync (the recorded tokens go up through pinned memory). A copy: greedy may be a graph's static output."""
    idx = _to_device(torch.tensor([r for r, _ in rows], dtype=torch.long), greedy.device)
    val = _to_device(torch.tensor([t for _, t in rows], dtype=greedy.dtype), greedy.device)
    return greedy.clone().index_copy_(0, idx, val)
