"""What the vLLM tests share: two tiny random Llamas, made once per session.

Each module starts its own server (:mod:`tests.vllm.servers`) on these checkpoints, once,
and never beside another module's: a server is module-scoped, the checkpoints are
session-scoped (servers and updates only read them; what a test writes goes beside them,
under its own name, in the directory every server may load from).
"""

from __future__ import annotations

import pytest

from tests.vllm.tiny_llama import TinyLlamas


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory: pytest.TempPathFactory) -> TinyLlamas:
    return TinyLlamas.make(tmp_path_factory.mktemp("vllm"))
