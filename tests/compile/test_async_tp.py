"""Async tensor parallelism: asked for where it cannot run, refused by name before the model is
touched; where its patterns can be checked (any machine: torch's pass is graph rewriting), every
tensor-parallel linear of a planned block sits inside a fused collective-matmul in the forward."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from autoplan import autoplan
from autoplan.verify.async_tp import check_async_tp
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.core.compile import CompileSpec
from hyper_parallel.errors import AsyncTPError
from hyper_parallel.local import fake_world
from hyper_parallel.parallel_dims import ParallelDims
from torch.distributed.device_mesh import init_device_mesh

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _plan(sequence_parallel: bool):
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return autoplan(meta, ParallelDims((2,), ("tp",), "cpu"), hardware="cpu", allow_replicated_units=False,
                    batch=(4, 16), sequence_parallel=sequence_parallel)


def _recipe():
    return ModelRecipe(hf_config={**LlamaConfig(**CONFIG).to_dict(), "model_class": "LlamaForCausalLM"}, seed=3)


@pytest.mark.parametrize("spec", [{"async_tp": True}, {"mode": "blocks", "backend": "aot_eager", "async_tp": True}])
def test_async_tp_needs_a_compiled_mode_and_inductor(spec):
    with pytest.raises(AsyncTPError, match="inductor"):
        CompileSpec.of(spec)
    assert CompileSpec.of({"mode": "blocks", "async_tp": True}).to_dict()["async_tp"] is True


@pytest.mark.parametrize("sequence_parallel,match", [(True, "CUDA devices only.*backend is 'fake'"),
                                                     (False, "stream layout is 'R'")])
def test_async_tp_is_refused_here_before_the_model_is_touched(sequence_parallel, match):
    plan = _plan(sequence_parallel)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = _recipe().build()
        with pytest.raises(AsyncTPError, match=match):
            plan.apply(model, mesh, compile={"mode": "blocks", "async_tp": True})
        assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_every_tensor_parallel_linear_of_a_planned_block_fuses_in_the_forward():
    result = check_async_tp(_plan(True), _recipe())
    assert result.expected == 7, result.summary()   # q, k, v, o, gate, up, down
    assert result.ok, result.summary()
    assert result.forward["all_gather"] == 2 and result.forward["reduce_scatter"] == 2, result.summary()
    # the backward: the gathered output gradients of o and down fuse with their input-gradient matmuls;
    # the input gradients of q/k/v and gate/up are summed before their reduce-scatter, which torch's pass
    # does not fuse
    assert result.backward["matmuls"] == 2 and result.backward["left"] >= 2, result.summary()
    assert result.cannot_run and "patterns checked" in result.summary()
    with pytest.raises(ValueError, match="stream layout"):
        check_async_tp(_plan(False), _recipe())


def test_train_refuses_async_tp_on_an_eager_run_by_its_flags():
    from autoplan.train.config import TrainConfig
    from autoplan.train.errors import TrainConfigError
    from autoplan.train.loop import compile_spec

    cfg = TrainConfig(model="titan-llama-debug", compile="none", async_tp=True)
    with pytest.raises(TrainConfigError, match="--async-tp with --compile none"):
        compile_spec(cfg, torch.device("cpu"))
    assert compile_spec(TrainConfig(model="titan-llama-debug", compile="blocks", async_tp=True),
                        torch.device("cpu")).async_tp is True


def test_verify_checks_the_fusions_a_plan_priced_with_async_tp():
    from autoplan.verify import verify

    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**CONFIG))
    plan = autoplan(meta, ParallelDims((2,), ("tp",), "cpu"), hardware="cpu", allow_replicated_units=False,
                    batch=(4, 16), sequence_parallel=True, overlap="async_tp")
    result = verify(plan, meta)
    assert result.passed, (result.error, result.async_tp)
    assert result.async_tp.ok and result.async_tp.expected == 7, result.async_tp.summary()
    assert verify(plan.replace(predictions=dict(plan.predictions, overlap="none")), meta).async_tp is None


def test_a_biased_projection_is_not_fused_and_not_expected_to_be():
    """GPT-2's Conv1D adds its bias in the matmul (addmm), which torch's pass does not rewrite: its
    forward collectives stay, the planner prices them exposed, and the check agrees."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    with torch.device("meta"):
        meta = GPT2LMHeadModel(cfg)
    plan = autoplan(meta, ParallelDims((2,), ("tp",), "cpu"), hardware="cpu", allow_replicated_units=False,
                    batch=(4, 16), sequence_parallel=True)
    result = check_async_tp(plan, ModelRecipe(hf_config={**cfg.to_dict(), "model_class": "GPT2LMHeadModel"}, seed=3))
    assert (result.expected, result.biased) == (0, 4), result.summary()
    assert result.forward["matmuls"] == 0 and result.forward["left"] > 0 and result.ok is True, result.summary()
