"""The reserved-memory schedule's mechanics (issue 25, item 8): trainable tensors, the foreach step's
temporaries, the root's gradients and autocast's weight copies, each checked on the schedule itself."""

from __future__ import annotations

from typing import Any

import pytest

from memplan import estimate, load_model
from memplan.estimate import reserved_replay
from memplan.estimate.autocast import autocast_weight_copy_numel
from memplan.estimate.context import run_context, stage_context
from memplan.estimate.engine import _stages
from memplan.estimate.layout import pipeline_layout
from memplan.estimate.reserved_autocast import layer_weight_copies
from memplan.estimate.reserved_optimizer import MAX_ROUNDS, foreach_temporaries
from memplan.estimate.reserved_root import finish_root, root_gradients
from memplan.estimate.reserved_trainable import trainable_units
from memplan.estimate.terms import Term, TermRole
from memplan.jobflags import build_job

MiB = 2**20


def _schedule(model_name: str, flags: dict[str, object]) -> list[tuple[str, object]]:
    """The schedule's events of one estimate: ("take", size), ("give", size), ("moment", phase)."""
    events: list[tuple[str, object]] = []
    real_finish = reserved_replay.Replay.finish

    def finish(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.extend(self.log())
        return real_finish(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reserved_replay.Replay, "finish", finish)
        _stages.cache_clear()
        estimate(load_model(model_name), build_job(flags), reserved="simulated")
    return events


def _traced_backward(config: str, flags: dict[str, object], names: dict[int, str]) -> list[str]:
    """The second step's backward of a memplan trace of ``config`` (AdamW, 2 iterations) as "+X" / "-X" per
    allocation and free of a size in ``names`` (X its name)."""
    pytest.importorskip("transformers")
    from memplan.trace import trace

    result = trace(config, **flags, optimizer="adamw", device="cuda", iterations=2)  # type: ignore[arg-type]
    sizes: dict[int, int] = {}
    out = []
    for event in result.trace.events:
        if event.kind == "alloc":
            sizes[event.block] = event.size
        size = sizes.get(event.block, 0)
        if event.iteration == 1 and event.phase == "backward" and size in names:
            out.append(("+" if event.kind == "alloc" else "-") + names[size])
    return out


def _scheduled_backward(config: str, flags: dict[str, object], names: dict[int, str]) -> list[str]:
    """The schedule's second step from the loss to the end of the backward, as :func:`_traced_backward`."""
    events = _schedule(config, flags)
    start = [i for i, e in enumerate(events) if e == ("moment", "loss")][1]
    end = [i for i, e in enumerate(events) if e == ("moment", "end of backward")][1]
    return [("+" if kind == "take" else "-") + names[size] for kind, size in events[start:end]  # type: ignore[index]
            if kind in ("take", "give") and size in names]


def replayed_estimate(model_name: str, flags: dict[str, object]) -> tuple[list[reserved_replay.Replay], Any]:
    """One simulated estimate of ``model_name`` under ``flags`` and its stages' schedules (their replays, kept)."""
    replays: list[reserved_replay.Replay] = []
    real_finish = reserved_replay.Replay.finish

    def finish(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        replays.append(self)
        return real_finish(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reserved_replay.Replay, "finish", finish)
        _stages.cache_clear()
        result = estimate(load_model(model_name), build_job(flags), reserved="simulated")
    return replays, result


def _ctx(model_name: str, flags: dict[str, object]):  # type: ignore[no-untyped-def]
    model, job = load_model(model_name), build_job(flags)
    run = run_context(model, job, 0.1)
    layout = pipeline_layout(model.num_layers, job.parallel, job.num_microbatches, run.profile.pipeline_split)[0]
    return stage_context(run, layout)


def test_lora_gradients_are_the_adapters_and_the_copies_not_the_base_tensors() -> None:
    """modules_to_save copies of the embedding and head are two vocabulary-sized tensors in the base dtype;
    each adapted linear has lora_A and lora_B in the adapter dtype (fp32); frozen base tensors have none."""
    flags = {"seq": 1024, "framework": "hf", "peft": "lora", "lora_rank": 64, "lora_targets": "all-linear",
             "modules_to_save": "embed_tokens,lm_head"}
    ctx = _ctx("qwen2.5-7b", flags)
    model = ctx.model
    units = trainable_units(ctx, list(ctx.layout.layer_indices))
    assert units is not None and len(units) == 1 + len(ctx.layout.layer_indices)
    vocab = model.vocab_size * model.hidden_size * 2
    assert sorted(units[0])[-2:] == [vocab, vocab]
    h = model.hidden_size
    assert 64 * h * 4 in units[1]  # q_proj's lora_A, fp32
    assert len(units[1]) == 2 * 7  # q k v o gate up down: lora_A and lora_B each
    assert trainable_units(_ctx("qwen2.5-7b", {"seq": 1024}), [0]) is None  # full training: the base tensors


def test_foreach_temporaries_are_rounds_of_one_state_per_tensor() -> None:
    states = [[10], [4, 6]]
    assert foreach_temporaries(20, states) == [[10], [4, 6]]
    assert foreach_temporaries(25, states) == [[10, 5], [4, 6]]  # a second, partial round
    assert foreach_temporaries(0, states) == [[], []]
    assert foreach_temporaries(20 * MAX_ROUNDS + 1, states) is None  # not a foreach step's layout
    assert foreach_temporaries(5, [[], []]) is None


class _Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def take(self, size: int) -> object:
        self.log.append(("take", size))
        return ("block", size)

    def give(self, *blocks: object) -> None:
        self.log.extend(("give", b[1]) for b in blocks if b is not None)  # type: ignore[index]


def test_tied_root_gradients_sum_the_head_and_embedding_gradients() -> None:
    root = root_gradients([5, 100, 1], has_head=True, tied=True)
    assert (root.head, root.rest) == (100, [5, 1])
    replay = _Recorder()
    alive, summed = finish_root(replay, root, ("block", 100))
    assert replay.log == [("take", 100), ("take", 100), ("take", 5), ("take", 1)]
    assert [b[1] for b in alive] == [100, 5, 1] and [b[1] for b in summed] == [100, 100]  # type: ignore[index]
    untied = root_gradients([100, 1, 100], has_head=True, tied=False)
    assert untied.head == 100 and untied.rest == [1, 100]
    assert root_gradients([7], has_head=False, tied=False).head == 0


def test_the_heads_gradient_is_made_after_the_loss_and_kept_through_the_backward() -> None:
    """llama-3.2-1b (tied): the fp32 head gradient is taken right after the loss moment, before any layer's
    backward, and the embedding's gradient and their sum come at the end of the backward."""
    model = load_model("llama-3.2-1b")
    head = model.vocab_size * model.hidden_size * 4
    events = _schedule("llama-3.2-1b", {"seq": 1024, "precision": "bf16-mixed", "framework": "hf"})
    loss = max(i for i, e in enumerate(events) if e == ("moment", "loss"))
    end = max(i for i, e in enumerate(events) if e == ("moment", "end of backward"))
    heads = [i for i, e in enumerate(events) if e == ("take", head) and loss < i < end]
    assert len(heads) == 3 and heads[0] < loss + 12 and heads[1] > end - 8  # head; embedding and sum at the end
    assert events[end + 1:end + 3] == [("give", head), ("give", head)]  # the pair, once the moment counted it


def test_autocast_copies_are_made_in_each_kept_layers_forward() -> None:
    flags = {"seq": 1024, "precision": "bf16-mixed", "recompute": "full", "recompute_method": "block",
             "recompute_layers": 4, "framework": "hf"}
    ctx = _ctx("llama-3.2-1b", flags)
    layers = list(ctx.layout.layer_indices)
    copies = layer_weight_copies(ctx, layers)
    run = ctx.run
    total = autocast_weight_copy_numel(run.model, run.job, ctx.layout, recomputed=set(ctx.recomputed),
                                       policy=run.policy.kind, eager_experts=False, modules=run.policy.modules)
    assert sum(map(sum, copies)) == 2 * total > 0
    assert all(not copies[i] for i in range(len(layers)) if layers[i] in ctx.recomputed)
    assert len(copies[-1]) == 7  # one per linear weight
    assert layer_weight_copies(_ctx("llama-3.2-1b", {"seq": 1024, "precision": "fp32"}), layers) == [[]] * len(layers)


def test_the_heads_autocast_copy_lives_from_the_head_to_its_backward() -> None:
    """Under autocast the output head's 16-bit weight copy is made after the last layer (at the head) and
    freed at the head's backward, before the head's gradient, not held from the first layer on."""
    model = load_model("llama-3.2-1b")
    copy = model.vocab_size * model.hidden_size * 2
    events = _schedule("llama-3.2-1b", {"seq": 1024, "precision": "bf16-mixed", "framework": "hf"})
    forward = max(i for i, e in enumerate(events) if e == ("moment", "forward"))
    loss = max(i for i, e in enumerate(events) if e == ("moment", "loss"))
    made = max(i for i, e in enumerate(events[:forward]) if e == ("take", copy))
    assert events[made + 1] == ("moment", "forward")
    freed = next(i for i in range(loss, len(events)) if events[i][0] == "give" and events[i][1] >= copy // 2
                 and abs(events[i][1] - copy) < 2 * 2**20)
    head_grad = next(i for i in range(loss, len(events)) if events[i] == ("take", 2 * copy))
    assert loss < freed < head_grad


def test_the_sentence_names_the_mechanics_that_shaped_the_schedule() -> None:
    model = load_model("llama-3.2-1b")
    _stages.cache_clear()
    lora = estimate(model, build_job({"seq": 1024, "framework": "hf", "peft": "lora"}), reserved="simulated")
    mixed = estimate(model, build_job({"seq": 1024, "framework": "hf"}), reserved="simulated")
    fp32 = estimate(model, build_job({"seq": 1024, "framework": "hf", "precision": "fp32"}), reserved="simulated")

    def sentence(est: object) -> str:
        notes = est.assumptions  # type: ignore[attr-defined]
        return next(a for a in notes if a.startswith("reserved = the caching-allocator"))

    assert "only for the trainable tensors" in sentence(lora) and "only for the trainable" not in sentence(mixed)
    assert "autocast" in sentence(mixed) and "autocast" not in sentence(fp32)
    assert "tied embedding" in sentence(mixed)


def test_lumped_terms_are_split_into_the_tensors_a_forward_makes() -> None:
    """HF's gated MLP saves gate_proj(x), act(gate) and up_proj(x) as three intermediate-sized tensors (phi-3's
    fused gate_up_proj one tensor of both halves); a norm output cast for N linears is N copies; q, k, v are
    three tensors in proportion to their widths. Every split adds up to its term."""
    from memplan.estimate.activations import divided, layer_terms
    from memplan.estimate.reserved_terms import term_tensors

    from pathlib import Path

    phi3 = str(Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "phi-3-mini.json")
    for name, expect_fc1 in (("llama-3.2-1b", 3), (phi3, 2)):
        ctx = _ctx(name, {"seq": 1024, "precision": "bf16-mixed", "framework": "hf"})
        run, layer = ctx.run, ctx.run.model.layers[0]
        one = 1024 * layer.mlp.intermediate_size * 2
        terms = layer_terms(layer, run.shape)
        split = {t.name: term_tensors(t, divided(t, run.shape), layer, run) for t in terms}
        for t in terms:
            assert sum(split[t.name]) == divided(t, run.shape)
        fc1 = split["mlp fc1 output (activation input)"]
        assert len(fc1) == expect_fc1 and fc1[-1] == one
    llama = _ctx("llama-3.2-1b", {"seq": 1024, "precision": "bf16-mixed", "framework": "hf"})
    attn = llama.run.model.layers[0].attention
    qkv = Term("q, k, v", 0, "tp", "attn", role=TermRole.QKV)
    q, k, v = term_tensors(qkv, 12 * 2**20, llama.run.model.layers[0], llama.run)
    assert q == 4 * k == 4 * v == attn.num_heads // attn.num_kv_heads * k
    copies = term_tensors(Term("attention norm output, autocast copies of the other 2 GEMMs", 0, "sp", "attn",
                               role=TermRole.NORM_COPIES, tensors=2), 10, llama.run.model.layers[0], llama.run)
    assert copies == [5, 5]
    softmax = Term("softmax output (fp32)", 0, "tp", "core", role=TermRole.SOFTMAX_FP32)
    assert term_tensors(softmax, 7, llama.run.model.layers[0], llama.run) == [7]


def test_an_eager_softmax_backward_runs_in_the_space_the_mlp_block_left() -> None:
    """HF eager attention: the layer's backward frees the MLP block's tensors, the output projection's input
    and the 16-bit probabilities, then makes two fp32 gradients of the probabilities and casts the result
    back to bf16 (a trace's _to_copy 4 B/score, _softmax_backward_data 4 B, _to_copy 2 B), the layer's
    other saved tensors freed after; what it frees first is what the ledger's transient already nets."""
    from memplan.estimate.activations import divided, layer_terms
    from memplan.estimate.layer_costs import layer_costs
    from memplan.estimate.reserved_backward import eager_backward, early_terms

    flags = {"seq": 2048, "precision": "bf16-mixed", "attention": "eager", "framework": "hf"}
    ctx = _ctx("llama-3.2-1b", flags)
    run, layer = ctx.run, ctx.run.model.layers[3]
    transient = layer_costs(run, layer, 3)[2]
    plan = eager_backward(layer, run, transient)
    assert plan is not None and plan.fp32 == 32 * 2048 * 2048 * 4 and plan.scores == plan.fp32 // 2
    early = sum(divided(t, run.shape) for t, e in zip(layer_terms(layer, run.shape), early_terms(layer, run)) if e)
    assert 2 * plan.fp32 - early == transient
    events = _schedule("llama-3.2-1b", flags)
    # op by op (reserved_attention_backward): the upcast, the 16-bit gradient freed, the softmax backward's
    # result, the upcast and the saved fp32 softmax output freed, the cast back
    pattern = [("take", plan.fp32), ("give", plan.scores), ("take", plan.fp32), ("give", plan.fp32),
               ("give", plan.fp32), ("take", plan.scores)]
    starts = [i for i in range(len(events)) if events[i:i + 6] == pattern]
    # every layer of both steps, but the last (the ledger's backward moment sits between its takes)
    assert len(starts) == 2 * (run.model.num_layers - 1)
    # before each softmax backward the MLP's tensors were freed: no take between them and the upcast
    assert all(events[i - 1][0] == "give" for i in starts)
    sdpa = _ctx("llama-3.2-1b", {**flags, "attention": "sdpa"})
    assert eager_backward(sdpa.run.model.layers[3], sdpa.run, layer_costs(sdpa.run, layer, 3)[2]) is None
    assert eager_backward(layer, run, transient + 1) is None
    _stages.cache_clear()
    est = estimate(load_model("llama-3.2-1b"), build_job(flags), reserved="simulated")
    assert any("softmax backward" in a for a in est.assumptions)
    _stages.cache_clear()
    est = estimate(load_model("llama-3.2-1b"), build_job({**flags, "attention": "sdpa"}), reserved="simulated")
    assert not any("softmax backward" in a for a in est.assumptions)


def test_a_soft_capped_loss_makes_its_16_bit_chain_around_the_fp32_cross_entropy() -> None:
    """Gemma 2's cap * tanh(logits / cap): forward the logits, the quotient, tanh (saved), the capped logits,
    then the fp32 upcast and log-softmax; backward the two fp32 gradients, then one 16-bit tensor per op
    back down the chain (a trace's _to_copy, mul, tanh_backward, div). Without a soft cap: no chain."""
    from pathlib import Path

    gemma = str(Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "gemma-2-2b.json")
    flags = {"seq": 1024, "precision": "bf16", "attention": "eager", "recompute": "full", "framework": "hf"}
    ctx = _ctx(gemma, flags)
    one = 1024 * ctx.run.vocab_rows * 4
    half = one // 2
    events = _schedule(gemma, flags)
    start = events.index(("moment", "forward"))
    end = events.index(("moment", "backward"), start)
    takes = [size for kind, size in events[start:end] if kind == "take" and size in (one, half)]
    assert takes == [half, half, half, half, one, one, one, one, half, half, half, half]
    loss_at = events.index(("moment", "loss"), start)
    assert [kind for kind, _ in events[loss_at - 2:loss_at]] == ["take", "take"]  # the two fp32 gradients
    plain = _schedule("llama-3.2-1b", {"seq": 1024, "precision": "bf16", "framework": "hf"})
    start = plain.index(("moment", "forward"))
    loss_at = plain.index(("moment", "loss"), start)
    assert sum(kind == "take" for kind, _ in plain[start:loss_at]) == 5  # 16-bit, upcast, saved, two gradients
    _stages.cache_clear()
    est = estimate(load_model(gemma), build_job(flags), reserved="simulated")
    assert any("soft-capped logits" in a for a in est.assumptions)
    _stages.cache_clear()
    est = estimate(load_model("llama-3.2-1b"), build_job({"seq": 1024, "framework": "hf"}), reserved="simulated")
    assert not any("soft-capped logits" in a for a in est.assumptions)


def test_under_autocast_a_pre_norms_fp32_output_lives_until_its_block_ends() -> None:
    """HF's RMSNorm under torch.autocast returns its output in the fp32 residual dtype; each linear saves its
    own bf16 cast of it, and the fp32 output is freed when the decoder layer reassigns hidden_states to the
    block's output (a trace's input_layernorm mul.Tensor temporary). Pure bf16 has no such tensor."""
    from memplan.estimate.reserved_forward import layer_blocks
    from memplan.estimate.reserved_terms import HELD, KEPT, RELEASE

    flags = {"seq": 1024, "precision": "bf16-mixed", "framework": "hf"}
    ctx = _ctx("llama-3.2-1b", flags)
    fp32 = 1024 * ctx.run.model.hidden_size * 4
    from memplan.estimate.layer_costs import layer_costs

    blocks = layer_blocks(ctx, 0, layer_costs(ctx.run, ctx.run.model.layers[0], 0)[0])
    kinds = [kind for _, kind, _ in blocks]
    assert kinds.count(KEPT) > 2
    assert [size for size, kind, _ in blocks if kind == HELD] == [fp32, fp32]
    # each held output is released before the next block's norm input and at the layer's end
    assert kinds.count(RELEASE) == 2 and kinds[-1] == RELEASE
    assert kinds.index(HELD) < kinds.index(RELEASE) < len(kinds) - 1 - kinds[::-1].index(HELD)
    pure = _ctx("llama-3.2-1b", {**flags, "precision": "bf16"})
    blocks = layer_blocks(pure, 0, layer_costs(pure.run, pure.run.model.layers[0], 0)[0])
    assert len(blocks) > 2 and HELD not in [kind for _, kind, _ in blocks]


def test_the_16_bit_logits_gradient_is_alive_while_the_heads_gradient_is_made() -> None:
    """After the loss, autograd holds the 16-bit gradient of the logits while the head's matmul makes the head's
    weight gradient (traces of gpt-oss-20b and gemma-2-2b: ``_to_copy``, ``mm``, then the free); the schedule
    freed it before, which put the head's gradient in a hole the trace's cannot offer it."""
    flags = {"seq": 1024, "mbs": 1, "precision": "bf16", "framework": "hf"}
    model = load_model("llama-3.2-1b")
    events = _schedule("llama-3.2-1b", flags)
    half = 1024 * model.vocab_size * 2
    head = model.vocab_size * model.hidden_size * 2
    start = events.index(("moment", "loss"))
    after = events[start:events.index(("moment", "backward"), start)]
    made, head_made, freed = after.index(("take", half)), after.index(("take", head)), after.index(("give", half))
    assert made < head_made < freed
