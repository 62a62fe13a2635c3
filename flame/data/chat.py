"""Chat and preference data turned into documents whose only targets are the assistant's replies.

A chat row is a conversation: a list of ``{"role", "content"}`` messages (a ``messages`` column), or a ``prompt``
and a ``response`` (one user turn, one assistant turn). A preference row holds a ``prompt`` and two replies,
``chosen`` and ``rejected``; the prompt may be a conversation and each reply a string or an assistant message.

A conversation is rendered with the chat template (the tokenizer's own, or the file of
``training.chat_template``) and tokenized once. The replies' characters are found by rendering the conversation up
to each assistant turn (with the generation prompt) and through it: a template must render every such prefix as a
prefix of the whole conversation, as chat templates do. Tokens that start inside a reply are targets, every other
token is context (flame/data/tokenize.py's ``as_context``), so the loss covers the replies and what the template
closes them with (an end-of-turn token: the model learns to stop).

A row that cannot be trained on (no assistant reply, an empty reply, a pair whose replies are equal) raises
:class:`BadRow`; the dataset readers name the row.
"""

from pathlib import Path

import numpy as np

from flame.data.config import DataConfigError
from flame.data.tokenize import Encoded, as_context

ROLES = ("system", "user", "assistant", "tool")


class BadRow(ValueError):
    """A row of chat or preference data that cannot be trained on; ``position`` is its index in the batch."""

    def __init__(self, position: int, reason: str):
        super().__init__(reason)
        self.position = position
        self.reason = reason


def load_chat_template(tokenizer, path: str | None) -> str:
    """The template file's text, else the tokenizer's own template; one line when there is neither."""
    if path is not None:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise DataConfigError(f"cannot read training.chat_template '{path}': {e.strerror}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise DataConfigError(
            f"the tokenizer '{tokenizer.name_or_path}' has no chat template; pass --training.chat_template "
            "<file.jinja> (flame/assets/chat_template.jinja is a plain one)"
        )
    return tokenizer.chat_template


def conversation(row) -> list[dict]:
    """A chat row as a list of messages; raises ValueError saying what is wrong with it."""
    if isinstance(row, dict) and "messages" not in row:
        prompt, response = row.get("prompt"), row.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError("a chat row needs 'messages', or 'prompt' and 'response' strings")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        messages = row["messages"] if isinstance(row, dict) else row
    if not isinstance(messages, list) or not messages:
        raise ValueError("no messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"a message must be a dict with a role in {ROLES}, got {str(message)[:60]!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"a {message['role']} message has no text content")
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("no assistant message")
    if messages[0]["role"] == "assistant":
        raise ValueError("the conversation starts with an assistant message; nothing prompts it")
    if any(not m["content"].strip() for m in assistant):
        raise ValueError("an empty assistant reply")
    return messages


def reply(value) -> dict:
    """A preference row's chosen or rejected reply as an assistant message."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        value = value.get("content") if value.get("role", "assistant") == "assistant" else None
    if not isinstance(value, str):
        raise ValueError("a reply must be a string or one assistant message")
    if not value.strip():
        raise ValueError("an empty reply")
    return {"role": "assistant", "content": value}


def preference_pair(row: dict) -> tuple[list[dict], list[dict]]:
    """The chosen and the rejected conversation of a preference row."""
    if not isinstance(row, dict) or not all(k in row for k in ("prompt", "chosen", "rejected")):
        raise ValueError("a preference row needs 'prompt', 'chosen' and 'rejected'")
    prompt = row["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    chosen, rejected = reply(row["chosen"]), reply(row["rejected"])
    if chosen["content"] == rejected["content"]:
        raise ValueError("chosen and rejected are the same reply")
    return conversation([*prompt, chosen]), conversation([*prompt, rejected])


class ChatEncoder:
    """Chat rows -> documents whose targets are the assistant's replies."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer = tokenizer
        self.template = template

    def __call__(self, rows: list) -> list[Encoded]:
        return [Encoded(self.encode(_checked(conversation, row, i)), None) for i, row in enumerate(rows)]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, messages: list[dict]) -> np.ndarray:
        text = self.render(messages)
        replies = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = (
                self.render(messages[:i], add_generation_prompt=True),
                self.render(messages[: i + 1]),
            )
            if not (text.startswith(through) and through.startswith(before)):
                raise DataConfigError(
                    "the chat template does not render a conversation's first turns as a prefix of the whole "
                    "conversation, so the assistant's tokens cannot be found; use another training.chat_template"
                )
            replies.append((len(before), len(through)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        tokens = np.array(encoded["input_ids"], dtype=np.int32)
        starts = np.array([start for start, _ in encoded["offset_mapping"]])
        is_target = np.zeros(len(tokens), dtype=bool)
        for start, end in replies:
            is_target |= (starts >= start) & (starts < end)
        return np.where(is_target, tokens, as_context(tokens))


class PreferenceEncoder:
    """Preference rows -> (chosen, rejected) document pairs, targets on the replies only."""

    def __init__(self, tokenizer, template: str):
        self.chat = ChatEncoder(tokenizer, template)

    def __call__(self, rows: list) -> list[Encoded]:
        pairs = [_checked(preference_pair, row, i) for i, row in enumerate(rows)]
        return [
            Encoded((self.chat.encode(chosen), self.chat.encode(rejected)), None)
            for chosen, rejected in pairs
        ]


def _checked(parse, row, position: int):
    try:
        return parse(row)
    except (ValueError, KeyError, TypeError) as e:
        raise BadRow(position, str(e)) from None
