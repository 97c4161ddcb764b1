"""Derive TorchTitan's ``ZephonRayDataLoader.Config`` fields from :class:`zephon_ray.stream.loader.LoaderConfig`.

TorchTitan 0.3.0 reads a loader's config as a class: ``Configurable`` wants a nested ``Config`` dataclass
(``kw_only=True, slots=True``) and its CLI (tyro) builds ``--dataloader.<field>`` flags from the class's fields. Both
see a class made by :func:`dataclasses.make_dataclass` exactly like a written one, so the field list is derived from
``LoaderConfig`` here instead of copied: a field added to ``LoaderConfig`` reaches TorchTitan's config, its CLI and
its ``--override.imports`` hook with no edit (``tests/test_torchtitan_loader.py::
test_the_torchtitan_config_derives_every_loader_config_field``).

The one thing a made class lacks is source, where the field docstrings live and where tyro and pydoc look for them.
:func:`attribute_docs` reads them from ``LoaderConfig``'s source, and :func:`docstring_with_attributes` writes them
into the made class's ``__doc__`` as a Google-style ``Attributes:`` section, which pydoc shows and tyro parses into
each flag's help (``tests/test_torchtitan_loader.py::test_torchtitan_help_shows_every_field_docstring``).

Limits: without the ``.py`` source (a bytecode-only install) the help has no field texts; the fields still work.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, NamedTuple


class Extra(NamedTuple):
    """A field the derived class declares itself, or a LoaderConfig field whose default (or doc) differs there."""

    type: Any
    default: Any
    doc: str


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for the string literals that follow the annotated fields in ``cls``'s source (PEP 257
    attribute docstrings); {} when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def docstring_with_attributes(summary: str, docs: dict[str, str]) -> str:
    """``summary`` and an ``Attributes:`` section, one line per field (docstring_parser's Google style, which tyro
    reads for ``--help``)."""
    lines = [summary, "", "Attributes:"]
    lines += [f"    {name}: {' '.join(doc.split())}" for name, doc in docs.items()]
    return "\n".join(lines)


def derive_config(name: str, *, source: type, bases: tuple[type, ...], extras: dict[str, Extra],
                  namespace: dict[str, Any], summary: str) -> type:
    """A ``kw_only=True, slots=True`` dataclass named ``name`` (``namespace`` must hold ``__module__`` and
    ``__qualname__``, so pickle and tyro find it where it is assigned) with every field of ``source`` (type and
    default; a default_factory is kept), each replaced by ``extras`` where named there, then the other ``extras``."""
    hints = typing.get_type_hints(source)
    docs = attribute_docs(source)
    docs.update((field_name, extra.doc) for field_name, extra in extras.items())
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(source):  # source's order, then the extras': the order of the --help
        if f.name in extras:
            continue  # added below, in source's place
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise TypeError(f"{source.__name__}.{f.name} has no default: give it one in extras for {name}")
        specs.append((f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory)))
    position = {f.name: i for i, f in enumerate(dataclasses.fields(source))}
    for field_name, extra in extras.items():
        specs.append((field_name, extra.type, dataclasses.field(default=extra.default)))
    specs.sort(key=lambda spec: position.get(spec[0], len(position)))  # stable: the extras keep their order
    namespace = dict(namespace, __doc__=docstring_with_attributes(
        summary, {spec[0]: docs[spec[0]] for spec in specs if spec[0] in docs}))
    return dataclasses.make_dataclass(name, specs, bases=bases, namespace=namespace, kw_only=True, slots=True)
