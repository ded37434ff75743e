"""Chat prompt rendering.

When the model folder has a chat template (chat_template.jinja, or "chat_template" in
tokenizer_config.json, as Kimi's folders ship it) it is rendered with jinja2 (sandboxed)
with messages, add_generation_prompt=True and the bos/eos token strings. A template that
does not compile, or jinja2 missing, is an error at start. Otherwise the simple built-in
template is used:

    <|system|>\\nYou are ...\\n<|user|>\\nHello\\n<|assistant|>\\n

i.e. "<|ROLE|>\\n" + content + "\\n" per message, then "<|assistant|>\\n".
Message content is a string or a list of {"type": "text", "text": ...} parts.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import ConfigError
from .protocol import bad

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def simple_template(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}: "
                              "only text is supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": role, "content": content})
    return out


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers renders templates: plain JSON (jinja2's own tojson HTML-escapes < > & ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):  # templates call raise_exception("...") on conversations they refuse
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def find_template(folder: Path) -> tuple[str, str | None, dict]:
    """-> (where it came from, the template or None, tokenizer_config). chat_template.jinja (what
    transformers writes now) wins over tokenizer_config.json's "chat_template"."""
    cfg = folder / TOKENIZER_CONFIG
    tc = {}
    if cfg.exists():
        try:
            tc = json.loads(cfg.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {cfg}: {e}") from None
    jf = folder / TEMPLATE_FILE
    if jf.exists():
        return str(jf), jf.read_text(), tc
    tmpl = tc.get("chat_template") if isinstance(tc, dict) else None
    if isinstance(tmpl, list):  # named templates: take the default one
        tmpl = next((t["template"] for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return str(cfg), tmpl if isinstance(tmpl, str) else None, tc if isinstance(tc, dict) else {}


class ChatTemplate:
    def __init__(self, folder: Path | None = None):
        self.render_fn, self.kind = simple_template, "simple"
        if folder is None:
            return
        where, tmpl, tc = find_template(Path(folder))
        if tmpl is None:
            return
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from jinja2.exceptions import TemplateError
        except ImportError:
            raise ConfigError(f"{where} holds the model's chat template: install jinja2 to render it") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:
            compiled = env.from_string(tmpl)
        except TemplateError as e:
            raise ConfigError(f"{where}: the chat template does not compile: {e}") from None
        tok = lambda k: tc.get(k) if isinstance(tc.get(k), str) else (tc.get(k) or {}).get("content", "")  # noqa: E731
        extra = {"bos_token": tok("bos_token"), "eos_token": tok("eos_token")}
        self.render_fn = lambda msgs: compiled.render(messages=msgs, add_generation_prompt=True, **extra)
        self.kind = f"model ({Path(where).name})"

    def render(self, messages) -> str:
        msgs = normalize_messages(messages)
        try:
            return self.render_fn(msgs)
        except Exception as e:  # a template's raise_exception() or a bad conversation shape
            raise bad(f"chat template rejected the messages: {e}", "messages") from None
