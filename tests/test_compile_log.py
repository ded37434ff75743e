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
