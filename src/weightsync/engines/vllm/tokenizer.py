"""The vLLM engine's text side, when vLLM runs with the model's tokenizer (without
``skip_tokenizer_init``): text prompts encoded as vLLM's OpenAI server encodes a completion's
prompt, chat messages rendered by vLLM's own renderer (the model's chat template through the
tokenizer's ``apply_chat_template``, as vLLM's chat route renders them), and a token spelled
alone as vLLM spells it.  The generated text is vLLM's own detokenizer's (see
:mod:`~weightsync.engines.vllm.generation`).  A Hugging Face fast tokenizer may not be used
from two threads at once ("Already borrowed"): every call here holds one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.core.errors import InvalidRequest, NotSupported


class VllmTokenizer:
    """Text ↔ token ids through vLLM's tokenizer and renderer (``llm.renderer``);
    ``chat_template``: the template to use instead of the model's (vLLM's ``--chat-template``)."""

    name = "vllm"

    def __init__(self, llm: Any, chat_template: str | None = None) -> None:
        self._renderer = llm.renderer
        self._tokenizer = llm.renderer.get_tokenizer()
        self.chat_template = chat_template
        self._lock = threading.Lock()  # the tokenizer is not safe to share between threads

    @classmethod
    def of(cls, llm: Any, chat_template: str | None = None) -> VllmTokenizer | None:
        """The text side of ``llm``, or ``None`` when vLLM runs without a tokenizer."""
        renderer = getattr(llm, "renderer", None)
        if renderer is None or getattr(renderer, "tokenizer", None) is None:
            return None
        return cls(llm, chat_template)

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """``text`` as vLLM's completion route tokenizes it (with the tokenizer's special
        tokens, a BOS where the model has one)."""
        try:
            with self._lock:
                return list(self._tokenizer.encode(text, add_special_tokens=True))
        except Exception as exc:
            raise InvalidRequest(
                f"{field} could not be tokenized: {exc}", code="invalid_value", field=field
            ) from None

    def token_text(self, token: int) -> str:
        """One token read alone, as vLLM's serving layer reads a token it has no spelling of."""
        with self._lock:
            return str(self._tokenizer.decode([token]))

    def chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt's token ids: ``messages`` rendered as vLLM's chat route renders them.

        Raises ``NotSupported`` (``no_chat_template``) when the model has no chat template
        and none was given, ``InvalidRequest`` when the template rejects the messages."""
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.chat_utils import ChatTemplateResolutionError
        from vllm.renderers.params import ChatParams

        params = ChatParams(
            chat_template=self.chat_template,
            chat_template_kwargs={
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": False,
            },
        )
        try:
            with self._lock:
                _, prompt = self._renderer.render_messages([dict(m) for m in messages], params)
        except ChatTemplateResolutionError:
            raise NotSupported(
                "the model's tokenizer has no chat template: give the worker one "
                "(weightsync serve --chat-template, or chat_template in the model's tokenizer_config.json), "
                "or send the prompt to /v1/completions",
                code="no_chat_template",
                field="messages",
            ) from None
        except (VLLMValidationError, ValueError, TypeError) as exc:
            raise InvalidRequest(
                f"the chat template refused the messages: {exc}", code="invalid_value", field="messages"
            ) from None
        ids = prompt.get("prompt_token_ids")
        if ids is None:  # rendered to text: tokenized as vLLM's chat route does, no special tokens added
            with self._lock:
                ids = self._tokenizer.encode(str(prompt["prompt"]), add_special_tokens=False)
        return list(ids)
