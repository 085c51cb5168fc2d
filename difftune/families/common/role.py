"""A role a family holds: one of its jobs (its adapter targets, loading, conditioning, drawing) as an object.

A family declares each role as a class attribute, as it declares its `layout` and `objective`, and subclasses the role
where it differs from the default. A role reads the family holding it (its names and classes, its other roles) as
`family`: `Family.__init__` gives each family its own copy of each role, bound to it, so a family that inherits a role
from its parent family does not share the parent's binding.
"""

from __future__ import annotations

import copy
from typing import Any, Self


class Role:
    family: Any  # the `Family` holding this role (a role module cannot import family.py, which imports it)

    def held_by(self, family) -> Self:
        """A copy of this role bound to `family`."""
        role = copy.copy(self)
        role.family = family
        return role
