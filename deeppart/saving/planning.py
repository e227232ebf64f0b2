"""Stage 1 of a save: the plan. The one place that decides where a save's
plan comes from, in this order:

1. a plan the caller gave (``save(plan=...)``), checked against the state;
2. the last plan, while the state's structure is unchanged (repeated saves
   of a :class:`~deeppart.Checkpointer` or a level backend reuse it);
3. the planner service, when ``planner=`` names one
   (:func:`deeppart.service.resolve_planner`; an unreachable service means
   a warning and an in-process plan);
4. in process, through the plan cache (:func:`deeppart.plan`).

Planning is deterministic, so every rank computes the same plan itself;
:mod:`deeppart.saving.prepare`'s agreement catches any rank that did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deeppart._planner import Manifest, Plan
from deeppart.errors import StateMismatchError
from deeppart.saving.plan_cache import plan as plan_in_process

__all__ = ["PlanProvider"]


@dataclass
class PlanProvider:
    """Gives the plan for a manifest (see the module docstring for the
    order). Call it with the manifest; ``last`` is the plan it gave last."""

    world_size: int
    #: A ready plan of this state for this world size (``save(plan=...)``).
    given: Plan | None = None
    #: None (plan in process), "local", a service URL or a PlannerClient.
    planner: Any = None
    algorithm: str | None = None
    cost: Any = None
    topology: Any = None
    #: Reuse the last plan while the manifest is the same.
    reuse: bool = False
    #: The in-process planner's cache (``deeppart.plan``'s ``cache=``; None:
    #: the default cache, False: none).
    cache: Any = None
    last: Plan | None = None

    def __call__(self, manifest: Manifest) -> Plan:
        if self.given is not None:
            if self.given.world_size != self.world_size or self.given.manifest != manifest:
                raise StateMismatchError(
                    "the given plan was made for another state or world size "
                    f"({self.given.world_size} ranks); re-plan"
                )
            self.last = self.given
            return self.given
        if self.reuse and self.last is not None and self.last.manifest == manifest:
            return self.last
        self.last = self._new_plan(manifest)
        return self.last

    def _new_plan(self, manifest: Manifest) -> Plan:
        kwargs: dict[str, Any] = {}
        if self.algorithm is not None:
            kwargs["algorithm"] = self.algorithm
        if self.cost is not None:
            kwargs["cost"] = self.cost
        if self.topology is not None:
            kwargs["topology"] = self.topology
        if self.planner is not None:
            # The service is optional (grpcio): imported only when asked for.
            from deeppart.service import plan_with

            made: Plan = plan_with(self.planner, manifest, self.world_size, **kwargs)
            return made
        if self.cache is not None:
            kwargs["cache"] = self.cache
        return plan_in_process(manifest, self.world_size, **kwargs)
