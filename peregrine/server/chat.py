"""Chat prompt rendering.

When the model folder has a chat template (chat_template.jinja, or "chat_template" in
tokenizer_config.json, as Kimi's folders ship it) it is rendered with jinja2 (sandboxed) as transformers'
apply_chat_template renders it: the same environment (trim_blocks, lstrip_blocks, loop controls, a plain-JSON
tojson with separators, raise_exception, strftime_now, namespace), the messages with their null fields dropped
and their reasoning under every name templates read, `tools`, add_generation_prompt=True, the tokenizer's special
tokens (bos/eos/unk/pad) and the request's chat_template_kwargs. A template that does not compile, or jinja2
missing, is an error at start. Kimi K3 (config.json model_type "kimi_k3") has no Jinja template: its Python
format is k3_chat.py, its control tokens encoded as special tokens and all other text as ordinary text.
Otherwise the simple built-in template is used:

    <|system|>\\nYou are ...\\n<|user|>\\nHello\\n<|assistant|>\\n

i.e. "<|ROLE|>\\n" + content + "\\n" per message, then "<|assistant|>\\n".
Message content is a string or a list of {"type": "text", "text": ...} parts. An assistant message may carry
`tool_calls` (content null or text) and `reasoning_content` / `reasoning`; a tool message carries `tool_call_id`;
any message a `name`. A malformed one is a 400 naming `messages` and saying where.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

from ..config import ConfigError
from . import k3_chat
from .protocol import bad

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG = "config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what transformers hands every template
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")  # set by the server itself


def simple_template(messages: list[dict], tools=None, **_) -> str:
    return "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages) + "<|assistant|>\n"


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}.content parts must be {{'type': 'text', 'text': str}}: only text is supported",
                          "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as OpenAI sends them: [{id, type: "function", function: {name, arguments}}],
    arguments a JSON string (passed to the template as sent, as transformers passes them)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list of tool calls", "messages")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict):
            raise bad(f"{w} must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                      "messages")
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise bad(f"{w}.id must be a non-empty string (the id its tool result answers)", "messages")
        if c.get("type", "function") != "function":
            raise bad(f"{w}.type must be 'function', got {c.get('type')!r}", "messages")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"{w}.function.name must be a non-empty string", "messages")
        if not isinstance(f.get("arguments"), str):
            raise bad(f"{w}.function.arguments must be a string (the arguments as JSON)", "messages")
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": f["arguments"]}})
    return out


def normalize_messages(messages) -> list[dict]:
    """The messages as templates see them: role, content (a string; null only for an assistant message), name,
    tool_calls (assistant), tool_call_id (tool), reasoning_content / reasoning (assistant). Other fields dropped."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        content = _text(m.get("content"), where)
        msg = {"role": role, "content": "" if content is None and role != "assistant" else content}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad(f"{where}.name must be a string", "messages")
            msg["name"] = m["name"]
        if role == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            for k in ("reasoning_content", "reasoning"):
                if m.get(k) is not None:
                    if not isinstance(m[k], str):
                        raise bad(f"{where}.{k} must be a string", "messages")
                    msg[k] = m[k]
        elif m.get("tool_calls") is not None:
            raise bad(f"{where}: only assistant messages carry tool_calls, this one is {role!r}", "messages")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:
                raise bad(f"{where}.tool_call_id must be a non-empty string: the id of the tool call it answers",
                          "messages")
            msg["tool_call_id"] = tcid
        out.append(msg)
    return out


def _template_view(msgs: list[dict]) -> list[dict]:
    """As transformers hands messages to a template: fields that are null dropped, the reasoning under every name
    templates read."""
    view = []
    for m in msgs:
        m = {k: v for k, v in m.items() if v is not None}
        r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        view.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return view


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers renders templates: plain JSON (jinja2's own tojson HTML-escapes < > & ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):  # templates call raise_exception("...") on conversations they refuse
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _environment():
    """jinja2's sandbox as transformers configures it for chat templates."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: transformers marks assistant text with it; rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class TemplateNamespace(Namespace):  # no dunder attributes (transformers' rule)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            if any(isinstance(k, str) and k.startswith("_") for k in attrs):
                raise jinja2.exceptions.SecurityError("chat templates cannot store underscore attributes")
            Namespace.__init__(self, attrs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f),
                       namespace=TemplateNamespace)
    return env


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


def _model_type(folder: Path) -> str | None:
    try:
        raw = json.loads((folder / MODEL_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def _special(tc: dict, key: str) -> str:
    v = tc.get(key)
    return v if isinstance(v, str) else (v or {}).get("content", "") if isinstance(v, dict) else ""


class ChatTemplate:
    """render(messages, tools, **kwargs) -> the prompt's text; prompt_ids(tokenizer, ...) -> its token ids.
    model_type "kimi_k3" (read from the folder's config.json when not given) renders K3's XTML format."""

    def __init__(self, folder: Path | None = None, model_type: str | None = None):
        self.render_fn, self.kind, self.k3 = simple_template, "simple", False
        if folder is None:
            return
        folder = Path(folder)
        if (model_type or _model_type(folder)) == "kimi_k3":
            self.kind, self.k3 = "kimi_k3 (XTML, k3_chat.py)", True
            return
        where, tmpl, tc = find_template(folder)
        if tmpl is None:
            return
        try:
            from jinja2.exceptions import TemplateError
            env = _environment()
        except ImportError:
            raise ConfigError(f"{where} holds the model's chat template: install jinja2 to render it") from None
        try:
            compiled = env.from_string(tmpl)
        except TemplateError as e:
            raise ConfigError(f"{where}: the chat template does not compile: {e}") from None
        specials = {k: _special(tc, k) for k in SPECIAL_TOKENS if _special(tc, k)}

        def render_fn(msgs, tools=None, **kw):
            return compiled.render(messages=_template_view(msgs), tools=tools, documents=None,
                                   add_generation_prompt=True, **{**specials, **kw})
        self.render_fn = render_fn
        self.kind = f"model ({Path(where).name})"

    def _k3_segments(self, msgs, tools, kw: dict) -> k3_chat.Segments:
        kw = dict(kw)
        thinking = kw.pop("thinking", kw.pop("enable_thinking", True))
        return k3_chat.render(msgs, tools, thinking=bool(thinking), thinking_effort=kw.get("thinking_effort"),
                              tool_choice=kw.get("tool_choice"), response_format=kw.get("response_format"))

    def render(self, messages, tools: list | None = None, **kwargs) -> str:
        """kwargs: chat_template_kwargs (for K3 also thinking, thinking_effort, tool_choice, response_format)."""
        msgs = normalize_messages(messages)
        try:
            if self.k3:
                return "".join(t for t, _ in self._k3_segments(msgs, tools, kwargs))
            return self.render_fn(msgs, tools=tools, **kwargs)
        except Exception as e:  # a template's raise_exception() or a bad conversation shape
            raise bad(f"chat template rejected the messages: {e}", "messages") from None

    def prompt_ids(self, tokenizer, messages, tools: list | None = None, **kwargs) -> list[int]:
        if not self.k3:
            return tokenizer.encode(self.render(messages, tools, **kwargs))
        try:
            segs = self._k3_segments(normalize_messages(messages), tools, kwargs)
        except k3_chat.K3FormatError as e:
            raise bad(f"chat template rejected the messages: {e}", "messages") from None
        return encode_segments(tokenizer, segs)


def encode_segments(tokenizer, segments) -> list[int]:
    """Control segments as their special token; other text as ordinary text, so a marker spelled in it stays text."""
    from .reply import special_id
    ids: list[int] = []
    plain = getattr(tokenizer, "encode_ordinary", None)
    if plain is None and hasattr(tokenizer, "enc"):  # Kimi's tiktoken tokenizer: its pieces, specials not parsed
        from ..kimi_tokenizer import _pieces
        plain = lambda t: [i for p in _pieces(t) for i in tokenizer.enc.encode_ordinary(p)]  # noqa: E731
    for text, special in segments:
        if special:
            tid = special_id(tokenizer, text)
            if tid is None:
                raise ConfigError(f"the tokenizer has no special token {text!r}, which Kimi K3's format needs")
            ids.append(tid)
        else:
            ids += plain(text) if plain is not None else tokenizer.encode(text)
    return ids


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's reasoning_effort values


def template_kwargs(body: dict, k3: bool, tools) -> tuple[dict, bool]:
    """-> (what the template is rendered with besides messages and tools, thinking on). chat_template_kwargs are
    the request's (vLLM's field); reasoning_effort adds enable_thinking (not "none") as vLLM does. For Kimi K3 (its
    renderer's arguments): thinking from thinking / enable_thinking / reasoning_effort "none" (default on),
    thinking_effort from reasoning_effort (low, high, max), tool_choice ("required" / "none", with tools) and
    response_format. tools: tools.ToolRequest."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad(f"'chat_template_kwargs' must be an object, got {kw!r}", "chat_template_kwargs")
    clash = sorted(k for k in kw if k in RESERVED_KWARGS)
    if clash:
        raise bad(f"'chat_template_kwargs' cannot set {', '.join(clash)}: the request's own fields do",
                  "chat_template_kwargs")
    kw = dict(kw)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                      "reasoning_effort")
        kw["reasoning_effort"] = effort
        kw.setdefault("enable_thinking", effort != "none")
    if not k3:
        return kw, bool(kw.get("thinking", kw.get("enable_thinking", True)))
    thinking = kw.pop("thinking", None)
    enable = kw.pop("enable_thinking", None)
    thinking = bool(thinking if thinking is not None else enable if enable is not None else True)
    effort = kw.pop("reasoning_effort", None)
    if effort is not None and effort != "none":
        kw.setdefault("thinking_effort", effort)
    te = kw.get("thinking_effort")
    if thinking and te is not None and te not in k3_chat.THINKING_EFFORTS:
        field = "reasoning_effort" if body.get("reasoning_effort") else "chat_template_kwargs"
        raise bad(f"Kimi K3 takes reasoning_effort / thinking_effort {', '.join(k3_chat.THINKING_EFFORTS)} or "
                  f"\"none\", got {te!r}", field)
    kw["thinking"] = thinking
    if tools is not None and tools.tools and tools.choice in ("required", "none"):
        kw["tool_choice"] = tools.choice  # vLLM passes it only with tools; "auto" and a named one add nothing
    if body.get("response_format") is not None:
        kw["response_format"] = body["response_format"]
    return kw, thinking
