"""The vLLM engine's chat template, on vLLM's own renderer in this process (no engine start): a
model without a template is refused with a code of its own, as vLLM's server refuses it, and a
template given to the worker (``serve --chat-template``, a file or the template itself, as
vLLM's ``--chat-template``) is the one rendered."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.tiny_llama import CHAT_TEMPLATE, TinyLlamas, add_byte_tokenizer
from weightsync.core import errors

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


class Llm:
    """What the engine's text side reads of an ``AsyncLLM``: its renderer (vLLM's own)."""

    def __init__(self, model: Path) -> None:
        with warnings.catch_warnings():  # vLLM's imports warn about torch APIs it uses
            warnings.simplefilter("ignore", DeprecationWarning)
            from vllm.config import ModelConfig, VllmConfig
            from vllm.renderers.registry import renderer_from_config

            config = VllmConfig(
                model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512)
            )
            self.renderer: Any = renderer_from_config(config)


@pytest.fixture(scope="module")
def untemplated(tiny_llamas: TinyLlamas, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("untemplated") / "a"
    shutil.copytree(tiny_llamas.a, model)
    add_byte_tokenizer(model)
    (model / "chat_template.jinja").unlink()  # a tokenizer, no template
    return model


def test_a_model_without_a_chat_template_is_refused_with_its_own_code(untemplated: Path) -> None:
    from weightsync.engines.vllm.tokenizer import VllmTokenizer

    tokenizer = VllmTokenizer.of(Llm(untemplated))
    assert tokenizer is not None and tokenizer.encode("hi") == [74, 75]  # it does tokenize
    with pytest.raises(errors.NotSupported) as refused:
        tokenizer.chat(MESSAGES)
    assert (refused.value.code, refused.value.http_status, refused.value.details["field"]) == (
        "no_chat_template", 501, "messages",
    )  # fmt: skip
    assert "--chat-template" in refused.value.message


def test_a_chat_template_given_to_the_worker_is_the_one_rendered(untemplated: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from weightsync.engines.vllm.serve import chat_template
    from weightsync.engines.vllm.tokenizer import VllmTokenizer

    path = tmp_path / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert chat_template(str(path)) == chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    tokenizer = VllmTokenizer.of(Llm(untemplated), chat_template(str(path)))
    assert tokenizer is not None
    hf = AutoTokenizer.from_pretrained(str(untemplated))
    for gen in (True, False):
        expected = hf.apply_chat_template(
            MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=gen, return_dict=False
        )
        assert tokenizer.chat(MESSAGES, gen) == list(expected)
    assert hf.decode(tokenizer.chat(MESSAGES)) == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
    with pytest.raises(SystemExit):
        chat_template(str(tmp_path / "missing.jinja"))
