"""One contract per weight channel, run against every engine (zarr's ``StoreTests``).

Each base class holds the tests a channel owes every engine: a bad source is a 4xx refusal
that leaves the served weights untouched, a good one is loaded bit for bit (the hashes the
worker reports are those of the tensors sent), a dry run writes nothing, and a failure after
the first write leaves the worker torn.  A subclass per engine supplies ``served``: a real
``weightsync serve`` worker on that engine (see ``test_reference.py`` and ``test_vllm.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.helpers import WorkerProcess
from weightsync.core import errors
from weightsync.trainer import WorkerClient, save_checkpoint, share_tensors
from weightsync.transports.disk import DiskCheckpoint
from weightsync.transports.hashing import tensor_hashes


@attrs.define
class Served:
    """A running worker, the checkpoint directory it may read, and what it serves."""

    worker: WorkerProcess
    client: WorkerClient
    root: Path
    original: dict[str, torch.Tensor]  # a complete set of weights it can be reset to
    specs: list[tuple[str, str, list[int]]] = attrs.field(factory=list)
    saved: int = 0

    def __attrs_post_init__(self) -> None:
        info = self.client.weight_info()
        self.specs = list(zip(info["names"], info["dtypes"], info["shapes"], strict=True))

    def new_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """A complete set of weights unlike any served before (same names, dtypes, shapes)."""
        gen = torch.Generator().manual_seed(seed)
        return {n: (torch.randn(s, generator=gen) * 0.02).to(getattr(torch, d)) for n, d, s in self.specs}

    def checkpoint(self, weights: dict[str, torch.Tensor], **options: Any) -> Path:
        self.saved += 1
        return save_checkpoint(weights, self.root / f"ckpt-{self.saved}", **options)

    def hashes(self) -> dict[str, str]:
        """What the worker reports it serves: the hash of every tensor it was loaded from."""
        return dict(self.client.engine_rpc("weight_hashes")["result"])

    def state(self) -> dict[str, Any]:
        return dict(self.client.get_weight_version())

    def close(self) -> None:
        self.client.close()
        self.worker.stop()


def refused(call: Any, status: int, code: str) -> None:
    with pytest.raises(errors.WeightSyncError) as err:
        call()
    assert (err.value.http_status, err.value.code) == (status, code), err.value


class ChannelContract:
    """What every channel × engine pair shares: a paused, untorn worker around each test."""

    @pytest.fixture
    def paused(self, served: Served) -> Iterator[Served]:
        served.client.pause_generation()
        yield served
        if served.state()["torn"]:
            served.client.update_weights_from_disk(str(served.checkpoint(served.original)))
        served.client.resume_generation()

    @staticmethod
    def assert_untouched(served: Served, before: dict[str, str]) -> None:
        assert served.hashes() == before, "a refused update changed the served weights"
        assert not served.state()["torn"]


class DiskContract(ChannelContract):
    def test_a_checkpoint_loads_bit_exactly(self, paused: Served) -> None:
        new = paused.new_weights(seed=11)
        reply = paused.client.update_weights_from_disk(str(paused.checkpoint(new)), weight_version="disk")
        assert reply["version"] == "disk" and paused.hashes() == tensor_hashes(new.items())

    @pytest.mark.parametrize(
        ("case", "status", "code"),
        [("missing", 404, "path_not_found"), ("shape", 400, "shape_mismatch"),
         ("truncated", 400, "corrupt_checkpoint"), ("outside", 400, "path_not_allowed")],
    )  # fmt: skip
    def test_a_bad_checkpoint_is_refused_before_any_write(
        self, paused: Served, tmp_path: Path, case: str, status: int, code: str
    ) -> None:
        new = paused.new_weights(seed=12)
        if case == "missing":
            path = paused.root / "nothing-here"
        elif case == "shape":
            name = next(iter(new))
            path = paused.checkpoint({**new, name: torch.zeros(3, 5, dtype=new[name].dtype)})
        elif case == "truncated":
            path = paused.checkpoint(new)
            shard = sorted(path.glob("*.safetensors"))[-1]
            with shard.open("r+b") as f:
                f.truncate(shard.stat().st_size - 4)
        else:
            path = save_checkpoint(new, tmp_path / "elsewhere")
        before = paused.hashes()
        refused(lambda: paused.client.update_weights_from_disk(str(path)), status, code)
        self.assert_untouched(paused, before)

    def test_a_dry_run_writes_nothing_and_names_the_digest(self, paused: Served) -> None:
        path = paused.checkpoint(paused.new_weights(seed=13))
        before = paused.hashes()
        reply = paused.client.update_weights_from_disk(str(path), dry_run=True)
        assert reply["dry_run"] is True and reply["digest"] is not None
        self.assert_untouched(paused, before)

    def test_a_tensor_that_differs_from_its_manifest_hash_is_refused_before_any_write(
        self, paused: Served
    ) -> None:
        new = paused.new_weights(seed=14)
        path = paused.checkpoint(new)
        # The files still match their checksums; the last tensor no longer matches its
        # manifest hash.  The verification pass before the first write hashes every tensor,
        # so this is a clean refusal, not a torn worker.
        last = list(DiskCheckpoint.open(str(path)).entries)[-1].spec.name
        manifest = json.loads((path / "weightsync-manifest.json").read_text())
        manifest["tensors"][last] = "0" * 16
        (path / "weightsync-manifest.json").write_text(json.dumps(manifest))
        before = paused.hashes()
        with pytest.raises(errors.WeightSyncError) as err:
            paused.client.update_weights_from_disk(str(path))
        assert err.value.http_status == 400 and err.value.code == "manifest_mismatch", err.value
        assert not paused.state()["torn"]
        self.assert_untouched(paused, before)


class SharedMemoryContract(ChannelContract):
    def test_shared_tensors_load_bit_exactly(self, paused: Served) -> None:
        new = paused.new_weights(seed=21)
        with share_tensors(new) as shared:
            paused.client.update_weights_from_tensor(shared.tensors, weight_version="shm")
        assert paused.hashes() == tensor_hashes(new.items())

    @pytest.mark.parametrize(
        ("case", "status", "code"),
        [("second_out_of_bounds", 400, "invalid_value"), ("second_missing", 404, "segment_not_found"),
         ("shape", 400, "shape_mismatch"), ("fnuz_dtype", 400, "dtype_mismatch")],
    )  # fmt: skip
    def test_a_bad_handle_anywhere_is_refused_before_any_write(
        self, paused: Served, case: str, status: int, code: str
    ) -> None:
        """The drift issue 10 names: a bad *second* handle (the first is good) must be refused
        before the first tensor is copied, by every engine."""
        new = paused.new_weights(seed=22)
        before = paused.hashes()
        with share_tensors(new) as shared:
            tensors = [dict(t) for t in shared.tensors]
            second = tensors[1]
            if case == "second_out_of_bounds":
                second["handle"] = {"shm": shared.shm.name, "offset": shared.shm.size}
            elif case == "second_missing":
                second["handle"] = {"shm": "weightsync_no_such_segment", "offset": 0}
            elif case == "shape":
                second["shape"] = [*second["shape"], 1]
            else:
                second["dtype"] = "float8_e4m3fnuz"
            refused(lambda: paused.client.update_weights_from_tensor(tensors), status, code)
        self.assert_untouched(paused, before)

    def test_a_dry_run_writes_nothing(self, paused: Served) -> None:
        before = paused.hashes()
        with share_tensors(paused.new_weights(seed=23)) as shared:
            reply = paused.client.update_weights_from_tensor(shared.tensors, dry_run=True)
        assert reply["dry_run"] is True
        self.assert_untouched(paused, before)


class DistributedContract(ChannelContract):
    """What a broadcast can be held to without a trainer: the group and the metadata are
    checked before any collective."""

    def test_an_unknown_group_is_refused(self, paused: Served) -> None:
        n, d, s = paused.specs[0]
        before = paused.hashes()
        refused(
            lambda: paused.client.update_weights_from_distributed([n], [d], [s], "no-such-group"),
            404,
            "unknown_group",
        )
        self.assert_untouched(paused, before)

    def test_a_dry_run_of_an_unknown_group_is_refused(self, paused: Served) -> None:
        n, d, s = paused.specs[0]
        refused(
            lambda: paused.client.update_weights_from_distributed(
                [n], [d], [s], "no-such-group", dry_run=True
            ),
            404,
            "unknown_group",
        )
