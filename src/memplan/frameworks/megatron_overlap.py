"""Megatron-LM's communication flags that allocate buffers, as a :class:`~memplan.job.CommOverlap`.

``--cp-comm-type`` picks Transformer Engine's context-parallel attention (its backward buffers);
``--overlap-moe-expert-parallel-comm`` the combined 1F1B schedule (with ``--delay-wgrad-compute`` and
``--ep-overlap-early-attn-memory-release``); ``--overlap-dispatch-backward-with-experts-wgrad`` and
``--moe-shared-expert-overlap`` the plain schedule's overlaps; ``--moe-flex-dispatcher-backend``
and its SM count the flex dispatcher's communication buffer (DeepEP's).

``--tp-comm-overlap`` makes Megatron call Transformer Engine's ``initialize_ub``
(megatron/training/initialize.py ``_initialize_tp_communicators``); ``--tp-comm-overlap-cfg`` names
a YAML of per-GEMM settings that Megatron passes on as ``ub_cfgs``. memplan reads the YAML when the
path can be opened from where memplan runs (a functional test's path is relative to a Megatron-LM
checkout) and otherwise prices Transformer Engine's default methods, saying so in the assumptions.
Of a GEMM's settings only ``method``, ``is_reduce_scatter`` and ``fp8_buf`` change its buffer; the
others (SMs, CGA size, splits, priorities, aggregation, ``use_ce``) schedule the same buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

from memplan.errors import ModelConfigError
from memplan.frameworks.megatron_model import flag_is_set
from memplan.job import UB_GEMMS, CommOverlap, CpCommType, UbOverride

__all__ = ["comm_overlap", "ub_overrides"]

_FLAG = "--tp-comm-overlap-cfg"
_METHODS = ("ring_exchange", "pipeline", "bulk", "external")
_BACKENDS = ("deepep", "hybridep", "ncclep")


def comm_overlap(args: Mapping[str, Any]) -> CommOverlap:
    """The communication machinery a Megatron launch sets up (TP userbuffers, CP comm types, EP overlap,
    the flex dispatcher's backend)."""
    return replace(_tp_overlap(args), cp_comm_types=_cp_comm_types(args),
                   ep_a2a=flag_is_set(args, "--overlap-moe-expert-parallel-comm"),
                   delay_wgrad=flag_is_set(args, "--delay-wgrad-compute"),
                   early_attn_release=flag_is_set(args, "--ep-overlap-early-attn-memory-release"),
                   experts_wgrad_overlap=flag_is_set(args, "--overlap-dispatch-backward-with-experts-wgrad"),
                   shared_expert_overlap=flag_is_set(args, "--moe-shared-expert-overlap"),
                   flex_backend=_flex_backend(args), flex_num_sms=_flex_num_sms(args))


def _flex_backend(args: Mapping[str, Any]) -> str:
    """``--moe-flex-dispatcher-backend`` (default deepep; the deprecated ``--moe-enable-deepep`` means deepep)."""
    backend = str(args.get("--moe-flex-dispatcher-backend", "deepep"))
    if backend not in _BACKENDS:
        raise ModelConfigError("--moe-flex-dispatcher-backend", f"must be one of {', '.join(_BACKENDS)}", backend)
    if flag_is_set(args, "--moe-enable-deepep"):
        # TransformerConfig.__post_init__ raises on both (DeepEP is a flex backend, and the only one then)
        dispatcher = str(args.get("--moe-token-dispatcher-type", "allgather"))
        if dispatcher != "flex":
            raise ModelConfigError("--moe-enable-deepep", "needs --moe-token-dispatcher-type flex (Megatron raises "
                                   "otherwise)", dispatcher)
        if backend != "deepep":
            raise ModelConfigError("--moe-enable-deepep", "cannot be combined with --moe-flex-dispatcher-backend "
                                   f"{backend} (Megatron raises: one flex backend)", backend)
    return backend


def _flex_num_sms(args: Mapping[str, Any]) -> int | None:
    """``--moe-flex-dispatcher-num-sms``, else the deprecated ``--moe-deepep-num-sms`` Megatron routes to it."""
    for flag in ("--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms"):
        value = args.get(flag)
        if value is not None and value is not True:
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ModelConfigError(flag, "must be an integer", value) from None
    return None


def _cp_comm_types(args: Mapping[str, Any]) -> tuple[str, ...]:
    """Megatron ``--cp-comm-type`` (nargs='+', default p2p): one type for every layer, or one per layer."""
    value = args.get("--cp-comm-type", "p2p")
    kinds = [str(v) for v in value] if isinstance(value, list) else str(value).split()
    for kind in kinds:
        if kind not in get_args(CpCommType):
            raise ModelConfigError("--cp-comm-type", f"must be one of {', '.join(get_args(CpCommType))}", kind)
    return tuple(kinds)


def _tp_overlap(args: Mapping[str, Any]) -> CommOverlap:
    if not flag_is_set(args, "--tp-comm-overlap"):
        return CommOverlap()
    fp8 = args.get("--fp8-format") is not None or isinstance(args.get("--fp8"), str)
    bf16_set = fp8 and flag_is_set(args, "--first-last-layers-bf16") and (
        _count(args, "--num-layers-at-start-in-bf16") > 0 or _count(args, "--num-layers-at-end-in-bf16") > 0)
    path = args.get(_FLAG)
    if path is None or path is True:
        return CommOverlap(tp=True, tp_config_note="Transformer Engine's default methods", tp_bf16_set=bf16_set)
    file = Path(str(path))
    if not file.is_file():
        note = f"{_FLAG} {path} not found where memplan runs: Transformer Engine's default methods priced"
        return CommOverlap(tp=True, tp_config_note=note, tp_bf16_set=bf16_set)
    import yaml

    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        raise ModelConfigError(_FLAG, "must be a readable YAML file", str(path)) from None
    return CommOverlap(tp=True, tp_overrides=ub_overrides(data, where=str(path)),
                       tp_config_note=f"methods from {path}", tp_bf16_set=bf16_set)


def _count(args: Mapping[str, Any], flag: str) -> int:
    """Megatron's ``--num-layers-at-start/end-in-bf16`` (default 1)."""
    value = args.get(flag, 1)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelConfigError(flag, "must be an integer", value) from None


def ub_overrides(data: Any, *, where: str) -> tuple[UbOverride, ...]:
    """The memory-relevant part of a ``ub_cfgs`` mapping (``{gemm: {method: ..., ...}}``), checked
    as Transformer Engine checks it."""
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise ModelConfigError(_FLAG, "must map GEMM names to their settings", where)
    out = []
    for name, entry in data.items():
        if name not in UB_GEMMS:
            raise ModelConfigError(_FLAG, f"names a GEMM Transformer Engine does not have (one of {', '.join(UB_GEMMS)})",
                                   name)
        if not isinstance(entry, Mapping):
            raise ModelConfigError(_FLAG, f"{name}: must be a mapping of settings", entry)
        method = entry.get("method")
        if method is not None and method not in _METHODS:
            raise ModelConfigError(_FLAG, f"{name}.method must be one of {', '.join(_METHODS)}", method)
        if method == "pipeline" and not entry.get("is_reduce_scatter", name in ("proj_fprop", "fc2_fprop")) \
                and name not in ("qkv_dgrad", "fc1_dgrad"):
            raise ModelConfigError(_FLAG, f"{name}: the pipeline method only reduce-scatters (Transformer Engine "
                                   "refuses it for an all-gather)", method)
        rs = entry.get("is_reduce_scatter")
        fp8 = entry.get("fp8_buf")
        out.append(UbOverride(name=str(name), method=method, is_reduce_scatter=None if rs is None else bool(rs),
                              fp8_buf=None if fp8 is None else bool(fp8)))
    given = {o.name: o for o in out}
    for dgrad in ("qkv_dgrad", "fc1_dgrad"):
        entry = given.get(dgrad)
        wgrad = dgrad.replace("dgrad", "wgrad")
        if entry is not None and entry.method not in (None, "bulk") and wgrad in given:
            raise ModelConfigError(_FLAG, f"cannot set {wgrad} when {dgrad} uses a non-bulk method (Transformer "
                                   "Engine refuses it)", entry.method)
    return tuple(out)
