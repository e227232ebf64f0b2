"""Stage 1 of a save: the plan. The one place that decides where a save's
plan comes from, in this order:

1. a plan the caller gave (``PlanOptions(plan=...)``), checked against the state;
2. the last plan, while the state's structure is unchanged (repeated saves
   of a :class:`~deeppart.Checkpointer` or a level backend reuse it);
3. the planner service, when ``PlanOptions(planner=...)`` names one
   (:func:`deeppart.service.resolve_planner`; an unreachable service means
   a warning and an in-process plan);
4. in process, through the plan cache (:func:`deeppart.plan`).

Planning is deterministic, so every rank computes the same plan itself;
:mod:`deeppart.saving.prepare`'s agreement catches any rank that did not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deeppart._planner import Manifest, Plan
from deeppart.errors import StateMismatchError
from deeppart.options import PlanOptions
from deeppart.saving.plan_cache import plan as plan_in_process

__all__ = ["PlanProvider", "in_process_options"]


@dataclass
class PlanProvider:
    """Gives the plan for a manifest (see the module docstring for the
    order), as its :class:`deeppart.PlanOptions` say. Call it with the
    manifest; ``last`` is the plan it gave last."""

    world_size: int
    #: What to plan with (the one declaration of the planning options).
    options: PlanOptions = field(default_factory=PlanOptions)
    #: Reuse the last plan while the manifest is the same.
    reuse: bool = False
    #: The in-process planner's cache (``deeppart.plan``'s ``cache=``; None:
    #: the default cache, False: none).
    cache: Any = None
    last: Plan | None = None

    @classmethod
    def of(cls, planning: object, world_size: int, *, reuse: bool = False) -> PlanProvider:
        """The provider of a save's ``planning=``: a PlanProvider itself
        (a Checkpointer's or a level backend's, shared between saves), or
        one for a :class:`deeppart.PlanOptions` (None: the defaults)."""
        if isinstance(planning, PlanProvider):
            return planning
        if planning is None:
            planning = PlanOptions()
        if not isinstance(planning, PlanOptions):
            raise TypeError(f"planning= takes a deeppart.PlanOptions, not {planning!r}")
        return cls(world_size, planning, reuse=reuse)

    def __call__(self, manifest: Manifest) -> Plan:
        given = self.options.plan
        if given is not None:
            if given.world_size != self.world_size or given.manifest != manifest:
                raise StateMismatchError(
                    "the given plan was made for another state or world size "
                    f"({given.world_size} ranks); re-plan"
                )
            self.last = given
            return given
        if self.reuse and self.last is not None and self.last.manifest == manifest:
            return self.last
        self.last = self._new_plan(manifest)
        return self.last

    def _new_plan(self, manifest: Manifest) -> Plan:
        o = self.options
        kwargs: dict[str, Any] = {}
        if o.algorithm is not None:
            kwargs["algorithm"] = o.algorithm
        if o.cost is not None:
            kwargs["cost"] = o.cost
        if o.topology is not None:
            kwargs["topology"] = o.topology
        if o.planner is not None:
            # The service is optional (grpcio): imported only when asked for.
            from deeppart.service import plan_with

            made: Plan = plan_with(o.planner, manifest, self.world_size, **kwargs)
            return made
        if self.cache is not None:
            kwargs["cache"] = self.cache
        return plan_in_process(manifest, self.world_size, **kwargs)


def in_process_options(plan_for: object) -> PlanOptions | None:
    """The options of ``plan_for`` when it is a :class:`PlanProvider` that
    plans in process (no given plan, no service): the same manifest and
    equal options then give the same plan. None otherwise."""
    if not isinstance(plan_for, PlanProvider):
        return None
    options = plan_for.options
    if options.plan is not None or options.planner is not None:
        return None
    return options
