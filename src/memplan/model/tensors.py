"""How many parameter *tensors* a model has (not elements): what per-tensor optimizer state costs.

PyTorch's fused (and capturable) Adam/AdamW keep one float32 ``step`` counter per parameter tensor
on the parameters' device (``torch/optim/adam.py``: ``_init_group`` creates ``state["step"]`` on
``p.device`` when ``fused or capturable``); the foreach and for-loop implementations keep it on the
host. The counts here equal ``len(list(model.parameters()))`` of the model ``transformers`` builds
from the same config (tested on every preset), as :mod:`memplan.model.params` does for elements.
Routed experts are counted as transformers 5 stores them: one stacked ``gate_up_proj`` (or
``gate_proj`` and ``up_proj``) and one ``down_proj`` per MoE layer, not one module per expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.model.attention_kinds import attention_kind

if TYPE_CHECKING:  # spec imports this module for its cached per-layer counts
    from memplan.model.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec

__all__ = ["layer_tensors", "model_tensors", "stage_tensors"]


def _mlp_tensors(mlp: MLPSpec) -> int:
    weights = (2 if mlp.fused_gate_up else 3) if mlp.gated else 2
    return weights * (2 if mlp.bias else 1)


def _experts_tensors(moe: MoESpec) -> int:
    """Routed experts, stacked: ``gate_up_proj`` (gated) or ``up_proj``, and ``down_proj``."""
    return 2 * (2 if moe.expert.bias else 1)


def _moe_tensors(moe: MoESpec) -> int:
    count = 1 + (1 if moe.router_bias and not moe.router_bias_is_buffer else 0)
    count += _experts_tensors(moe)
    if moe.shared_expert is not None:
        count += _mlp_tensors(moe.shared_expert) + (1 if moe.shared_expert_gate else 0)
    return count


def layer_tensors(layer: LayerSpec, norm_bias: bool) -> int:
    """Parameter tensors of one decoder layer (attention, MLP or MoE, and its norms)."""
    block = _mlp_tensors(layer.mlp) if layer.mlp is not None else _moe_tensors(layer.moe)  # type: ignore[arg-type]
    attn = layer.attention
    return attention_kind(attn).tensors(attn) + block + layer.num_hidden_norms * (2 if norm_bias else 1)


def stage_tensors(model: ModelSpec, layer_indices: tuple[int, ...], *, has_embedding: bool, has_head: bool) -> int:
    """Parameter tensors a pipeline stage holds: its layers, plus the embeddings on the first stage and
    the final norm and head on the last (a tied head away from the embedding is its own copy)."""
    per_layer = model.layer_tensor_counts
    count = sum(per_layer[i] for i in layer_indices)
    if has_embedding:
        count += 1 + (1 if model.position_embedding == "learned" else 0)
    if has_head:
        count += (2 if model.norm_bias else 1) + (0 if model.tie_word_embeddings and has_embedding else 1)
    return count


def model_tensors(model: ModelSpec) -> int:
    """Parameter tensors of the whole model: embeddings, position table, layers, final norm, head."""
    return stage_tensors(model, tuple(range(model.num_layers)), has_embedding=True, has_head=True)
