from __future__ import annotations

import subprocess
import sys


def test_importing_core_loads_no_torch_vllm_or_web_framework() -> None:
    code = (
        "import sys, weightsync.core, weightsync.core.diagram;"
        "heavy = [m for m in ('torch', 'vllm', 'fastapi', 'starlette', 'httpx', 'uvicorn', 'numpy')"
        " if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_importing_the_adapter_slots_loads_no_torch_vllm_or_web_framework() -> None:
    modules = ("config", "names", "digest", "slots", "commands", "engine", "requests", "diagram")
    code = (
        f"import sys; [__import__('weightsync.lora.' + m) for m in {modules!r}];"
        "heavy = [m for m in ('torch', 'vllm', 'fastapi', 'starlette', 'httpx', 'uvicorn', 'numpy')"
        " if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
