"""Pipeline parallelism: the model cut into stages over the pp dimension, run by a schedule.

Plan section ``parallel.pp``: null without a pipeline, else the schedule (a name from
hyper_parallel's table of schedule facts), stages per rank, micro-batches, the cuts, and every
pipeline rank's predicted collectives and parameter bytes (verify dry-runs each rank). The runtime
side is the pipeline runner (``autoplan.plan.pipeline_runner``): it applies the entries before the
cut to the whole model, builds this rank's stages, then applies the others to the stages --
pipeline parallelism goes around the rest.
"""
from __future__ import annotations

from autoplan.parallelisms.base import Parallelism, section_error
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, schedule_facts
from hyper_parallel.core.pipeline_parallel.mpipe_ir import PLACEMENTS as OWNER_PLACEMENTS

TOWER_PLACEMENTS = ("stage0", "own_stage", "mpipe")

_D = "#/$defs/"
_STAGE_ROW = {"type": "object", "required": ["stage", "rank", "compute_s", "comm_s", "bubble_s", "memory_bytes"],
              "properties": {"stage": {"$ref": _D + "count"}, "rank": {"$ref": _D + "count"},
                             "compute_s": {"$ref": _D + "seconds"}, "comm_s": {"$ref": _D + "seconds"},
                             "bubble_s": {"$ref": _D + "seconds"}, "memory_bytes": {"$ref": _D + "bytes"}}}
_PREPROCESS = {"type": "object", "required": ["module", "inputs", "placement"], "additionalProperties": False,
               "properties": {"module": {"$ref": _D + "name"},
                              "inputs": {"type": "array", "minItems": 1, "items": {"$ref": _D + "name"}},
                              "into": {"$ref": _D + "name"},
                              # inputs the stages read too (Qwen-VL's image_grid_thw): MPipe leaves them in the step
                              "keep": {"type": "array", "items": {"$ref": _D + "name"}},
                              "placement": {"enum": list(TOWER_PLACEMENTS)},
                              "owner_placement": {"enum": list(OWNER_PLACEMENTS)},
                              "choices": {"type": "array", "items": {"type": "object"}}}}


class PipelineParallel(Parallelism):
    name = "pp"
    roles = ("pp",)
    order = 0   # around everything else: the split happens between apply_to_model and apply_to_roots
    schema = {"oneOf": [{"type": "null"}, {
        "type": "object",
        "required": ["pp", "schedule", "virtual_stages", "microbatches", "cuts"],
        "properties": {
            "pp": {"$ref": _D + "positive"},
            "schedule": {"enum": list(SCHEDULE_NAMES)},
            "virtual_stages": {"$ref": _D + "positive"},
            "microbatches": {"$ref": _D + "positive"},
            "microbatch_size": {"$ref": _D + "positive"},
            "stages": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
            "cuts": {"type": "array", "items": {"$ref": _D + "name"}},
            "stage_to_rank": {"type": "array", "items": {"$ref": _D + "count"}},
            "cut_method": {"type": "string"},
            "bubble_fraction": {"$ref": _D + "seconds"},
            "peak_inflight": {"type": "array", "items": {"$ref": _D + "count"}},
            "per_stage": {"type": "array", "items": _STAGE_ROW},
            "collectives_rank": {"$ref": _D + "count"},
            "rank_collectives": {"type": "array", "items": {"type": "array", "items": {"$ref": _D + "collective"}}},
            "rank_param_bytes": {"type": "array", "items": {"$ref": _D + "bytes"}},
            "preprocess": {"oneOf": [{"type": "null"}, _PREPROCESS]},
        }}]}

    def active(self, plan) -> bool:
        return bool(plan.pipeline) and int(plan.pipeline.get("pp", 1)) > 1

    def check(self, pipe, data, roles, degree) -> None:
        pp_name = roles.get("pp")
        pp_mesh = degree.get(pp_name, 1) if pp_name else 1
        if pipe is None:
            if pp_mesh > 1:
                raise section_error("pp", "", f"null, but the mesh has {pp_name}={pp_mesh}")
            return
        pp = pipe["pp"]
        if pp != pp_mesh:
            raise section_error("pp", "pp", f"{pp} but the mesh's pipeline dimension has {pp_mesh} ranks "
                                f"(mesh {degree})")
        try:
            n = schedule_facts(pipe["schedule"], "plan field parallel/pp/schedule").n_stages(pp, pipe["virtual_stages"])
        except ValueError as e:
            raise section_error("pp", "schedule", str(e)) from None
        if pp > 1 and len(pipe["cuts"]) != n - 1:
            raise section_error("pp", "cuts", f"{pipe['schedule']} on pp={pp} has {n} stages, so {n - 1} cuts, "
                                f"got {len(pipe['cuts'])}")
        if len(set(pipe["cuts"])) != len(pipe["cuts"]):
            raise section_error("pp", "cuts", f"{pipe['cuts']} repeats a cut")
        s2r = pipe.get("stage_to_rank")
        if s2r is not None and (len(s2r) != n or any(r >= pp for r in s2r)):
            raise section_error("pp", "stage_to_rank", f"{s2r} is not {n} ranks below pp={pp}")
        if pp > 1:
            for key in ("stages", "per_stage", "stage_to_rank"):
                if len(pipe.get(key) or []) != n:
                    raise section_error("pp", key, f"a {pipe['schedule']} plan on pp={pp} has {n} stages; "
                                        "expected one entry per stage")
        check_preprocess(pipe.get("preprocess"))
        gb = data["batch"].get("global_batch")
        dp = 1
        for role in ("dp_replicate", "dp"):
            dp *= degree.get(roles.get(role), 1) if roles.get(role) else 1
        if gb is not None and (gb % dp or (gb // dp) % pipe["microbatches"]):
            raise section_error("pp", "microbatches", f"{pipe['microbatches']} does not divide the per-dp-rank "
                                f"batch {gb}/{dp}")


def check_preprocess(pre) -> None:
    """The tower entry beyond its schema: the keyword stage 0 receives must not be a tower input
    (the runtime would overwrite the input with the tower's output)."""
    if not pre:
        return
    if len(set(pre["inputs"])) != len(pre["inputs"]):
        raise section_error("pp", "preprocess/inputs", f"{pre['inputs']} repeats a keyword")
    if pre.get("into", "vision") in pre["inputs"]:
        raise section_error("pp", "preprocess/into", f"{pre.get('into')!r} is also one of the tower's inputs "
                            f"{pre['inputs']}; name the keyword stage 0 receives the tower output under")
