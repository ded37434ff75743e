"""compile_log: start-up compiles counted, later ones logged by name, nothing when the environment is silent."""
import pytest

from peregrine import compile_log as C


def test_compiles_after_start_up_are_logged_and_the_hooks_never_skip_a_compile(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    lines = []
    assert not C.install(lines.append, env={})
    assert knobs.runtime.jit_cache_hook is None
    assert C.install(lines.append, env={C.ENV: "1"})
    fn = type("Info", (), {"name": "my_kernel"})()
    kw = dict(repr="my_kernel[num_warps=4](x: *bf16)", fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
    for key in ("a", "b"):  # two start-up compiles
        assert not knobs.runtime.jit_cache_hook(key=key, **kw)  # a true value would skip the compile
        knobs.runtime.jit_post_compile_hook(key=key, **kw)
    assert lines == []
    C.serving()
    assert "2 Triton kernel specializations compiled at start-up" in lines[-1]
    knobs.runtime.jit_cache_hook(key="c", **kw)
    knobs.runtime.jit_post_compile_hook(key="c", **kw)
    assert "WARNING: triton compiled my_kernel while serving" in lines[-1] and "x: *bf16" in lines[-1]
    assert C.counts() == {"startup": 2, "serving": 1}


def test_a_later_compile_names_its_specialization():
    """The warning names what made the compile: the arguments fixed as constants (an int equal to 1) and those
    taken as 16-divisible or 16-byte aligned, from the record triton 3.6's hook passes (signature by name,
    constants and attributes by argument path); triton's own repr names only the first argument."""
    rec = {"signature": {"qkv": "*bf16", "slots": "*i64", "T": "constexpr", "s_b": "i32", "BLOCK": "constexpr"},
           "constants": {(2,): 1, (4,): 64}, "configs": [{(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]}]}
    d = C.describe(rec)
    assert "T=1" in d and "BLOCK=64" in d
    assert "divisible by 16 [qkv, s_b]" in d and "slots: *i64" in d
    assert C.describe({"no": "signature"}) == ""  # another triton's record: the caller falls back to its repr
