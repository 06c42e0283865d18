"""``weightsync demo``: an RL-style loop against a real worker, on any laptop.

A trainer process-side model (the reference transformer) is trained for a few steps to say
a target phrase; after each step it saves an atomic checkpoint, and the worker — a real
HTTP server over the reference engine — is paused, updated from disk with version
``step-N``, resumed, and asked to generate.  Then a corrupt checkpoint is refused without
changing a byte, and one async-RL step updates the weights *while* a completion runs, which
reports the two version spans it saw.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.core import Controller, WeightSyncError
from weightsync.engines.reference import CausalLM, ModelConfig, ReferenceEngine
from weightsync.serve import ServerThread, create_app
from weightsync.trainer import WorkerClient, save_checkpoint

PROMPT = "Q: who moves the weights?\nA:"
TARGET = " weightsync moves them, honestly."


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class Trainer:
    """A few supervised steps toward TARGET stand in for an RL update."""

    def __init__(self, config: ModelConfig) -> None:
        self.model = CausalLM(config)
        self.model.requires_grad_(True)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        ids = list((PROMPT + TARGET).encode())
        self.tokens = torch.tensor([ids])
        self.prompt_len = len(PROMPT.encode())

    def step(self, inner_steps: int, progress: Progress) -> float:
        task = progress.add_task("training", total=inner_steps)
        loss = torch.tensor(0.0)
        for _ in range(inner_steps):
            logits = self.model.forward_full(self.tokens[:, :-1])
            target = self.tokens[:, 1:].clone()
            target[:, : self.prompt_len - 1] = -100  # learn only the answer
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            progress.advance(task)
        progress.remove_task(task)
        return float(loss.detach())

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.weights().items()}


def run_demo(steps: int = 3, console: Console | None = None) -> int:
    # soft_wrap: a line piped to a file or a pager is never cut mid-phrase
    console = console or Console(soft_wrap=True)
    say = console.print
    config = ModelConfig()
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as tmp:
        root = Path(tmp)
        engine = ReferenceEngine(config, allowed_weight_dirs=[root])
        app = create_app(Controller(engine))
        with ServerThread(app) as server:
            client = WorkerClient(server.url)
            params = sum(t.numel() for t in engine.model.weights().values())
            say("[bold]weightsync demo[/] — a trainer pushing new weights into a running inference worker")
            say(
                f"The worker runs weightsync's reference engine: a small transformer "
                f"({params / 1e6:.1f}M parameters, one token per byte) that starts from random weights, "
                "so its answers are noise until the trainer has taught it something."
            )
            say(f"prompt: {PROMPT!r}")
            say(f"target: {TARGET!r}  (what the trainer teaches it to answer)")
            say(f"worker: serving on {server.url} ({len(client.routes()['routes'])} admin routes)")
            state = client.get_weight_version()
            say(
                "fresh worker: nobody has told it which weights it serves yet "
                f"(version={state['version']!r} version_declared={state['version_declared']})"
            )

            def complete(max_tokens: int = len(TARGET)) -> dict[str, Any]:
                return client.complete(PROMPT, max_tokens=max_tokens, temperature=0)

            before = complete()
            say(f"before training it answers: {before['choices'][0]['text']!r}")
            say(
                "\nEach step: the trainer learns for a while and saves a checkpoint; the worker pauses, "
                "loads it from disk, resumes, and answers the prompt again, stamped with the new version."
            )
            trainer = Trainer(config)
            last_text = before["choices"][0]["text"]
            with _progress(console) as progress:
                for n in range(1, steps + 1):
                    t0 = time.perf_counter()
                    loss = trainer.step(15, progress)
                    t_train = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    ckpt = save_checkpoint(
                        trainer.weights(), root / f"step-{n}", version=f"step-{n}", shard_bytes=32 << 20
                    )
                    t_save = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    client.pause_generation("wait")
                    upd = client.update_weights_from_disk(str(ckpt), weight_version=f"step-{n}")
                    client.resume_generation()
                    t_update = time.perf_counter() - t0
                    out = complete()
                    text = out["choices"][0]["text"]
                    say(
                        f"step {n}: trained to loss {loss:.3f}; saved {upd['stats']['files']} file(s) "
                        f"in {t_save:.2f} s; worker paused, loaded and resumed in {t_update * 1000:.0f} ms "
                        f"({upd['stats']['gb_per_s']} GB/s); it now serves {out['weight_version']!r} and answers:"
                    )
                    say(f"        {text!r}  \\[{'changed' if text != last_text else 'same'}]")
                    rows.append(
                        (
                            f"step-{n}",
                            f"{loss:.3f}",
                            f"{t_train:.2f}",
                            f"{t_update * 1000:.0f}",
                            "yes" if text != last_text else "no",
                        )
                    )
                    last_text = text

                # A bad checkpoint is refused up front: nothing changes.
                say("\nA corrupt checkpoint: the worker checks every file before it writes a single weight.")
                bad = root / "bad"
                bad.mkdir()
                (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
                client.pause_generation("wait")
                try:
                    client.update_weights_from_disk(str(bad), weight_version="bad")
                except WeightSyncError as exc:
                    say(f"corrupt checkpoint refused: HTTP {exc.http_status} {exc.code}")
                client.resume_generation()
                same = complete()["choices"][0]["text"] == last_text
                say(f"outputs byte-identical after the refused update: {same}")

                # Async RL: update while a long completion runs.
                say(
                    "\nAsync RL: new weights arrive while the worker is in the middle of a long answer. "
                    "It loads them beside the served copy and swaps between two tokens, without pausing, "
                    "and the answer says which version produced which tokens."
                )
                trainer.step(6, progress)
                ckpt = save_checkpoint(
                    trainer.weights(), root / "async", version=f"step-{steps + 1}", shard_bytes=32 << 20
                )
                result: dict[str, Any] = {}
                runner = threading.Thread(target=lambda: result.update(complete(max_tokens=150)))
                runner.start()
                time.sleep(0.5)
                upd = client.update_weights_from_disk(
                    str(ckpt), weight_version=f"step-{steps + 1}", allow_unpaused=True
                )
                runner.join()
                spans = result["weight_version_spans"]
                how = (
                    "loaded beside the served copy, then swapped"
                    if upd["stats"].get("staged")
                    else "loaded in place"
                )
                say(f"update while generating ({how}); the answer saw {len(spans)} version span(s):")
                for s in spans:
                    say(f"        {s['version']!r}: tokens {s['first_token']}–{s['last_token']}")

            table = Table(title="weightsync demo summary")
            for col in ("version", "train loss", "train s", "update ms", "answer changed"):
                table.add_column(col)
            for row in rows:
                table.add_row(*row)
            say(table)
            final = client.get_weight_version()
            generating = "generating" if not final["paused"] else "paused"
            intact = "its weights are one whole version" if not final["torn"] else "its weights are TORN"
            say(f"final state: serving {final['version']!r}, {generating}, {intact}")
            client.close()
    say(
        "\nTry next: `weightsync serve --model-config tiny` and the README's five-minute tour, "
        "or docs/trainer-guide.md to push weights from your own training loop."
    )
    return 0
