"""A base model's own tokenizer as plain data: conversations rendered with its chat template, tokens decoded.

The service never holds a tokenizer; it asks the backend (`render_chat`, `decode`), which calls these with
the model's own tokenizer, so a conversation is tokenized exactly as the model was trained to read it.

Assistant spans (for training on conversations): the tokens of assistant message i are those its template
adds after the conversation up to message i rendered with the generation prompt (`<|im_start|>assistant\\n`
or whatever the template writes) and up to the end of message i, end-of-turn tokens included: they come
from the template, never from a hard-coded string. That needs the template to render each shorter
conversation as a prefix of the longer one; a template that does not (one that rewrites earlier turns)
is refused with a message saying so.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from whitney.errors import InvalidInput
from whitney.protocol.backend import ChatTokens

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: list[dict]) -> None:
    """Each message a {role, content} of known role and string content (InvalidInput naming the message)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages must be a non-empty list", field="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidInput(f"messages[{i}] must be {{role, content}} with role one of {list(ROLES)} and content "
                               "a string", field=f"messages.{i}")


def _text(tokenizer, model: str, messages: list[dict], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInput(f"model {model!r} has no chat template; send a prompt (POST /v1/completions) instead",
                           field="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's own checks (roles that must alternate, a system message placed late)
        raise InvalidInput(f"the chat template of {model!r} refuses these messages: {e}", field="messages") from None


def _encode(tokenizer, text: str) -> list[int]:
    """The text's token ids; the template wrote every special token (BOS included) itself."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(tokenizer, model: str, messages: list[dict], add_generation_prompt: bool = True,
                mark_assistant: bool = False) -> ChatTokens:
    """`messages` rendered with the model's chat template and tokenized; with `mark_assistant`, the mask of
    the assistant messages' tokens (see the module docstring)."""
    check_messages(messages)
    tokens = _encode(tokenizer, _text(tokenizer, model, messages, add_generation_prompt))
    if not mark_assistant:
        return ChatTokens(tokens)
    mask = [0] * len(tokens)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _encode(tokenizer, _text(tokenizer, model, messages[:i], True)) if i else []
        upto = _encode(tokenizer, _text(tokenizer, model, messages[:i + 1], False))
        if upto[:len(start)] != start or tokens[:len(upto)] != upto:
            raise InvalidInput(f"the chat template of {model!r} does not render the conversation up to message {i} "
                               "as a prefix of the whole, so its assistant tokens cannot be marked", field="messages")
        mask[len(start):len(upto)] = [1] * (len(upto) - len(start))
    return ChatTokens(tokens, mask)


def encode(tokenizer, text: str) -> list[int]:
    """A plain text prompt's token ids, with the special tokens (a BOS) the tokenizer adds by default."""
    return list(tokenizer(text)["input_ids"])


def decode(tokenizer, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """Each sequence's text (special tokens such as end-of-turn left out unless asked for). Never cleans up
    spaces, so a text decoded in pieces joins up to the text decoded whole."""
    return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            for s in sequences]


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """A tokenizer as plain data: the files `save_pretrained` writes for it (vocabulary, merges, special tokens,
    chat template), {file name: bytes}; `tokenizer_from_files` makes the same tokenizer again elsewhere."""
    with tempfile.TemporaryDirectory(prefix="whitney-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]):
    """The tokenizer `tokenizer_files` described, loaded from a folder of its own files (no model files)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="whitney-tokenizer-") as folder:
        for name, data in files.items():
            (Path(folder) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(folder)


class TextMethods:
    """The Backend protocol's text methods, for a backend that can hand out each served model's own
    tokenizer (`tokenizer(base_model)`): InProcessBackend from its engine, RayBackend from its trainers."""

    def tokenizer(self, base_model: str):
        raise NotImplementedError

    def render_chat(self, base_model: str, messages: list[dict], add_generation_prompt: bool = True,
                    mark_assistant: bool = False) -> ChatTokens:
        return render_chat(self.tokenizer(base_model), base_model, messages, add_generation_prompt, mark_assistant)

    def encode(self, base_model: str, text: str) -> list[int]:
        return encode(self.tokenizer(base_model), text)

    def decode(self, base_model: str, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return decode(self.tokenizer(base_model), sequences, skip_special_tokens)
