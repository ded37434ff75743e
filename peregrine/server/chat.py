"""Chat prompt rendering.

When the model folder's tokenizer_config.json has a "chat_template" (and jinja2
is installed) it is rendered with messages, add_generation_prompt=True and the
bos/eos token strings. Otherwise the simple built-in template is used:

    <|system|>\\nYou are ...\\n<|user|>\\nHello\\n<|assistant|>\\n

i.e. "<|ROLE|>\\n" + content + "\\n" per message, then "<|assistant|>\\n".
Message content is a string or a list of {"type": "text", "text": ...} parts.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from .protocol import bad

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")


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


class ChatTemplate:
    def __init__(self, folder: Path | None = None):
        self.render_fn, self.kind = simple_template, "simple"
        cfg = Path(folder) / "tokenizer_config.json" if folder is not None else None
        if cfg is None or not cfg.exists():
            return
        try:
            tc = json.loads(cfg.read_text())
            tmpl = tc.get("chat_template")
            if isinstance(tmpl, list):  # named templates: take the default one
                tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
            if not isinstance(tmpl, str):
                return
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            log.warning("jinja2 is not installed: using the simple chat template, not the model's")
            return
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s): using the simple chat template", cfg, e)
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        compiled = env.from_string(tmpl)
        tok = lambda k: tc.get(k) if isinstance(tc.get(k), str) else (tc.get(k) or {}).get("content", "")  # noqa: E731
        extra = {"bos_token": tok("bos_token"), "eos_token": tok("eos_token")}
        self.render_fn = lambda msgs: compiled.render(messages=msgs, add_generation_prompt=True, **extra)
        self.kind = "model"

    def render(self, messages) -> str:
        msgs = normalize_messages(messages)
        try:
            return self.render_fn(msgs)
        except Exception as e:  # a template's raise_exception() or a bad conversation shape
            raise bad(f"chat template rejected the messages: {e}", "messages") from None
