"""A LoRA adapter's ``adapter_config.json`` (PEFT's ``LoraConfig``), read without trusting it.

What the config says changes what the adapter computes: each targeted linear layer ``W`` of
the base serves ``W x + s · B A x`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``).  So :class:`AdapterConfig` keeps exactly the fields that change that math
(``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``), and the adapter's digest covers
them beside the A/B matrices (:mod:`.digest`).  The scale is a property of the config, never
folded into the matrices: whoever stages an adapter stages raw A and B and applies
:attr:`AdapterConfig.scale` once, in the forward pass.

Every other field PEFT writes is sorted by the table below into one of two kinds:

* :data:`INERT` — training or bookkeeping only (dropout, initialisation, the base model's
  name): read, then ignored, whatever its value;
* :data:`NEUTRAL` — a feature that changes the math in a way this reader does not apply
  (DoRA, biases, per-module ranks, whole modules saved beside the adapter…): accepted only at
  its neutral value, refused (``unsupported_adapter_config``) otherwise.

A field in neither is refused (``unknown_adapter_config_field``): a new PEFT feature must not be
served as if it were plain LoRA.  Pure Python: the trainer and the worker read configs alike.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.core.validation import short, type_name

MAX_RANK: Final = 1 << 14
MAX_TARGETS: Final = 1024
_TARGET: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,255}")

INERT: Final = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "task_type",
        "inference_mode",
        "lora_dropout",
        "auto_mapping",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "peft_version",
        "exclude_modules",
        "layers_pattern",
        "qalora_group_size",
        "ensure_weight_tying",
    }
)
"""Fields that do not change what a trained adapter computes (an initialisation's own settings
count only through ``init_lora_weights``, which is :data:`NEUTRAL`)."""

_EMPTY: Final[tuple[Any, ...]] = (None, {}, [])
NEUTRAL: Final[dict[str, tuple[Any, ...]]] = {
    "peft_type": ("LORA",),
    "bias": ("none",),
    # PiSSA, OLoRA, LoftQ, CorDA, EVA, LoRA-GA… initialise by rewriting the base weights too
    "init_lora_weights": (True, False, "gaussian"),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "rank_pattern": _EMPTY,
    "alpha_pattern": _EMPTY,
    "modules_to_save": _EMPTY,
    "target_parameters": _EMPTY,
    "layers_to_transform": (None,),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
    "alora_invocation_tokens": (None,),
    "megatron_config": (None,),
    "arrow_config": (None,),
    "kasa_config": (None,),
    "monteclora_config": (None,),
    "velora_config": (None,),
}
"""Fields this reader accepts only at one of these values (compared with their JSON type:
``0`` is not ``false``)."""

MATH: Final = ("r", "lora_alpha", "target_modules", "use_rslora")


def bad_config(why: str, field: str | None = None) -> InvalidRequest:
    """The refusal of a config that is not a LoRA config at all (``bad_adapter_config``)."""
    extra = {"config_field": field} if field is not None else {}
    return InvalidRequest(f"adapter_config.json: {why}", code="bad_adapter_config", **extra)


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral


def _rank(value: Any) -> int:
    if type(value) is not int or not 1 <= value <= MAX_RANK:
        raise bad_config(f"r must be an integer in [1, {MAX_RANK}], got {short(value)}", "r")
    return value


def _alpha(value: Any) -> float:
    if type(value) not in (int, float) or not (0 < value < math.inf):
        raise bad_config(f"lora_alpha must be a positive number, got {short(value)}", "lora_alpha")
    return float(value)


def _targets(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # PEFT's regular expression (or "all-linear"): not matched here
        raise InvalidRequest(
            f"adapter_config.json: target_modules is the pattern {short(value)}; list the module names",
            code="unsupported_adapter_config",
            config_field="target_modules",
        )
    if type(value) is not list or not value or len(value) > MAX_TARGETS:
        raise bad_config(
            f"target_modules must be a list of 1 to {MAX_TARGETS} module names, got {type_name(value)}",
            "target_modules",
        )
    for name in value:
        if type(name) is not str or not _TARGET.fullmatch(name):
            raise bad_config(f"target_modules holds {short(name)}, not a module name", "target_modules")
    return tuple(sorted(set(value)))


@attrs.frozen
class AdapterConfig:
    """The fields of a LoRA config that change what it computes (see the module docstring)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """The factor of ``B A x``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, module: str) -> bool:
        """Whether ``module`` (a dotted path) is targeted: PEFT's rule for a list of names, the
        whole path or its last components equal to one of them."""
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def canonical(self) -> str:
        """The math fields as canonical JSON (sorted keys, ``lora_alpha`` a float): what the
        digest covers."""
        return json.dumps(
            {
                "r": self.r,
                "lora_alpha": self.lora_alpha,
                "target_modules": list(self.target_modules),
                "use_rslora": self.use_rslora,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def to_json(self) -> dict[str, Any]:
        """The ``adapter_config.json`` a trainer writes for this config (PEFT's field names)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "use_dora": False,
            "fan_in_fan_out": False,
            "lora_dropout": 0.0,
            "inference_mode": True,
        }

    @classmethod
    def from_json(cls, value: Any) -> AdapterConfig:
        """The config a parsed ``adapter_config.json`` describes.

        Raises ``InvalidRequest``: ``bad_adapter_config`` (not an object, a math field missing,
        of the wrong type or out of range), ``unknown_adapter_config_field`` (a field neither
        :data:`MATH`, :data:`INERT` nor :data:`NEUTRAL`), ``unsupported_adapter_config`` (a
        :data:`NEUTRAL` field at another value, ``target_modules`` as a pattern)."""
        if not isinstance(value, dict):
            raise bad_config(f"the config is {type_name(value)}, not an object")
        for field in value:
            if field in MATH or field in INERT:
                continue
            if field not in NEUTRAL:
                raise InvalidRequest(
                    f"adapter_config.json: unknown field {short(field)}: a feature this worker does not "
                    "know may change what the adapter computes",
                    code="unknown_adapter_config_field",
                    config_field=field[:200],
                )
            if not any(_same(value[field], neutral) for neutral in NEUTRAL[field]):
                raise InvalidRequest(
                    f"adapter_config.json: {field}={short(value[field])} changes the adapter's math in a way "
                    f"this worker does not apply (accepted: {list(NEUTRAL[field])})",
                    code="unsupported_adapter_config",
                    config_field=field,
                )
        for field in ("r", "lora_alpha", "target_modules"):
            if field not in value:
                raise bad_config(f"missing {field}", field)
        rslora = value.get("use_rslora", False)
        if type(rslora) is not bool:
            raise bad_config(f"use_rslora must be a boolean, got {short(rslora)}", "use_rslora")
        return cls(_rank(value["r"]), _alpha(value["lora_alpha"]), _targets(value["target_modules"]), rslora)

    @classmethod
    def of(cls, config: AdapterConfig | dict[str, Any]) -> AdapterConfig:
        """``config`` itself, or the config a PEFT-shaped dict describes (:meth:`from_json`)."""
        return config if isinstance(config, AdapterConfig) else cls.from_json(config)
