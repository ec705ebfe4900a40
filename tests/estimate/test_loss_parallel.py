"""DTensor's loss parallelism (memplan.estimate.loss_parallel) against a trace of the real thing.

The witness: torchtitan's loss (``cross_entropy(pred.flatten(0, 1).float(), labels, reduction="sum")``)
on vocabulary-sharded DTensor logits inside ``loss_parallel()``, forward and backward, on memplan's
simulated TP ranks (fake process group, fake tensors, every allocation of rank 0 recorded). The
estimator's loss-phase buffers of the same job must match the traced peak above what was alive before.
"""

from __future__ import annotations

import pytest

from memplan.estimate import estimate
from memplan.job import Batch, Job, Parallelism
from memplan.model import load_preset

torch = pytest.importorskip("torch")


def _traced_loss_peak(tokens: int, vocab: int, tp: int) -> tuple[int, int]:
    """(peak bytes above the start, bytes of one logits shard element count) of the loss's forward and
    backward on rank 0: the head's bf16 output shard made, the model output dropped before the backward
    (torchtitan's ``del pred``), as a training loop runs it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from memplan.trace.core.distributed import simulated_ranks
    from memplan.trace.core.recorder import AllocationRecorder
    from memplan.trace.core.tracker import TracingFakeMode
    from memplan.trace.setup import trace_setup

    mode = TracingFakeMode(allow_non_fake_inputs=True)
    recorder = AllocationRecorder()
    with simulated_ranks(trace_setup(tp=tp, gpus=tp)) as mesh, mode:
        head_input = torch.empty(1, tokens, vocab // tp, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        mode.recorder = recorder
        local = head_input * 1  # the head's output shard (the matmul's, here a copy of the same size)
        pred = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                     reduction="sum")
            del pred, local
            loss.backward()
        mode.recorder = None
    live = peak = 0
    for event in recorder.events(drop_host=False):
        live += event.size if event.is_alloc else -event.size
        peak = max(peak, live)
    return peak, tokens * (vocab // tp)


@pytest.mark.parametrize(("tp", "seq"), [(2, 512), (4, 1024), (8, 256)])
def test_estimated_loss_buffers_match_the_traced_dtensor_loss(tp: int, seq: int) -> None:
    model = load_preset("llama-3.2-1b")
    job = Job(framework="torchtitan", parallel=Parallelism(world_size=tp, tp=tp),
              batch=Batch(micro_batch_size=1, seq_length=seq))
    stage = estimate(model, job).stages[-1]
    traced, elements = _traced_loss_peak(seq, model.vocab_size, tp)
    assert traced == pytest.approx(16 * elements, rel=0.01)  # four fp32 shard-sized tensors in the backward
    assert stage.loss_logits_bytes == pytest.approx(traced, rel=0.01)


def test_without_tp_or_under_hf_the_plain_loss_is_priced() -> None:
    model = load_preset("llama-3.2-1b")
    batch = Batch(micro_batch_size=1, seq_length=512)
    one = estimate(model, Job(framework="torchtitan", batch=batch)).stages[-1]
    assert one.loss_logits_bytes == 12 * 512 * model.vocab_size  # ATen's fused backward: three fp32
    hf = estimate(model, Job(framework="hf", parallel=Parallelism(world_size=2, tp=2), batch=batch))
    assert not any("loss parallelism" in a for a in hf.assumptions)
    tt = estimate(model, Job(framework="torchtitan", parallel=Parallelism(world_size=2, tp=2), batch=batch))
    assert any("loss parallelism (DTensor loss_parallel" in a for a in tt.assumptions)
