"""The reference engine's tokenizer: byte-level, one token per UTF-8 byte, and a chat template.

The template is ChatML's layout written in plain text (the vocabulary has no special tokens):
every message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, and the generation prompt
opens the assistant's turn, ``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.core.errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool", "developer")


class ByteTokenizer:
    """Text ↔ token ids for a 256-token byte vocabulary."""

    name = "bytes"

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """The UTF-8 bytes of ``text``.  Raises ``InvalidRequest`` for text no UTF-8 can hold
        (a lone surrogate)."""
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{field} is not valid UTF-8 text (it holds a lone surrogate)",
                code="invalid_value",
                field=field,
            ) from None

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """How one token reads on its own: its character when it is ASCII, else its byte
        spelled ``bytes:\\xNN`` (as vLLM spells a partial UTF-8 sequence)."""
        return chr(token) if token < 128 else f"bytes:\\x{token:02x}"

    def chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """``messages`` (each with a ``role`` and text ``content``) in the template."""
        turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(turns) + ("<|im_start|>assistant\n" if add_generation_prompt else "")
