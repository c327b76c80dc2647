"""The layout a plan picked, as the main job's config overrides: what ``launch/tpu_pod.sh --plan-layout`` appends
to the job it launches, so the user never copies a mesh by hand.

``python -m trace_jax.plan`` without ``--mesh`` searches the train step's layouts (mesh x micro-batches x remat)
and records the first that fits under ``train.fits`` of its JSON: ``mesh`` (axis sizes over one slice) and
``settings`` (``micro_rows``, ``remat``, ``windowed_einsum``...). The job reads the same things from ``mesh.*``,
``ppo.micro_rows``, ``ppo.remat`` and ``ppo.windowed_einsum``; :data:`LAYOUT_KEYS` are those keys.
"""

from __future__ import annotations

from typing import Any

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The job's keys a layout sets; an override of any of them pins the layout (the plan then checks it, not picks it).
LAYOUT_KEYS = (*(f"mesh.{axis}" for axis in MESH_AXES), "ppo.micro_rows", "ppo.remat", "ppo.windowed_einsum")


class NoLayout(ValueError):
    """The plan found no train layout that fits (or was not asked for one)."""


def layout_overrides(plan: dict[str, Any], slices: int = 1) -> list[str]:
    """``--config.key=value`` for each of :data:`LAYOUT_KEYS`, from the layout ``plan`` (the planner's JSON)
    picked for the train step, for a job over ``slices`` slices (``mesh.slices``; each slice is laid out as the
    plan's mesh). ``ppo.micro_rows`` counts every slice's rows: the plan's, one slice's, times ``slices``. An
    axis the plan's mesh leaves out (``expert`` of a dense model) is 1. Raises :class:`NoLayout` when the plan
    has no fitting train layout."""
    chosen = (plan.get("train") or {}).get("fits")
    if chosen is None:
        tried = len((plan.get("train") or {}).get("tried", ()))
        raise NoLayout(
            f"the plan of {plan.get('model')} on {(plan.get('topology') or {}).get('name')} found no train layout "
            f"that fits among {tried} compiled candidates: use a larger slice, fewer rows or a shorter sequence"
        )
    mesh, settings = chosen["mesh"], chosen["settings"]
    values = {f"mesh.{axis}": mesh.get(axis, 1) for axis in MESH_AXES}
    values["ppo.micro_rows"] = settings["micro_rows"] * slices
    values["ppo.remat"] = settings["remat"]
    values["ppo.windowed_einsum"] = settings.get("windowed_einsum", True)  # plans made before the key: the default
    return [f"--config.{key}={values[key]}" for key in LAYOUT_KEYS]


def pinned_keys(overrides: list[str]) -> list[str]:
    """The :data:`LAYOUT_KEYS` that ``overrides`` (``--config.key=value`` words) set."""
    keys = {o.removeprefix("--config.").partition("=")[0] for o in overrides if o.startswith("--config.")}
    return [key for key in LAYOUT_KEYS if key in keys]
