"""Rank functions for MPipe: the tiny VL model's vision tower spread over the pipeline
ranks, one training step vs one device -- loss and every gradient, the tower's included."""
from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

from hyper_parallel.core.pipeline_parallel import ImageFeatures, Preprocess, build_stages, schedule_facts
from hyper_parallel.core.pipeline_parallel.image_features import INTO
from hyper_parallel.local import full
from tests.pipeline.workers import lm_loss


@functools.lru_cache(maxsize=None)
def _built(levels: int, level_grad: bool, n_layers: int):
    from autoplan.models.vision_language import build_vision_language
    model = build_vision_language(seed=0, deepstack_levels=levels, deepstack_grad=level_grad, n_layers=n_layers)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def vl_model(levels: int = 0, level_grad: bool = True, n_layers: int = 4):
    return copy.deepcopy(_built(levels, level_grad, n_layers))


def vl_tp_plan() -> dict:
    """Megatron TP for the decoder blocks and for the tower's attention and MLP."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel
    block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel()}
    vit = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
           "attn.o_proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    return {"layers.*": block, "visual.blocks.*": vit}


def _errors(named, ref_grads) -> tuple[float, int]:
    """Largest gradient error over ``named`` parameters and how many were compared."""
    worst, n = 0.0, 0
    for name, p in named:
        ref = ref_grads[name]
        if ref is None:  # no gradient on one device (a detached DeepStack level): zero or none here
            ref = torch.zeros(p.shape)
        got = full(p.grad) if p.grad is not None else torch.zeros_like(ref)
        # scaled so that err < 1e-4 exactly when every element meets rtol 1e-4 / atol 1e-6 (a k_proj
        # bias has a true gradient of 0 -- softmax ignores a per-row shift -- so relative-to-max fails)
        err = ((got - ref).abs() / (1e-6 + 1e-4 * ref.abs())).max().item() * 1e-4
        worst, n = max(worst, err), n + 1
    return worst, n


def _fsdp(stages, dp_mesh) -> None:
    from hyper_parallel import fully_shard
    for st in stages:
        for layer in [u for u in st.module.units if u.startswith("layers.")]:
            fully_shard(st.module.get_submodule(layer), mesh=dp_mesh)
        fully_shard(st.module, mesh=dp_mesh)


def run_mpipe(cases, tp: int = 1, dp: int = 1, overlap: bool = False, second_step: bool = False) -> list[dict]:
    """cases: (schedule name, n_microbatches, deepstack levels, levels need grad, placement, batch).
    tp=1, dp=1: pp = world; tp=2: a (pp, tp) mesh with TP in the tower and the decoder; dp=2: a
    (dp, pp) mesh, FSDP on the decoder stages, each dp rank on its half of the batch. With
    ``second_step`` a second step runs without zeroing: every gradient must then be twice one
    device's (the tower's sum over pipeline ranks must add this step's contribution only)."""
    from autoplan.models.vision_language import vl_batch
    from hyper_parallel import parallelize_module
    from hyper_parallel.local import cached_mesh
    world = dist.get_world_size()
    pp = world // (tp * dp)
    group, tp_mesh, dp_mesh = None, None, None
    if tp > 1:
        mesh = cached_mesh((pp, tp), ("pp", "tp"))
        group, tp_mesh = mesh["pp"].get_group(), mesh["tp"]
    elif dp > 1:
        mesh = cached_mesh((dp, pp), ("dp", "pp"))
        group, dp_mesh = mesh["pp"].get_group(), mesh["dp"]
    out = []
    for name, m, levels, level_grad, placement, batch in cases:
        cls = schedule_facts(name).schedule_class
        n_layers = max(4, cls.ir(pp, m).n_stages)
        ref = vl_model(levels, level_grad, n_layers)
        x, pv, y = vl_batch(ref, batch, 12)
        ref_loss = lm_loss(ref(x, pv), y)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        model = vl_model(levels, level_grad, n_layers)
        if tp > 1:
            parallelize_module(model, tp_mesh, vl_tp_plan(), src_data_rank=None)
        stages = build_stages(model, cls.ir(pp, m), group=group, activation_mesh=tp_mesh)
        if dp > 1:
            _fsdp(stages, dp_mesh)
            r, per = dp_mesh.get_local_rank(), batch // dp
            x, pv, y = x[r * per:(r + 1) * per], pv[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        pre = Preprocess(model.visual, inputs=("pixel_values",), into="vision", placement=placement)
        sched = cls(stages, m, lm_loss, preprocess=pre, overlap=overlap,
                    dp_group=dp_mesh.get_group() if dp > 1 else None)
        losses: list = []
        loss = sched.step(x, target=y, pixel_values=pv, losses=losses)
        if second_step:
            sched.step(x, target=y, pixel_values=pv)
            ref_grads = {n: None if g is None else 2 * g for n, g in ref_grads.items()}
        stage_err, n_stage = _errors([(n, p) for st in stages for n, p in st.module.named_parameters()], ref_grads)
        tower_err, n_tower = _errors([("visual." + n, p) for n, p in model.visual.named_parameters()], ref_grads)
        loss_err = None
        if loss is not None:
            if dp > 1:   # each dp rank's loss is its half's mean; the global mean is their mean
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=dp_mesh.get_group())
                loss /= dp
            loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        out.append(dict(case=(name, m, levels, level_grad, placement), loss_err=loss_err, grad_err=stage_err,
                        tower_err=tower_err, n_params=n_stage, n_tower=n_tower, n_losses=len(losses),
                        ir=sched.ir.name))
    return out


@functools.lru_cache(maxsize=None)
def _llava():
    import transformers
    vc = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=8, patch_size=4, num_channels=3, projection_dim=16)
    tc = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=95, vision_feature_layer=-2,
                                   vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def run_llava_mpipe(cases) -> list[dict]:
    """transformers' LLaVA (CLIP tower + projector, Llama decoder) under MPipe at pp = world.
    cases: (schedule name, n_microbatches)."""
    pp = dist.get_world_size()
    out = []
    for name, m in cases:
        ref = copy.deepcopy(_llava())
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, 90, (8, 12), generator=g)
        x[:, 1:5] = 95     # 2x2 patches, CLS dropped: 4 image tokens per sequence
        y = torch.randint(0, 96, (8, 12), generator=g)
        pv = torch.randn(8, 3, 8, 8, generator=g)
        ref_loss = lm_loss(ref(input_ids=x, pixel_values=pv).logits, y)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        model = copy.deepcopy(_llava())
        cls = schedule_facts(name).schedule_class
        stages = build_stages(model, cls.ir(pp, m), side=False)
        tower = ImageFeatures(model)
        sched = cls(stages, m, lm_loss, preprocess=Preprocess(tower, ("pixel_values",), into=INTO,
                                                              unpack=tower.unpack))
        loss = sched.step(x, target=y, pixel_values=pv)
        stage_err, n_stage = _errors([(n, p) for st in stages for n, p in st.module.named_parameters()], ref_grads)
        tower = [(n, p) for n, p in model.named_parameters() if n.startswith(("model.vision_tower.",
                                                                              "model.multi_modal_projector."))]
        tower_err, n_tower = _errors(tower, ref_grads)
        loss_err = None if loss is None else abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        out.append(dict(case=(name, m), loss_err=loss_err, grad_err=stage_err, tower_err=tower_err,
                        n_params=n_stage, n_tower=n_tower, n_losses=m if loss is not None else 0))
    return out
