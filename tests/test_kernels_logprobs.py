"""The step's logprobs kernels (peregrine/kernels/logprobs.py) against log_softmax in FP64 and a top-K written
here by a stable sort (value descending, then id ascending): real and odd shapes (a vocabulary under K, one not a
whole number of chunks, the Kimi vocabulary), ties, outputs written in full, the logits untouched."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels import logprobs as L

pytestmark = pytest.mark.gpu

VOCAB = 163840  # Kimi vocab


def _ref(x: torch.Tensor, tok: torch.Tensor, k: int):
    """(chosen, top ids, top values) in FP64: log_softmax, then a stable sort of (-value, id)."""
    lp = torch.log_softmax(x.double().cpu(), -1)
    order = torch.sort(-lp, dim=-1, stable=True).indices[:, :k]  # stable: equal values keep id order
    return lp[torch.arange(x.shape[0]), tok.cpu()], order, lp.gather(-1, order)


SHAPES = [(3, 300), (1, 7), (5, 4096 + 17)] + ([(8, VOCAB), (1, VOCAB)] if FULL_SHAPES else [(2, VOCAB)])


@pytest.mark.parametrize("b,v", SHAPES)
def test_logprobs_equal_log_softmax_and_its_top(b, v, device):
    g = torch.Generator().manual_seed(b * 1000 + v)
    x = (torch.randn(b, v, generator=g) * 4).to(device)
    x0 = x.clone()
    assert L.available(x.device)  # the kernels, not the PyTorch form (CPU: under the interpreter)
    tok = torch.randint(0, v, (b,), generator=g).to(device)
    chosen, top_i, top_v = L.token_logprobs(x, tok)
    k = min(L.LOGPROBS_TOP, v)
    rc, ri, rv = _ref(x, tok, k)
    assert top_i.shape == top_v.shape == (b, k) and top_i.dtype == torch.int64 and chosen.shape == (b,)
    assert torch.equal(top_i.cpu(), ri), (top_i, ri)
    assert torch.allclose(top_v.double().cpu(), rv, atol=1e-5) and torch.allclose(chosen.double().cpu(), rc, atol=1e-5)
    assert torch.equal(x, x0)  # the logits are read, never written


def test_ties_take_the_lowest_id_first(device):
    """Values repeated across and within chunks: the top K in value order, equal values by id, as the stable
    reference orders them (the chunks' candidates must carry their ties into the merge)."""
    b, v = 2, 2 * 4096 + 5
    x = torch.full((b, v), -3.0)
    x[0, [5, 4100, 9, 8000, 3]] = 2.0  # five equal tops over two chunks
    x[0, [70, 8195]] = 1.0
    x[1, ::97] = 0.5  # 85 equal values, K of them taken: the lowest ids
    x = x.to(device)
    tok = torch.tensor([4100, 0]).to(device)
    chosen, top_i, top_v = L.token_logprobs(x, tok)
    rc, ri, rv = _ref(x, tok, L.LOGPROBS_TOP)
    assert torch.equal(top_i.cpu(), ri), (top_i, ri)
    assert torch.allclose(top_v.double().cpu(), rv, atol=1e-6) and torch.allclose(chosen.double().cpu(), rc, atol=1e-6)


def test_every_output_slot_is_written(device, monkeypatch):
    """Outputs made poisoned (NaN values, ids -7) before the kernels run: every slot is overwritten."""
    real_empty = torch.empty

    def poisoned(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
    monkeypatch.setattr(L.torch, "empty", poisoned)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5000, generator=g) * 2).to(device)
    tok = torch.tensor([0, 4999, 1234]).to(device)
    chosen, top_i, top_v = L.token_logprobs(x, tok)
    assert torch.isfinite(chosen).all() and torch.isfinite(top_v).all() and ((top_i >= 0) & (top_i < 5000)).all()


def test_without_triton_the_reference_runs(monkeypatch):
    """Where Triton cannot run (a CPU engine), the same call takes the PyTorch form."""
    monkeypatch.setattr(L, "available", lambda dev: False)
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    tok = torch.tensor([1, 2])
    got, want = L.token_logprobs(x, tok), L.token_logprobs_ref(x, tok)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
