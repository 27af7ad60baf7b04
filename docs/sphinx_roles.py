"""A griffe extension of the docs build (mkdocs.yml): the docstrings' Sphinx roles
(:class:`X`, :func:`f`, :mod:`m`, ...), which Markdown does not have, become code spans."""
import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
