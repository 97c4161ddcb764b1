"""Field docstrings of a dataclass, read from its source.

This codebase documents a config's fields with the string literal after each annotated field (PEP 257 attribute
docstrings). ``attribute_docs(ServiceConfig)`` reads them back as ``{field: text}``, so that command-line help says
what the code says, from one place. Limits: without the ``.py`` source (a bytecode-only install) it returns {} and help falls back to the names.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import cast


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for the string literals that follow the annotated fields in ``cls``'s source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = cast(ast.ClassDef, tree.body[0]).body
    return {
        node.target.id: inspect.cleandoc(after.value.value)
        for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
