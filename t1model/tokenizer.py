"""Tokenizer and Qwen3 ChatML chat format, plus parsing of Qwen3-style bash tool calls.

The conversation format (what a Qwen3 checkpoint expects):
    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{task}<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": "bash", "arguments": {"command": "ls"}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n...
Token-level helpers (`encode_prompt`, `encode_tool_response`, `assistant_turn_end_ids`) build these pieces as ids so
the agent loop appends them to sampled ids without ever re-tokenizing history (TITO). Text that comes from outside
(task instructions, command output) is encoded with special-token matching off: a command that prints
"<|im_end|>" yields ordinary byte tokens, not a turn boundary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer

BUILTIN_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer.json"
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TOKENS = (ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<think>", "</think>")


class ChatTokenizer:
    """A `tokenizers` tokenizer with the Qwen3 chat special tokens; see the module docstring for the format."""

    def __init__(self, tokenizer_json: str) -> None:
        """From the text of a tokenizer.json; it must define every token in CHAT_TOKENS as a single id."""
        self._json = tokenizer_json
        self._tok = Tokenizer.from_str(tokenizer_json)
        # A second instance that treats special-token strings as plain text (for untrusted content).
        self._plain = Tokenizer.from_str(tokenizer_json)
        self._plain.encode_special_tokens = True
        missing = [t for t in CHAT_TOKENS if self._tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer.json: expected the chat tokens {list(CHAT_TOKENS)} as single ids, "
                             f"missing {missing}")
        self.im_start_id: int = self._tok.token_to_id(IM_START)
        self.im_end_id: int = self._tok.token_to_id(IM_END)
        self.endoftext_id: int = self._tok.token_to_id(ENDOFTEXT)
        self.eos_ids: list[int] = [self.im_end_id, self.endoftext_id]
        """Ids that end a generation: <|im_end|> closes an assistant turn, <|endoftext|> ends a document."""
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        """Number of ids the tokenizer can produce (a checkpoint's embedding may have more rows)."""
        self._newline_ids = self.encode("\n")

    @classmethod
    def builtin(cls) -> ChatTokenizer:
        """The repo's byte-level BPE (4096 ids, chat tokens at 0..8), trained by scripts/train_tokenizer.py."""
        return cls(BUILTIN_PATH.read_text())

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ChatTokenizer:
        """The tokenizer.json of a HF checkpoint directory (e.g. a Qwen3 model)."""
        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} not found (only tokenizer.json based tokenizers are supported)")
        return cls(file.read_text())

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json into a checkpoint directory, so that `from_pretrained(path)` finds it."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "tokenizer.json").write_text(self._json)

    def token_id(self, token: str) -> int:
        """Id of a single token string (e.g. "<tool_call>"); ValueError when it is not one token."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"token: {token!r} is not a single token of this tokenizer")
        return tid

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; chat-token strings inside it become their single special ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Ids of untrusted text: special-token strings are spelled out as ordinary tokens."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Exact text of `ids`, special tokens included."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """ChatML text of a conversation: `render_chat` (the template needs no vocabulary)."""
        return render_chat(messages)

    def encode_prompt(self, system: str | None, user: str) -> list[int]:
        """Ids of [system turn] + user turn + "<|im_start|>assistant\\n" (the first prompt of an episode).

        The system prompt is the trainer's own text: tags in it (`<tool_call>` in the format description)
        become their special ids, as Qwen3's template does and as the model emits them. The user's text is
        task data and never yields special ids.
        """
        ids: list[int] = []
        if system is not None:
            ids += self.encode(f"{IM_START}system\n{system}{IM_END}\n")
        ids += self.encode(f"{IM_START}user\n") + self.encode_plain(user)
        return ids + self.encode(f"{IM_END}\n{IM_START}assistant\n")

    def encode_tool_response(self, output: str, *, body_ids: list[int] | None = None) -> list[int]:
        """Ids of a tool result turn plus the next assistant header:
        "<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n".
        `body_ids`: the ids of "\\n{output}\\n" when the caller has them already (an output capped in tokens).
        """
        body = body_ids if body_ids is not None else self.encode_plain(f"\n{output}\n")
        return (self.encode(f"{IM_START}user\n<tool_response>") + body
                + self.encode(f"</tool_response>{IM_END}\n{IM_START}assistant\n"))

    def assistant_turn_end_ids(self) -> list[int]:
        """What closes a sampled reply in the template: <|im_end|> then "\\n" (the model samples only the first)."""
        return [self.im_end_id, *self._newline_ids]


def render_chat(messages: list[dict[str, Any]]) -> str:
    """ChatML text of a conversation (display, naive re-tokenization baselines, and the pretraining corpus's
    walks, `t1core.pretrain.walk_text`; a sampled transcript is never re-rendered for training).

    Roles: system, user, assistant (optional `reasoning_content`, optional `tool_calls` as
    [{"name": ..., "arguments": {...}}] or OpenAI-style [{"function": {...}}]), tool (rendered as Qwen3 does:
    a user turn of <tool_response> blocks, consecutive tool messages sharing one turn).
    """
    out: list[str] = []
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content") or ""
        if role in ("system", "user"):
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            out.append(f"{IM_START}assistant\n{_assistant_body(msg)}{IM_END}\n")
        elif role == "tool":
            first = i == 0 or messages[i - 1].get("role") != "tool"
            last = i == len(messages) - 1 or messages[i + 1].get("role") != "tool"
            out.append((f"{IM_START}user" if first else "") + f"\n<tool_response>\n{content}\n</tool_response>"
                       + (f"{IM_END}\n" if last else ""))
        else:
            raise ValueError(f"messages[{i}].role: expected system/user/assistant/tool, got {role!r}")
    return "".join(out)


def _assistant_body(msg: dict[str, Any]) -> str:
    body = msg.get("content") or ""
    if msg.get("reasoning_content"):
        reasoning, answer = msg["reasoning_content"].strip("\n"), body.lstrip("\n")
        body = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    for j, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        args_json = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        sep = "\n" if (j > 0 or body) else ""
        body += f'{sep}<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_json}}}\n</tool_call>'
    return body


def format_tool_call(command: str, *, name: str = "bash") -> str:
    """The text of one Qwen3 tool call running `command` (as an assistant would emit it)."""
    payload = json.dumps({"name": name, "arguments": {"command": command}}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed bash tool call."""

    command: str
    """The shell command to run."""
    name: str = "bash"
    """Tool name as emitted."""


ToolCallErrorKind = Literal["no_tool_call", "unclosed", "multiple_calls", "bad_json", "wrong_name", "missing_command"]


@dataclass(frozen=True)
class ToolCallError:
    """Why a reply holds no usable tool call; `message` is suitable to show the model as feedback."""

    kind: ToolCallErrorKind
    """no_tool_call | unclosed | multiple_calls | bad_json | wrong_name | missing_command."""
    message: str
    """Human-readable detail (what was expected, what was found)."""


def parse_tool_call(text: str, *, tool_name: str = "bash") -> ToolCall | ToolCallError:
    """The command of the single `<tool_call>{"name": "bash", "arguments": {"command": ...}}</tool_call>` in `text`.

    Text outside the tags (reasoning, prose) is allowed. `arguments` may also be a JSON string holding the object
    (some models emit that). Anything else is a ToolCallError naming what was malformed.
    """
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    count = text.count(open_tag)
    if count == 0:
        return ToolCallError("no_tool_call", f"expected a {open_tag}...{close_tag} block, found none")
    if count > 1:
        return ToolCallError("multiple_calls", f"expected exactly one {open_tag} block per reply, found {count}")
    start = text.index(open_tag) + len(open_tag)
    end = text.find(close_tag, start)
    if end < 0:
        return ToolCallError("unclosed", f"{open_tag} is not closed by {close_tag}")
    payload = text[start:end].strip()
    try:
        call = json.loads(payload)
    except json.JSONDecodeError as e:
        return ToolCallError("bad_json", f"tool call is not valid JSON ({e.msg} at char {e.pos}): {payload[:200]!r}")
    if not isinstance(call, dict):
        return ToolCallError("bad_json", f"expected a JSON object with name and arguments, got {type(call).__name__}")
    if call.get("name") != tool_name:
        return ToolCallError("wrong_name", f"expected tool name {tool_name!r}, got {call.get('name')!r}")
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError("bad_json", f"arguments string is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(args, dict) or not isinstance(args.get("command"), str) or not args["command"].strip():
        return ToolCallError("missing_command", f"expected arguments {{\"command\": \"<non-empty string>\"}}, "
                                                f"got {json.dumps(args)[:200]}")
    return ToolCall(command=args["command"], name=tool_name)
