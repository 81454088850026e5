"""Plans are for people: exports, imports, explain, diff, compare, per-stage tables and plots.

Everything here reads a :class:`~autoplan.plan.Plan` as data and turns it into something a
person (or another framework) can use: a torch-native style dict, HF ``tp_plan`` strings, a
Python snippet, an explanation of one decision, a diff of two plans, a comparison table, a
figure that shows itself in notebooks (``PlanFigure``) or one self-contained HTML page of a
whole plan or of several side by side (``write_report``). Nothing here changes a plan or
makes one: review sits below the planner (``Plan``'s ``explain``, ``diff``, ``plot_*`` ... call
it), and importing hand-written plans, which prices them with the planner, is
``autoplan.importers``, above both.
"""
from autoplan.review.compare import compare_plans
from autoplan.review.diff import diff
from autoplan.review.explain import Explanation, explain
from autoplan.review.exports import HFExport, to_hf_tp_plan, to_python, to_torch
from autoplan.review.modules import module_table
from autoplan.review.plots import new_figure, plot_communication, plot_memory, plot_timeline, save_figure
from autoplan.review.report import plan_report, write_report
from autoplan.review.stages import simulate_pipeline, stage_table

__all__ = [
    "compare_plans", "diff", "explain", "Explanation", "to_torch", "to_hf_tp_plan", "to_python", "HFExport",
    "module_table", "plot_communication", "plot_memory", "plot_timeline", "save_figure", "simulate_pipeline",
    "stage_table", "new_figure", "plan_report", "write_report",
]
